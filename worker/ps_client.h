// PsClient: what a worker needs from the parameter server, as plain C++ (no gRPC types), so the
// training loop can run against the real server or an in-process fake.
#ifndef DBS_WORKER_PS_CLIENT_H_
#define DBS_WORKER_PS_CLIENT_H_

#include <cstdint>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "common/plan.h"
#include "common/tensor.h"

namespace dbs {

struct StepOutcome {
  double global_loss = 0.0;
  int64_t global_samples = 0;
  int64_t version = 0;
  bool revised = false;  // the rest of the epoch was re-planned: follow `revision`
  PlanRevision revision;
};

class PsClient {
 public:
  virtual ~PsClient() = default;

  // Joins the job (retrying while the server is unreachable, if the implementation does).
  virtual absl::StatusOr<RegistrationResult> RegisterWorker(const WorkerRegistration& reg) = 0;

  // Registers the model with its initial values; writes the job's parameters into `params`.
  virtual absl::Status RegisterModel(int worker_id, const ModelLayout& layout,
                                     absl::Span<const float> initial, absl::Span<float> params) = 0;

  // The job's current parameters, written into `params`; returns their version.
  virtual absl::StatusOr<int64_t> PullParameters(int worker_id, absl::Span<float> params) = 0;

  // The worker's plan for `epoch`; returns when the plan exists.
  virtual absl::StatusOr<WorkerPlan> GetEpochPlan(int worker_id, int epoch) = 0;

  // Pushes the mean gradient of `num_samples` samples for (epoch, step) and waits for the step;
  // writes the updated parameters into `params`. `gradient` may be empty when num_samples is 0.
  virtual absl::StatusOr<StepOutcome> PushGradient(int worker_id, int epoch, int step,
                                                   int num_samples, double loss_sum,
                                                   double compute_seconds,
                                                   absl::Span<const float> gradient,
                                                   absl::Span<float> params) = 0;

  virtual absl::Status ReportEpoch(const EpochTiming& timing) = 0;
  virtual absl::Status Leave(int worker_id) = 0;

  // Where the job stands for this worker; writes the parameters to continue from into `params`.
  virtual absl::StatusOr<ResumePoint> Resume(int worker_id, absl::Span<float> params) = 0;
  // True (once) when a call had to wait for the server to come back since the last check: the
  // server may have restarted from a checkpoint older than this worker's position.
  virtual bool TakeReconnected() = 0;
  // Ends the call in progress, if any, and every later one except Leave, with CANCELLED (the
  // process is stopping). Thread-safe: may be called from a signal-handling thread.
  virtual void Interrupt() {}
};

}  // namespace dbs

#endif  // DBS_WORKER_PS_CLIENT_H_
