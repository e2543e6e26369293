// BalancingPolicy ("dbs", the default): Dynamic Batch Size as a controller that converges when a
// worker's speed depends on the batch it is given.
//
// Each worker's compute time per step is modelled as a monotone function of its batch, fitted to
// everything the worker was measured doing (StepTimeModel: per-step times by batch size, with
// change detection so a slowed or recovered worker moves its whole curve at once). The plan
// gives every worker the batch at which its curve reaches a common step time tau, with tau chosen
// so the batches sum to the global batch B. Three safeguards make the sequence of plans converge
// instead of oscillating (docs/controller.md has the argument):
//   - trust region: a worker whose curve has two or more points is not moved more than
//     `trust_factor` beyond the range of batches it was measured at, so a wrong extrapolation
//     costs at most one epoch and adds a point where the curve was unknown;
//   - damping: each worker moves a fraction g_i of the way to its target. g_i starts at 1 and
//     halves at every reversal of the worker's correction after the first (the first reversal
//     corrects an extrapolation; a second means the controller is oscillating), down to
//     `min_gain`. The gains are replayed from the batches the worker actually ran since its last
//     change of speed, so they need no state of their own and survive a restart; a detected
//     change of speed restores full gain;
//   - hold: the split is kept while the model says it is balanced (every worker's predicted step
//     within `hold_spread` of the slowest, or unable to take one more sample without becoming
//     the slowest), so noise does not reshuffle shards.
// A worker taken to no sample is probed with one, at intervals that grow while it stays slow
// (BalancingOptions::probe_cost), so it comes back when what slowed it has gone.
// Batches stay within [min_batch, max_batch] and each worker's own cap. With a single point per
// worker (epoch 1) the curve is a line through the origin and the plan is the paper's
// proportional rule. Pure; thread-compatible.
#ifndef DBS_SERVER_BALANCING_POLICY_H_
#define DBS_SERVER_BALANCING_POLICY_H_

#include <vector>

#include "absl/types/span.h"
#include "server/share_policy.h"
#include "server/step_time_model.h"

namespace dbs {

struct BalancingOptions {
  int global_batch = 128;
  int min_batch = 0;
  int max_batch = 0;  // 0: no bound but B
  double trust_factor = 4.0;
  double min_gain = 1.0 / 16;
  double hold_spread = 0.05;
  int history = 16;  // newest measurements per worker that the model uses
  // Noise: a step lasts as long as its slowest worker, so a worker whose step times scatter
  // (a bursty neighbour, a CPU quota's periods) delays the others more often than its mean
  // says. Each worker's curve is raised by this many standard deviations of its per-step
  // times (pooled over its newest `noise_measurements` measurements), so noisy workers get a
  // little less and steady ones a little more. 0: balance the means.
  double noise_margin = 1.0;
  int noise_measurements = 4;
  double noise_prior_dof = 64.0;
  // Probing: a worker at no sample holds a curve that nothing has tested since it went idle
  // (the burst that took it out may be over). It is given one sample for a re-plan window
  // (`probe_steps`) once what that probe is predicted to cost (its excess over the step the
  // others run, for those steps) is at most `probe_cost` of the time it has been idle; after
  // a probe, no sooner than it has been idle again for a third of the time it was out before,
  // so that probes back off while it stays slow.
  double probe_cost = 0.1;
  int probe_steps = kDbsReplanWindowSteps;
  StepTimeModelOptions model;
};

// The controller's decision and the reasons for it.
struct BalancingPlan {
  std::vector<double> batches;          // real-valued, summing to B
  std::vector<double> gains;            // per worker, in (0, 1]
  double current_step_seconds = 0.0;    // slowest predicted step of the current split
  double predicted_step_seconds = 0.0;  // slowest predicted step of the new split
  bool held = false;                    // the current split was kept
};

class BalancingPolicy : public SharePolicy {
 public:
  explicit BalancingPolicy(BalancingOptions options) : options_(options) {}
  PolicyKind kind() const override { return PolicyKind::kDbs; }
  std::vector<double> NextShares(absl::Span<const WorkerObservation> workers) const override;

  BalancingPlan Plan(absl::Span<const WorkerObservation> workers) const;
  // The model of one worker from its newest `options.history` measurements; `relative_noise`
  // (RelativeNoise) lets it pool neighbouring batches whose times differ by less than noise.
  StepTimeModel ModelOf(const WorkerObservation& worker, double relative_noise = 0.0) const;
  // The models Plan uses, before the noise margins: each worker's ModelOf with its RelativeNoise.
  std::vector<StepTimeModel> Models(absl::Span<const WorkerObservation> workers) const;

  // The spread of one worker's per-step times relative to their mean, pooled within each batch
  // size over its newest `options.noise_measurements` measurements: the sum of squared relative
  // deviations and its degrees of freedom.
  struct StepNoise {
    double relative_squares = 0.0;
    double dof = 0.0;
  };
  StepNoise StepNoiseOf(const WorkerObservation& worker) const;
  // Each worker's relative standard deviation of its per-step time, shrunk toward the cluster's
  // pooled one with the weight of `noise_prior_dof` steps; all 0 when nothing was measured.
  std::vector<double> RelativeNoise(absl::Span<const WorkerObservation> workers) const;
  // Each worker's noise margin in seconds: noise_margin standard deviations (RelativeNoise) of
  // its per-step time at its current batch, or, for a worker at no batch now, at the smallest
  // batch it was measured at. 0 for a worker without a model.
  std::vector<double> NoiseMargins(absl::Span<const WorkerObservation> workers,
                                   const std::vector<StepTimeModel>& models) const;

  const BalancingOptions& options() const { return options_; }

 private:
  BalancingOptions options_;
};

}  // namespace dbs

#endif  // DBS_SERVER_BALANCING_POLICY_H_
