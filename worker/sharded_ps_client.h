// ShardedPsClient: PsClient over the k server processes of a sharded job (dbs_ps --shard=i/k).
//
// The worker registers, asks for plans, reports and leaves with shard 0 (the leader, which
// hosts the scheduler); the model's values are split into k ranges (common/shard_range.h), and
// every registration, pull and push goes to all shards at once, each with its range. A step's
// outcome (loss, samples, re-plan) is the leader's; each shard's answer fills its range of the
// parameters. Not thread-safe, like GrpcPsClient.
#ifndef DBS_WORKER_SHARDED_PS_CLIENT_H_
#define DBS_WORKER_SHARDED_PS_CLIENT_H_

#include <functional>
#include <memory>
#include <vector>

#include "common/shard_range.h"
#include "worker/grpc_ps_client.h"
#include "worker/ps_client.h"

namespace dbs {

class ShardedPsClient : public PsClient {
 public:
  // `shards[0]` is the leader; at least two.
  explicit ShardedPsClient(std::vector<std::unique_ptr<GrpcPsClient>> shards);

  absl::StatusOr<RegistrationResult> RegisterWorker(const WorkerRegistration& reg) override;
  absl::Status RegisterModel(int worker_id, const ModelLayout& layout,
                             absl::Span<const float> initial, absl::Span<float> params) override;
  absl::StatusOr<int64_t> PullParameters(int worker_id, absl::Span<float> params) override;
  absl::StatusOr<WorkerPlan> GetEpochPlan(int worker_id, int epoch) override;
  absl::StatusOr<StepOutcome> PushGradient(int worker_id, int epoch, int step, int num_samples,
                                           double loss_sum, double compute_seconds,
                                           absl::Span<const float> gradient,
                                           absl::Span<float> params) override;
  absl::Status ReportEpoch(const EpochTiming& timing) override;
  absl::Status Leave(int worker_id) override;
  absl::StatusOr<ResumePoint> Resume(int worker_id, absl::Span<float> params) override;
  bool TakeReconnected() override;
  void Interrupt() override;

 private:
  // Runs `call(i)` for every shard i at once (the leader's on this thread); the first error,
  // naming its shard. Once one shard's call fails, the others' are abandoned.
  absl::Status OnAll(const std::function<absl::Status(size_t)>& call);
  // The versions the shards answered must agree: they apply the same steps.
  absl::Status SameVersions(const std::vector<int64_t>& versions) const;

  std::vector<std::unique_ptr<GrpcPsClient>> shards_;
  std::vector<ValueRange> ranges_;  // by shard, from RegisterModel
};

// The client for `config.address`: one server (host:port), or the shards of a sharded job
// listed in order, comma-separated (shard 0 first).
std::unique_ptr<PsClient> MakePsClient(const GrpcClientConfig& config);

}  // namespace dbs

#endif  // DBS_WORKER_SHARDED_PS_CLIENT_H_
