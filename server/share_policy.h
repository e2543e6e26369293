// Share policies: how the scheduler turns what workers measured into the next split of the
// global batch.
//
//   dbs           the default: a per-worker step-time model and a damped controller that
//                 converges even when a worker's speed depends on its batch
//                 (server/balancing_policy.h, docs/controller.md);
//   proportional  the paper's rule: share proportional to the last measured speed;
//   fixed         the equal split of plain S-SGD, or the weights the job gives each worker by
//                 name (WeightedSplitPolicy, dbs_ps --fixed_split).
// SmoothedPolicy wraps any of them with an EMA and a dead-band. Policies are pure functions of
// their observations (all controller state is derived from the measured history, so a restored
// checkpoint plans exactly as the original would have); thread-compatible.
#ifndef DBS_SERVER_SHARE_POLICY_H_
#define DBS_SERVER_SHARE_POLICY_H_

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"

namespace dbs {

enum class PolicyKind { kDbs, kProportional, kFixed };

// "dbs", "proportional", "fixed".
std::string PolicyName(PolicyKind kind);
// INVALID_ARGUMENT naming the accepted names for anything else.
absl::StatusOr<PolicyKind> ParsePolicy(const std::string& name);

// Mid-epoch re-planning (see ReplanWindow): by default the dbs policy judges the balance every
// kDbsReplanWindowSteps steps, so it converges within the first epochs instead of after many;
// the paper's rule keeps to epoch boundaries. `configured` < 0 asks for that default; 0 turns
// re-planning off. The fixed split never re-plans, whatever is configured.
constexpr int kDbsReplanWindowSteps = 8;
constexpr double kDefaultReplanThreshold = 1.15;
// dbs: how many standard deviations of a worker's per-step time are added to its predicted step
// (BalancingOptions::noise_margin).
constexpr double kDefaultNoiseMargin = 1.0;
int ReplanWindowSteps(PolicyKind kind, int configured);

// Steps run at one batch size, their seconds in all and the sum of their squares (for the
// spread of the per-step times).
struct BatchTime {
  int steps = 0;
  double seconds = 0.0;
  double square_seconds = 0.0;
  void Add(double step_seconds) {
    steps += 1;
    seconds += step_seconds;
    square_seconds += step_seconds * step_seconds;
  }
  bool operator==(const BatchTime& o) const {
    return steps == o.steps && seconds == o.seconds && square_seconds == o.square_seconds;
  }
};

// What one worker did in one measurement: an epoch, or the last steps of the running epoch.
struct Measurement {
  int64_t samples = 0;
  // Its steps' seconds: as the server observed them (the sum of by_batch) where it has them,
  // otherwise as the worker reported its compute.
  double compute_seconds = 0.0;
  int steps = 0;
  // Steps and compute seconds by batch size, from the per-step times sent with every push; empty
  // when only the totals above are known (then samples / steps is taken as the batch).
  std::map<int, BatchTime> by_batch;

  // The batch most of the measurement's steps used.
  double MainBatch() const;
};

// What the scheduler knows about a worker when it plans.
struct WorkerObservation {
  std::string name;                  // as it registered
  double previous_share = 0.0;       // 0: the worker was not in the last plan
  int current_batch = 0;             // its batch in the plan it runs now
  std::vector<Measurement> history;  // oldest first; empty for a worker never measured
  // Its newest steps: how many in a row it ran without a sample (idle), and with at most one
  // (idle, or probed with one sample by the dbs policy). 0 when it computes more now.
  int idle_steps = 0;
  int out_steps = 0;
};

// Turns observations into the next shares (same order, summing to 1).
class SharePolicy {
 public:
  virtual ~SharePolicy() = default;
  virtual PolicyKind kind() const = 0;
  std::string name() const { return PolicyName(kind()); }
  virtual std::vector<double> NextShares(absl::Span<const WorkerObservation> workers) const = 0;
  // Epoch 0's split, before anything was measured: equal, unless the policy knows better.
  virtual std::vector<double> FirstShares(absl::Span<const WorkerObservation> workers) const;
  // Whether a worker of this name may join (a fixed split by name refuses names it lacks).
  virtual absl::Status Admits(const std::string& name) const;
};

// Plain S-SGD: every worker gets 1/n, whatever it measured.
class EqualSplitPolicy : public SharePolicy {
 public:
  PolicyKind kind() const override { return PolicyKind::kFixed; }
  std::vector<double> NextShares(absl::Span<const WorkerObservation> workers) const override;
};

// A fixed split by name: worker i's share is weight(name_i) / the sum of the weights of the
// workers in the plan, from epoch 0 on, whatever they measure. A weight may be 0 (the worker
// trains on nothing and only keeps its parameters in step); if every worker in a plan has weight
// 0 they split equally. Names without a weight are refused at registration (Admits).
class WeightedSplitPolicy : public SharePolicy {
 public:
  explicit WeightedSplitPolicy(std::map<std::string, double> weights)
      : weights_(std::move(weights)) {}
  PolicyKind kind() const override { return PolicyKind::kFixed; }
  std::vector<double> NextShares(absl::Span<const WorkerObservation> workers) const override;
  std::vector<double> FirstShares(absl::Span<const WorkerObservation> workers) const override {
    return NextShares(workers);
  }
  absl::Status Admits(const std::string& name) const override;

 private:
  std::map<std::string, double> weights_;
};

// The paper's rule: speed v_i = samples_i / compute_seconds_i of the newest measurement,
// share_i = v_i / sum_j v_j. A worker without a usable measurement is given the mean speed of the
// others, so it is probed again rather than starved; with no measurement at all the split is equal.
// With `speed_window` > 1 a worker's speed is the lowest over its last `speed_window`
// measurements (a crude damping; the dbs policy does this properly).
class ProportionalPolicy : public SharePolicy {
 public:
  explicit ProportionalPolicy(int speed_window = 1) : speed_window_(speed_window) {}
  PolicyKind kind() const override { return PolicyKind::kProportional; }
  std::vector<double> NextShares(absl::Span<const WorkerObservation> workers) const override;

 private:
  int speed_window_;
};

// Smooths another policy: shares = alpha * new + (1 - alpha) * previous, and keeps the previous
// shares when no worker's share would move by more than `deadband` (relative).
// alpha = 1 and deadband = 0 change nothing.
class SmoothedPolicy : public SharePolicy {
 public:
  SmoothedPolicy(std::unique_ptr<SharePolicy> inner, double alpha, double deadband)
      : inner_(std::move(inner)), alpha_(alpha), deadband_(deadband) {}
  PolicyKind kind() const override { return inner_->kind(); }
  std::vector<double> NextShares(absl::Span<const WorkerObservation> workers) const override;
  std::vector<double> FirstShares(absl::Span<const WorkerObservation> workers) const override {
    return inner_->FirstShares(workers);
  }
  absl::Status Admits(const std::string& name) const override { return inner_->Admits(name); }

 private:
  std::unique_ptr<SharePolicy> inner_;
  double alpha_, deadband_;
};

struct PolicyConfig {
  PolicyKind kind = PolicyKind::kDbs;
  int global_batch = 128;
  int min_batch = 0;                          // dbs: per-worker bounds
  int max_batch = 0;                          // dbs: 0 = no upper bound
  double noise_margin = kDefaultNoiseMargin;  // dbs: see BalancingOptions
  int speed_window = 1;    // proportional: lowest speed over this many measurements
  double smoothing = 1.0;  // alpha of SmoothedPolicy (1: none)
  double deadband = 0.0;   // relative share change below which nothing moves
  // fixed: each worker's weight by name (empty: the equal split); see WeightedSplitPolicy.
  std::map<std::string, double> fixed_split;
};

// Parses "NAME:WEIGHT[,NAME:WEIGHT...]" (a name may hold ':', the weight follows the last one);
// INVALID_ARGUMENT naming what is wrong. "" gives an empty map.
absl::StatusOr<std::map<std::string, double>> ParseFixedSplit(const std::string& text);
// The same map as text, names in order ("" for none).
std::string FixedSplitText(const std::map<std::string, double>& split);

// INVALID_ARGUMENT, naming the setting, for out-of-range settings.
absl::Status ValidatePolicyConfig(const PolicyConfig& config);
// INVALID_ARGUMENT when ValidatePolicyConfig refuses the configuration.
absl::StatusOr<std::unique_ptr<SharePolicy>> MakeSharePolicy(const PolicyConfig& config);
// The dbs policy's options for `config` (what MakeSharePolicy gives it).
struct BalancingOptions;
BalancingOptions BalancingOptionsOf(const PolicyConfig& config);

}  // namespace dbs

#endif  // DBS_SERVER_SHARE_POLICY_H_
