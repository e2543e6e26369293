// The epoch plan and the epoch timing report as plain structs, shared by server and worker.
#ifndef DBS_COMMON_PLAN_H_
#define DBS_COMMON_PLAN_H_

#include <algorithm>
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "absl/status/status.h"

namespace dbs {

// [begin, end) positions of an epoch's permutation.
struct SampleRange {
  int64_t begin = 0;
  int64_t end = 0;
  int64_t size() const { return end - begin; }
  bool operator==(const SampleRange& o) const { return begin == o.begin && end == o.end; }
};

// One worker's part of an epoch. See proto/dbs.proto (EpochPlan) for the meaning of each field.
struct WorkerPlan {
  int epoch = 0;
  bool finished = false;
  int batch_size = 0;
  int final_batch_size = 0;
  int num_steps = 0;
  int global_batch = 0;
  uint64_t permutation_seed = 0;
  std::vector<SampleRange> train_ranges;
  SampleRange test_range;
  double share = 0.0;
  int total_epochs = 0;

  // The worker's batch size at `step`.
  int BatchAt(int step) const { return step == num_steps - 1 ? final_batch_size : batch_size; }
};

// The positions a worker trains on at each step of an epoch: steps[s] lists the ranges of step s
// (empty when its batch at that step is 0).
using StepRanges = std::vector<std::vector<SampleRange>>;

// Hands out consecutive positions from a list of ranges, in order. `ranges` must outlive it.
class RangeCursor {
 public:
  explicit RangeCursor(const std::vector<SampleRange>& ranges) : ranges_(ranges) {}
  // The next `n` positions (fewer when the ranges run out), as ranges.
  std::vector<SampleRange> Take(int64_t n) {
    std::vector<SampleRange> out;
    while (n > 0 && r_ < ranges_.size()) {
      const SampleRange& range = ranges_[r_];
      const int64_t take = std::min<int64_t>(n, range.size() - used_);
      out.push_back({range.begin + used_, range.begin + used_ + take});
      used_ += take;
      n -= take;
      if (used_ == range.size()) {
        ++r_;
        used_ = 0;
      }
    }
    return out;
  }

 private:
  const std::vector<SampleRange>& ranges_;
  size_t r_ = 0;
  int64_t used_ = 0;  // positions of ranges_[r_] already handed out
};

struct PlanRevision;

// The most steps an epoch may have (the scheduler refuses data sets that would make more), so a
// plan from a peer can be checked before anything is allocated for it.
inline constexpr int kMaxStepsPerEpoch = 1 << 20;
inline constexpr int kMaxGlobalBatch = 1 << 24;

// OK when a plan received from the server is usable on data sets of `train_size` and
// `test_size` samples: step count and batches within limits, every range inside the data.
// INVALID_ARGUMENT saying what is wrong otherwise (a hostile or broken server).
absl::Status ValidatePlan(const WorkerPlan& plan, int64_t train_size, int64_t test_size);
// The same for a revision (or a resume's schedule) of an epoch.
absl::Status ValidateRevision(const PlanRevision& revision, int64_t train_size, int64_t test_size);

// Expands a plan's regular form (batch sizes and ranges consumed in order) into per-step ranges.
// The plan must have passed ValidatePlan.
inline StepRanges ExpandSteps(const WorkerPlan& plan) {
  if (plan.finished || plan.num_steps <= 0 || plan.num_steps > kMaxStepsPerEpoch) return {};
  StepRanges steps(plan.num_steps);
  RangeCursor cursor(plan.train_ranges);
  for (int s = 0; s < plan.num_steps; ++s) steps[s] = cursor.Take(plan.BatchAt(s));
  return steps;
}

inline int64_t CountSamples(const std::vector<SampleRange>& ranges) {
  int64_t n = 0;
  for (const SampleRange& r : ranges) n += r.size();
  return n;
}

// A change to the rest of an epoch, sent to a worker with a step's result (for example when
// another worker died and its samples were shared out): from `from_step` on, the worker trains
// on `steps[s - from_step]`, the epoch now has `num_steps` steps, and it evaluates `test_range`.
struct PlanRevision {
  int epoch = 0;
  int revision = 0;
  int from_step = 0;
  int num_steps = 0;
  StepRanges steps;
  SampleRange test_range;
};

// Per step of an epoch: each participating worker's batch size (0 allowed: it still pushes).
using StepQuotas = std::vector<std::map<int, int>>;

// A change to the rest of an epoch decided at a step (a dead worker's samples shared out, or a
// mid-epoch re-plan): the quotas of the steps after it, through the new last step, and each
// surviving worker's revision.
struct PlanChange {
  StepQuotas later_quotas;
  std::map<int, PlanRevision> revisions;  // by surviving worker
};

// Where a worker should continue after the server restarted (see ParameterService.Resume).
struct ResumePoint {
  bool finished = false;
  int epoch = 0;
  int step = 0;
  bool has_plan = false;
  WorkerPlan plan;
  PlanRevision schedule;  // every step of the epoch, from_step 0
};

// One worker's account of one epoch. See proto/dbs.proto (EpochReport).
struct EpochTiming {
  int worker_id = 0;
  int epoch = 0;
  int64_t samples = 0;
  double compute_seconds = 0.0;
  double wait_seconds = 0.0;
  double eval_seconds = 0.0;
  int64_t test_samples = 0;
  int64_t test_correct = 0;
  double test_loss_sum = 0.0;

  bool operator==(const EpochTiming& o) const {
    return worker_id == o.worker_id && epoch == o.epoch && samples == o.samples &&
           compute_seconds == o.compute_seconds && wait_seconds == o.wait_seconds &&
           eval_seconds == o.eval_seconds && test_samples == o.test_samples &&
           test_correct == o.test_correct && test_loss_sum == o.test_loss_sum;
  }
};

// What a worker tells the scheduler when it joins.
struct WorkerRegistration {
  std::string name;
  int64_t train_samples = 0;
  int64_t test_samples = 0;
  std::string device;
  // Chosen at random by the worker process: a retried registration of the same process carries
  // the same one, another process with the same name a different one.
  std::string incarnation;
  double cpu_limit_cores = 0.0;  // the CPU limit it runs under (0: none), for reports
  // Where the registration came from (the peer's address without its port) and the client
  // certificate it presented (ClientIdentity: "" without mutual TLS), as the server saw them;
  // never taken from the request.
  std::string source;
  std::string identity;
};

// What the scheduler answers.
struct RegistrationResult {
  int worker_id = 0;
  int start_epoch = 0;  // the first epoch with a plan for this worker (later when joining late)
  int expected_workers = 0;
  int epochs = 0;
  int global_batch = 0;
  std::string policy;
  // The worker's credential for every later call (see Scheduler::Authenticate).
  std::string token;
  // How a step's gradient and parameters travel (WireDtype: 0 fp32, 1 bf16, 2 fp16).
  int wire_dtype = 0;
  // The job had finished: no worker was added (worker_id -1, no token), nothing is left to do.
  bool job_finished = false;
};

}  // namespace dbs

#endif  // DBS_COMMON_PLAN_H_
