// JobConfig: everything that defines a training job on the parameter server, and the one place
// where it is checked. Messages name the setting (as the flags of dbs_ps do) but not a flag.
#ifndef DBS_SERVER_JOB_CONFIG_H_
#define DBS_SERVER_JOB_CONFIG_H_

#include <map>
#include <string>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "common/wire_values.h"
#include "server/gradient_screen.h"
#include "server/optimizer.h"
#include "server/scheduler.h"
#include "server/share_policy.h"

namespace dbs {

struct JobConfig {
  SchedulerConfig scheduler;
  PolicyKind policy = PolicyKind::kDbs;
  int speed_window = 1;  // proportional: epochs over which to take a worker's lowest speed
  int min_batch = 0;     // dbs: per-worker batch bounds (0: none above)
  int max_batch = 0;
  double smoothing = 1.0;  // EMA alpha on shares (1: none)
  double deadband = 0.0;   // relative share change below which the split is kept
  // fixed: each worker's weight by name (empty: the equal split); see WeightedSplitPolicy.
  std::map<std::string, double> fixed_split;
  OptimizerConfig optimizer;
  // Abort the job when no push, report or registration arrives for this long once training has
  // started (a worker that died without leaving). Zero disables the check.
  absl::Duration stall_timeout = absl::Minutes(5);
  // A worker that has not pushed a step this long after the first worker of that step did is
  // declared dead: the step completes without it and its samples go to the others. Zero: never.
  absl::Duration worker_timeout = absl::Seconds(60);
  // Mid-epoch re-planning (never with the fixed split): when over the last
  // `replan_window_steps` steps the slowest worker's step time is `replan_threshold` times the
  // fastest's or more (and clear of the noise), the policy re-plans the rest of the epoch with
  // the window as the newest measurement (see ReplanWindow). -1: the policy's default
  // (ReplanWindowSteps); 0: off, the paper's epoch-boundary rule.
  int replan_window_steps = -1;
  double replan_threshold = kDefaultReplanThreshold;
  // dbs: standard deviations of each worker's per-step time added to its predicted step, so a
  // noisy worker (which more often makes the others wait) gets a little less (BalancingOptions).
  double noise_margin = kDefaultNoiseMargin;
  // How gradients and parameters travel in each step (workers learn it when they register);
  // the server keeps and accumulates fp32 whatever travels.
  WireDtype wire_dtype = WireDtype::kFp32;
  // Sum each step's gradients in worker-id order, whatever order they arrive in, so the same job
  // gives bit-identical parameters run after run (AggregatorOptions::deterministic).
  bool deterministic = true;
  // What a faulty worker's gradient meets (dbs_ps --faulty_gradients, --faulty_norm_ratio):
  // by default the worker is quarantined and the job goes on without it.
  ScreenConfig screen;
  // Checkpoints: written into `checkpoint_dir` every `checkpoint_every_steps` completed steps
  // and at the end of every epoch ('' : never).
  std::string checkpoint_dir;
  int checkpoint_every_steps = 50;
};

// INVALID_ARGUMENT, naming the setting, when any part of the configuration is out of range.
absl::Status ValidateJobConfig(const JobConfig& config);

// The share policy's part of the configuration.
PolicyConfig PolicyConfigOf(const JobConfig& config);

// Every setting that shapes the training, by name, as text: stored in checkpoints so that a
// restart with different ones is noticed (the job's size and seed are compared separately).
std::map<std::string, std::string> TrainingSettings(const JobConfig& config);

}  // namespace dbs

#endif  // DBS_SERVER_JOB_CONFIG_H_
