// The share policy's decisions, written into a run's summary and replayed from it.
//
// A policy is a pure function of its observations (server/share_policy.h), and the observations
// are the measurements of the epochs before plus what each decision adds (the workers' current
// batches and, mid-epoch, their windows of newest steps). The summary records both
// (`controller`, each epoch's `decisions`, each worker's `measured`), so every plan of a
// finished run can be computed again offline: to check that the record is complete (the
// replayed shares equal the recorded ones), to see why the controller chose what it chose
// (bench/replay_plans prints the dbs policy's curves, margins and gains), or to ask what another
// setting would have chosen from the same measurements. Pure functions; no I/O.
#ifndef DBS_SERVER_PLAN_REPLAY_H_
#define DBS_SERVER_PLAN_REPLAY_H_

#include <vector>

#include "absl/status/statusor.h"
#include "nlohmann/json.hpp"
#include "server/scheduler.h"
#include "server/share_policy.h"

namespace dbs {

// Measurement <-> {"samples", "compute_seconds", "steps", "step_times": [{"batch", "steps",
// "seconds", "square_seconds"}, ...]}.
nlohmann::json MeasurementJson(const Measurement& m);
absl::StatusOr<Measurement> MeasurementFromJson(const nlohmann::json& j);

// PolicyConfig <-> {"policy", "global_batch", "min_batch", "max_batch", "noise_margin",
// "speed_window", "smoothing", "deadband", "fixed_split": {name: weight}}.
nlohmann::json PolicyConfigJson(const PolicyConfig& c);
absl::StatusOr<PolicyConfig> PolicyConfigFromJson(const nlohmann::json& j);

// {"from_step", "applied", "workers": [{"id", "current_batch", "previous_share", "share",
// "window" (re-plans only), "idle_steps" and "out_steps" (a worker out of the split only)}]}.
nlohmann::json DecisionJson(const PlanDecision& d);

// One decision of a run, with what the policy was given and what it answered.
struct RecordedDecision {
  int epoch = 0;
  int from_step = 0;  // 0: the epoch's plan
  bool applied = true;
  std::vector<int> ids;
  std::vector<WorkerObservation> observations;  // as the scheduler built them
  std::vector<double> shares;                   // as the policy answered
};

// Every decision in a summary (dbs.run_summary.v1), oldest first. Epochs without decisions
// (restored from a checkpoint, or written before decisions were recorded) are skipped.
// INVALID_ARGUMENT, naming the field, for a malformed summary.
absl::StatusOr<std::vector<RecordedDecision>> DecisionsOf(const nlohmann::json& summary);

// What `policy` answers to the decision's observations (FirstShares for epoch 0's plan).
std::vector<double> Replay(const SharePolicy& policy, const RecordedDecision& decision);

}  // namespace dbs

#endif  // DBS_SERVER_PLAN_REPLAY_H_
