// RegistrationClaim: which worker sends the model's initial values.
//
// At a job's start every worker registers the model at once. Each would send its whole model,
// and the server would hold N copies while it keeps only the first: at 10M parameters and 4
// workers, 160 MB more than the job needs, and the server's peak memory. A worker first asks
// with the layout alone (RegisterModelRequest.layout_only); while no model is registered, the
// claim names one of them to send its values and tells the others to ask again once it is done.
//
// A claim lapses when its holder shows no sign of life for `lease` (it died before or while
// sending): the next worker to ask takes it. Thread-safe.
#ifndef DBS_SERVER_REGISTRATION_CLAIM_H_
#define DBS_SERVER_REGISTRATION_CLAIM_H_

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/clock.h"

namespace dbs {

class RegistrationClaim {
 public:
  static constexpr absl::Duration kDefaultLease = absl::Seconds(10);

  // `clock` must outlive the claim.
  explicit RegistrationClaim(const Clock* clock, absl::Duration lease = kDefaultLease)
      : clock_(clock), lease_(lease) {}

  // `worker` is about to send the initial values (or asks whether it should): true when it
  // holds the claim now (it had it, nobody had, or the holder's lease ran out). Taking starts
  // a lease; asking again while holding it does not renew it (only values do: Renew), so
  // asking cannot hold the others off. False while another worker holds a live claim, named in
  // `*holder`, and for a lease after `worker`'s own lease ran out (`*holder` -1 when free).
  bool Take(int worker, int* holder);
  // A sign of life from the holder (a chunk of its values arrived): its lease runs anew.
  // Nothing for anyone else.
  void Renew(int worker);
  // The holder's registration ended, registered or refused: anyone may take the claim again.
  // Nothing for anyone else.
  void Release(int worker);

 private:
  const Clock* const clock_;
  const absl::Duration lease_;
  absl::Mutex mu_;
  int holder_ ABSL_GUARDED_BY(mu_) = -1;  // -1: nobody
  absl::Time expires_ ABSL_GUARDED_BY(mu_);
  int barred_ ABSL_GUARDED_BY(mu_) = -1;  // the last holder whose lease ran out, until:
  absl::Time barred_until_ ABSL_GUARDED_BY(mu_);
};

}  // namespace dbs

#endif  // DBS_SERVER_REGISTRATION_CLAIM_H_
