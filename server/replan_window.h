// ReplanWindow: when to re-plan the rest of an epoch, from the step times the server observes
// for every push (TrainingJob::Replan).
//
// It keeps each worker's last `steps` steps of the running epoch and fires when, over that window,
// the slowest worker's step time is `threshold` times the fastest's or more (the fastest
// judged with one more sample per step, as the controller's hold does), and the gap is
// larger than two standard errors of the two totals (estimated from the spread of their per-step
// times), so noise alone does not re-plan: the split no longer fits the workers' speeds (a
// worker slowed down or sped up mid-epoch, or the plan has not converged yet). It then hands the
// window over as one measurement per worker, for the share policy, and starts afresh so the next
// decision is made on steps run under the new split. It also fires when a worker ran no sample
// over the window, so that the policy may probe it (a worker the controller took to no sample
// is measured again only when given one); the policy keeps the split when no probe is due.
// A new epoch, or Reset(), also starts afresh.
// Pure arithmetic; thread-compatible.
#ifndef DBS_SERVER_REPLAN_WINDOW_H_
#define DBS_SERVER_REPLAN_WINDOW_H_

#include <cstdint>
#include <deque>
#include <map>
#include <optional>
#include <utility>

#include "server/share_policy.h"

namespace dbs {

struct ReplanTrigger {
  // Slowest / fastest step time over the window, the fastest counted with one more sample per
  // step (whole samples: what a plan could still give it); workers without samples excluded.
  double imbalance = 0.0;
  bool idle = false;                  // a worker ran no sample over the window
  std::map<int, Measurement> window;  // by worker id
};

class ReplanWindow {
 public:
  // `noise_margin`: as the dbs controller's, each worker's window total is judged with this many
  // standard deviations of its per-step times added per step, so a split that is balanced for
  // the controller is balanced here.
  ReplanWindow(int steps, double threshold, double noise_margin = 0.0)
      : steps_(steps), threshold_(threshold), noise_margin_(noise_margin) {}

  // One completed step of `epoch`: worker id -> (samples, compute seconds). Returns the window
  // when the rest of the epoch should be re-planned.
  std::optional<ReplanTrigger> Add(int epoch,
                                   const std::map<int, std::pair<int64_t, double>>& step);

  void Reset() { window_.clear(); }

 private:
  const int steps_;
  const double threshold_;
  const double noise_margin_;
  int epoch_ = -1;
  std::map<int, std::deque<std::pair<int64_t, double>>> window_;
};

}  // namespace dbs

#endif  // DBS_SERVER_REPLAN_WINDOW_H_
