#include "server/registration_claim.h"

namespace dbs {

bool RegistrationClaim::Take(int worker, int* holder) {
  absl::MutexLock lock(&mu_);
  const absl::Time now = clock_->Now();
  if (holder_ >= 0 && now < expires_) {  // a live claim: asking again renews nothing
    *holder = holder_;
    return holder_ == worker;
  }
  if (holder_ >= 0) {  // its holder let the lease run out: it sits the next lease out
    barred_ = holder_;
    barred_until_ = expires_ + lease_;
    holder_ = -1;
  }
  if (worker == barred_ && now < barred_until_) {
    *holder = -1;
    return false;
  }
  holder_ = worker;
  expires_ = now + lease_;
  *holder = worker;
  return true;
}

void RegistrationClaim::Renew(int worker) {
  absl::MutexLock lock(&mu_);
  if (holder_ == worker) expires_ = clock_->Now() + lease_;
}

void RegistrationClaim::Release(int worker) {
  absl::MutexLock lock(&mu_);
  if (holder_ == worker) holder_ = -1;
}

}  // namespace dbs
