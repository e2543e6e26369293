// EpochRecord: everything recorded about one epoch of a job (its plans, their revisions, the
// workers' reports and step times, the share policy's decisions), and what the share policy is
// told a worker was measured doing in it.
#ifndef DBS_SERVER_EPOCH_RECORD_H_
#define DBS_SERVER_EPOCH_RECORD_H_

#include <cstdint>
#include <map>
#include <optional>
#include <set>
#include <utility>
#include <vector>

#include "absl/time/time.h"
#include "common/plan.h"
#include "server/share_policy.h"

namespace dbs {

// One decision of the share policy about an epoch, with the inputs that are not in the epochs'
// records: the epoch's plan (from_step 0) or a mid-epoch re-plan (from_step > 0, each worker's
// window of newest steps). The history a worker's observation held is the measurements of the
// epochs before (MeasurementOf), so a decision can be replayed from the run's
// summary (server/plan_replay.h). Kept for the run's summary only, not in checkpoints.
struct PlanDecision {
  struct Input {
    int id = 0;
    int current_batch = 0;
    double previous_share = 0.0;
    bool has_window = false;
    Measurement window;  // re-plans only
    double share = 0.0;  // the policy's answer
    int idle_steps = 0;  // WorkerObservation's
    int out_steps = 0;
  };
  int from_step = 0;
  std::vector<Input> workers;  // in the order the policy saw them
  bool applied = true;         // false: a re-plan that kept the current split
};

// Everything recorded about one epoch.
struct EpochRecord {
  int epoch = 0;
  absl::Time start;
  absl::Time end;  // when the last report arrived
  // When the newest step of the epoch completed (RecordStep); after the last step, the end of
  // training, before validation and reports. InfinitePast until a step completes.
  absl::Time steps_end = absl::InfinitePast();
  std::map<int, WorkerPlan> plans;     // by worker id, as first planned
  std::map<int, StepRanges> layout;    // by worker id: the positions of each step, as revised
  std::map<int, EpochTiming> reports;  // by worker id
  std::set<int> dead;                  // workers removed during the epoch
  // Per worker, the compute time of its steps by batch size (from the times sent with pushes).
  std::map<int, std::map<int, BatchTime>> step_times;
  // Per worker, the windows of newest steps its re-plans were decided on, oldest first: a
  // re-plan's observation holds them after the epochs before, so the controller learns from
  // every window of the running epoch, not only its newest. Not checkpointed: a restored
  // epoch's re-plans start afresh from the epochs before, as its re-plan window does, and so
  // every recorded decision replays from the run's summary.
  std::map<int, std::vector<Measurement>> windows;
  int num_steps = 0;  // as revised
  int revision = 0;
  bool complete = false;

  // Samples a worker is (now) to train on in the epoch.
  int64_t SamplesOf(int worker_id) const;
};

// What worker `id` was measured doing in epoch `r`, as the share policy sees it (the samples and
// compute of its report, its steps with samples, its step times by batch); nullopt when it did
// not report the epoch.
std::optional<Measurement> MeasurementOf(const EpochRecord& r, int id);

// Decisions the run's summary keeps of an epoch (its plan and the first re-plans).
inline constexpr int kMaxDecisionsPerEpoch = 64;

// An epoch's decisions, in order, as the run's summary keeps them: re-plans beyond the first
// kMaxDecisionsPerEpoch - 1 are only counted, so a long epoch's entry stays small.
struct EpochDecisions {
  std::vector<PlanDecision> kept;
  int left_out = 0;
  void Add(PlanDecision decision) {
    if (static_cast<int>(kept.size()) < kMaxDecisionsPerEpoch) {
      kept.push_back(std::move(decision));
    } else {
      ++left_out;
    }
  }
};

// The batch a worker ran most often in `steps`.
int MostFrequentBatch(const StepRanges& steps);

// Worker `id`'s newest steps before step `step` of epoch `epoch` (records[epoch]; past its
// last step: up to its end), through the epochs before, as WorkerObservation counts them: its
// steps in a row without a sample, and with at most one. A step of an epoch it was not planned
// in, or removed from, ends both runs; so do `max_epochs` epochs.
struct IdleRun {
  int idle_steps = 0;
  int out_steps = 0;
};
IdleRun IdleRunOf(const std::vector<EpochRecord>& records, int id, int epoch, int step,
                  int max_epochs);

}  // namespace dbs

#endif  // DBS_SERVER_EPOCH_RECORD_H_
