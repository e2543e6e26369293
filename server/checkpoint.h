// Checkpoints of a training job: everything dbs_ps needs to continue after a restart.
//
// A checkpoint holds the parameters and their version, the optimizer's state, the scheduler's
// membership and epoch history (plans, per-step layouts, reports, dead workers), where the step
// barrier stands (epoch, step, losses, the pushes counted this epoch) and the sample audits. Data
// permutations need no RNG state: they are a function of the job seed and the epoch.
//
// File format: "DBSCKPT2", a u64 length and a serialized dbs.checkpoint.v2.Checkpoint
// (proto/checkpoint.proto, which reuses the API's plans, reports, revisions and tensors), then
// the CRC-32 of everything before it. A file that is truncated or altered is refused with
// DATA_LOSS and a reason, one of an older format with FAILED_PRECONDITION saying so; writes go
// through a temporary file and a rename, so a crash never leaves half a checkpoint under the final
// name. Pure functions plus file I/O.
#ifndef DBS_SERVER_CHECKPOINT_H_
#define DBS_SERVER_CHECKPOINT_H_

#include <functional>
#include <map>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "server/run_summary.h"
#include "server/scheduler.h"
#include "server/step_aggregator.h"

namespace dbs {

struct JobState {
  SchedulerConfig config;
  std::string policy;
  std::map<std::string, std::string> settings;  // TrainingSettings of the job
  Scheduler::State scheduler;
  StepAggregator::State aggregator;
  std::map<int, SampleAudit> audits;
};

std::string EncodeCheckpoint(const JobState& state);
// DATA_LOSS for a truncated, altered or unknown file; FAILED_PRECONDITION for an older format.
absl::StatusOr<JobState> DecodeCheckpoint(const std::string& bytes);

// Writes `state` into `dir` as ckpt-<seq>.dbs (seq increasing), keeping the newest `keep` and
// removing the half-written temporaries a killed dbs_ps left behind.
absl::StatusOr<std::string> WriteCheckpoint(const std::string& dir, const JobState& state,
                                            int keep = 3);

// The newest checkpoint in `dir` that decodes (and that `wanted` accepts, when given); each
// file that does not decode is listed in `refused` as "path: reason". NOT_FOUND when there is
// none.
absl::StatusOr<JobState> LoadNewestCheckpoint(
    const std::string& dir, std::vector<std::string>* refused, std::string* path = nullptr,
    const std::function<bool(const JobState&)>& wanted = nullptr);

// The record a job that ended ok leaves in its checkpoint directory (kFinishedRecord, JSON
// text that the caller makes), so that a dbs_ps restarted on that directory (an orchestrator
// restarting the same command, a second `docker-compose up`) finds nothing left to train.
inline constexpr char kFinishedRecord[] = "finished.json";
absl::Status WriteFinishedRecord(const std::string& dir, const std::string& record);
// The record in `dir`; NOT_FOUND when it holds none.
absl::StatusOr<std::string> ReadFinishedRecord(const std::string& dir);
// Removes the record (a new job in the same directory); OK when there is none.
absl::Status RemoveFinishedRecord(const std::string& dir);

}  // namespace dbs

#endif  // DBS_SERVER_CHECKPOINT_H_
