#include "server/registration_claim.h"

namespace dbs {

bool RegistrationClaim::Take(int worker, int* holder) {
  absl::MutexLock lock(&mu_);
  const absl::Time now = clock_->Now();
  if (holder_ >= 0 && holder_ != worker && now < expires_) {
    *holder = holder_;
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
