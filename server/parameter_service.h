// ParameterService adapter: decodes dbs.v1 tensors, calls the ParameterStore and StepAggregator,
// maps statuses. Pushes use the callback API: a worker waiting for its step holds no thread.
#ifndef DBS_SERVER_PARAMETER_SERVICE_H_
#define DBS_SERVER_PARAMETER_SERVICE_H_

#include <atomic>
#include <functional>
#include <map>
#include <memory>
#include <set>

#include "common/clock.h"
#include "common/plan.h"
#include "common/rpc/grpc_step_wire.h"
#include "common/rpc/raw_call.h"
#include "common/rpc/waiting_reactor.h"
#include "proto/dbs.grpc.pb.h"
#include "server/answer_cache.h"
#include "server/parameter_store.h"
#include "server/registration_claim.h"
#include "server/shared_memory_host.h"
#include "server/step_aggregator.h"

namespace dbs {

using ParameterRawService = v1::ParameterService::WithRawCallbackMethod_RegisterModel<
    v1::ParameterService::WithRawCallbackMethod_PullParameters<
        v1::ParameterService::WithRawCallbackMethod_Resume<
            v1::ParameterService::WithRawCallbackMethod_PushGradientSession<
                v1::ParameterService::WithRawCallbackMethod_AttachSharedMemory<
                    v1::ParameterService::Service>>>>>;

class PushSessionReactor;

// The largest loss a push may report per sample: no sum over a step's or an epoch's samples can
// overflow.
inline constexpr double kMaxLossPerSample = 1e30;

class ParameterServiceImpl final : public ParameterRawService {
 public:
  // OK when `token` is the credential of registered worker `worker_id`, used with the client
  // certificate `identity` (ClientIdentity, "" for none; Scheduler::Authenticate).
  using Authenticate = std::function<absl::Status(int worker_id, absl::string_view token,
                                                  absl::string_view identity)>;
  // Where a worker should continue after a reconnect (TrainingJob::Resume).
  using ResumeFn =
      std::function<absl::StatusOr<ResumePoint>(int worker_id, ParameterSnapshot* parameters)>;

  // `store` and `aggregator` must outlive the service.
  // What `hooks` point to must outlive the service too.
  // Steps' gradients and parameters travel in `wire_dtype` (the job's). `clock` (null: the
  // real one) times the registration claim's lease and must outlive the service.
  ParameterServiceImpl(ParameterStore* store, StepAggregator* aggregator, Authenticate authenticate,
                       ResumeFn resume = nullptr, CallHooks hooks = {},
                       WireDtype wire_dtype = WireDtype::kFp32, const Clock* clock = nullptr)
      : store_(store),
        aggregator_(aggregator),
        authenticate_(std::move(authenticate)),
        resume_(std::move(resume)),
        hooks_(hooks),
        wire_dtype_(wire_dtype),
        claim_(clock != nullptr ? clock : &real_clock_),
        shm_(wire_dtype,
             [observer = hooks.observer](int workers) {
               if (observer != nullptr) observer->OnSharedMemoryWorkers(workers);
             }),
        answers_(wire_dtype, [this] { return shm_.sharing(); }) {
    store_->SetUpdateSink(&answers_);
    ServeSharedMemory(true);
  }
  ~ParameterServiceImpl() override {
    store_->RemoveUpdateSink(&answers_);
    store_->SetSnapshotMemory(nullptr);
  }

  // A sharded job: every push of `worker_id` for (epoch, step) passes `gate` first (at a
  // follower it may wait for the leader, ShardFollower::Gate; the leader refuses a worker that
  // has not resumed since a restore, TrainingJob::AdmitPush). Set before serving.
  using Gate = std::function<absl::Status(int worker_id, int epoch, int step)>;
  void SetGate(Gate gate) { gate_ = std::move(gate); }
  // Whether AttachSharedMemory is served (on by default); off, it answers FAILED_PRECONDITION
  // and every worker pushes over gRPC. On, the store's snapshots lie in the parameter slots
  // (SharedMemoryHost), made at registration. Set before serving.
  void ServeSharedMemory(bool on);
  // `hook` (null: none) is called when the service has let go of model-sized memory it will not
  // need again soon, so that the allocator can hand it back: once after the first registration
  // has stored the model's values and let go of its own copy of them, and whenever an update
  // lets go of the buffers kept for encoding answers over gRPC because the last version's
  // answers all went through shared memory. Set before serving.
  void SetFreedMemoryHook(std::function<void()> hook) {
    answers_.SetFreedMemoryHook(hook);
    freed_memory_hook_ = std::move(hook);
  }
  // Called with a worker's id when its model registration is accepted (the job's model, or the
  // first). Set before serving.
  void SetModelAcceptedHook(std::function<void(int worker_id)> hook) {
    model_accepted_hook_ = std::move(hook);
  }
  // Workers whose pushes may travel in shared memory now.
  int shared_memory_workers() const { return shm_.workers(); }
  // Lets go of `workers`' regions (removed from the job): their memory is freed once no push
  // still waiting to be summed holds it.
  void DropSharedMemory(const std::set<int>& workers) { shm_.Drop(workers); }

  grpc::ServerUnaryReactor* RegisterModel(grpc::CallbackServerContext* ctx,
                                          const grpc::ByteBuffer* in,
                                          grpc::ByteBuffer* out) override;
  grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>* PushGradientSession(
      grpc::CallbackServerContext* ctx) override;
  grpc::ServerUnaryReactor* PullParameters(grpc::CallbackServerContext* ctx,
                                           const grpc::ByteBuffer* in,
                                           grpc::ByteBuffer* out) override;
  grpc::ServerUnaryReactor* Resume(grpc::CallbackServerContext* ctx, const grpc::ByteBuffer* in,
                                   grpc::ByteBuffer* out) override;
  grpc::ServerUnaryReactor* AttachSharedMemory(grpc::CallbackServerContext* ctx,
                                               const grpc::ByteBuffer* in,
                                               grpc::ByteBuffer* out) override;

  // What every answer over gRPC carries for `snapshot` (AnswerCache).
  ValuesField ValuesOf(const ParameterSnapshot& snapshot) {
    return FieldOf(answers_.ValuesOf(snapshot));
  }

 private:
  void DoRegisterModel(grpc::CallbackServerContext* ctx, const v1::RegisterModelRequest& req,
                       ParametersAnswer* reply, WaitingReactor* reactor);
  // The checks of a push's header that need no gradient (who, which step, how many samples);
  // fills `push` from it.
  absl::Status CheckPushHeader(grpc::CallbackServerContext* ctx, const PushRequest& request,
                               GradientPush* push);
  // A push (a push session's message): its header's checks, then the gradient held where it
  // arrived (no copy) until the aggregator has summed it.
  absl::StatusOr<GradientPush> AcceptPush(grpc::CallbackServerContext* ctx,
                                          const PushRequest& request);
  // The values of a push's answer: the version only where the worker asked for them in shared
  // memory (`shared`), is attached and the slots hold them; otherwise ValuesOf.
  ValuesField AnswerValues(const ParameterSnapshot& snap, int worker, bool shared);
  absl::Status DoAttachSharedMemory(grpc::CallbackServerContext* ctx,
                                    const v1::AttachSharedMemoryRequest& req,
                                    v1::AttachSharedMemoryReply* reply);
  friend class PushSessionReactor;
  void DoPullParameters(grpc::CallbackServerContext* ctx, const v1::PullParametersRequest& req,
                        ParametersAnswer* reply, WaitingReactor* reactor);
  void DoResume(grpc::CallbackServerContext* ctx, const v1::ResumeRequest& req,
                v1::ResumeReply* reply, WaitingReactor* reactor);

  ParameterStore* const store_;
  StepAggregator* const aggregator_;
  // The caller's credential check, for `worker_id`.
  absl::Status Allowed(grpc::CallbackServerContext* ctx, int worker_id) const;

  const Authenticate authenticate_;
  const ResumeFn resume_;
  const CallHooks hooks_;
  const WireDtype wire_dtype_;
  const RealClock real_clock_;
  // Which worker sends the model's initial values while none is registered.
  RegistrationClaim claim_;
  Gate gate_;
  bool shared_memory_ = true;
  std::function<void()> freed_memory_hook_;
  std::function<void(int worker_id)> model_accepted_hook_;
  std::atomic<bool> registered_told_{false};
  // Calls freed_memory_hook_, the first time only.
  void Registered();
  // The memory shared with the workers on this host.
  SharedMemoryHost shm_;
  // The parameters serialized for the answers over gRPC.
  AnswerCache answers_;
};

}  // namespace dbs

#endif  // DBS_SERVER_PARAMETER_SERVICE_H_
