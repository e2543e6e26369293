// The run's record: a machine-readable JSON summary and a short human summary, built from the
// scheduler's history and the aggregator's losses. Pure functions; no I/O.
#ifndef DBS_SERVER_RUN_SUMMARY_H_
#define DBS_SERVER_RUN_SUMMARY_H_

#include <map>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "common/plan.h"
#include "nlohmann/json.hpp"
#include "server/scheduler.h"
#include "server/step_aggregator.h"

namespace dbs {

// Proof that an epoch used every sample exactly once: the positions of the accepted pushes'
// slices, counted over the epoch's permutation.
struct SampleAudit {
  int64_t samples = 0;  // size of the permutation
  int64_t used_once = 0;
  int64_t missing = 0;     // never trained on
  int64_t duplicated = 0;  // trained on more than once
  bool ok() const { return missing == 0 && duplicated == 0 && used_once == samples; }
};

// Counts, over [0, samples), how often the ranges that `accepted` (worker, step) pushes trained on
// cover each position.
SampleAudit AuditEpoch(const EpochRecord& record, const std::set<std::pair<int, int>>& accepted,
                       int64_t samples);

// A worker removed for a faulty gradient (StepAggregator's screen).
struct Quarantine {
  int worker_id = 0;
  int epoch = 0;
  int step = 0;
  std::string reason;
  int64_t samples_reassigned = 0;  // its samples of that step and the epoch's later ones
};

struct RunInfo {
  std::string policy;
  PolicyConfig controller;  // the share policy's settings, for replaying its decisions
  std::string optimizer;
  SchedulerConfig scheduler;
  std::vector<WorkerRegistration> workers;  // by id
  std::vector<EpochRecord> epochs;
  std::map<int, EpochLoss> losses;          // by epoch
  std::map<int, SampleAudit> audits;        // by epoch
  std::map<int, EpochDecisions> decisions;  // by epoch: the share policy's (not checkpointed)
  std::vector<Quarantine> quarantined;
  int64_t faulty_pushes = 0;  // found by the screen, quarantined or (log mode) only logged
  absl::Time start;
  absl::Time end;
  std::string status = "ok";  // "ok" or the error that ended the job
  bool finished = false;      // the job has ended (status says how)
};

// Test accuracy of an epoch over all workers' test slices (0 when nothing was evaluated).
double TestAccuracy(const EpochRecord& record);

// The JSON summary: config, one entry per epoch (wall time, loss, accuracy, and per worker: batch
// size, share, samples, compute/wait/eval seconds), and the totals.
nlohmann::json BuildSummary(const RunInfo& run);

// A few lines for a person: epochs, final accuracy, wall time, balance of the last epoch.
std::string HumanSummary(const RunInfo& run);

// One line about a completed epoch, for the progress log.
std::string EpochLine(const RunInfo& run, const EpochRecord& record);

}  // namespace dbs

#endif  // DBS_SERVER_RUN_SUMMARY_H_
