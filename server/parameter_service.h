// ParameterService adapter: decodes dbs.v1 tensors, calls the ParameterStore and StepAggregator,
// maps statuses. Pushes use the callback API: a worker waiting for its step holds no thread.
#ifndef DBS_SERVER_PARAMETER_SERVICE_H_
#define DBS_SERVER_PARAMETER_SERVICE_H_

#include <array>
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
#include "common/shared_memory.h"
#include "proto/dbs.grpc.pb.h"
#include "server/parameter_store.h"
#include "server/registration_claim.h"
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

class ParameterServiceImpl final : public ParameterRawService,
                                   private UpdateSink,
                                   private SnapshotMemory {
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
        pool_(SlicePool::Create()) {
    store_->SetUpdateSink(this);
    ServeSharedMemory(true);
  }
  ~ParameterServiceImpl() override {
    store_->RemoveUpdateSink(this);
    store_->SetSnapshotMemory(nullptr);
  }

  // A sharded job: every push of `worker_id` for (epoch, step) passes `gate` first (at a
  // follower it may wait for the leader, ShardFollower::Gate; the leader refuses a worker that
  // has not resumed since a restore, TrainingJob::AdmitPush). Set before serving.
  using Gate = std::function<absl::Status(int worker_id, int epoch, int step)>;
  void SetGate(Gate gate) { gate_ = std::move(gate); }
  // Whether AttachSharedMemory is served (on by default); off, it answers FAILED_PRECONDITION
  // and every worker pushes over gRPC. On, in fp32, the store's snapshots lie in the parameter
  // slots (SnapshotMemory below), made at registration. Set before serving.
  void ServeSharedMemory(bool on);
  // `hook` (null: none) is called when the service has let go of model-sized memory it will not
  // need again soon, so that the allocator can hand it back: once after the first registration
  // has stored the model's values and let go of its own copy of them, and whenever an update
  // lets go of the buffers kept for encoding answers over gRPC because the last version's
  // answers all went through shared memory. Set before serving.
  void SetFreedMemoryHook(std::function<void()> hook) { freed_memory_hook_ = std::move(hook); }
  // Called with a worker's id when its model registration is accepted (the job's model, or the
  // first). Set before serving.
  void SetModelAcceptedHook(std::function<void(int worker_id)> hook) {
    model_accepted_hook_ = std::move(hook);
  }
  // Workers whose pushes may travel in shared memory now.
  int shared_memory_workers() const;
  // Lets go of `workers`' regions (removed from the job): their memory is freed once no push
  // still waiting to be summed holds it.
  void DropSharedMemory(const std::set<int>& workers);

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

  // The step's parameters serialized for the replies: once per snapshot, shared by all. An
  // update's are serialized as it produces them (the UpdateSink below); others (the first
  // registration's, a restored checkpoint's) on first use. In fp32 on a little-endian machine
  // the field's values are the snapshot's own memory: only its head is written; in 16 bits they
  // are encoded into a pooled buffer of their own.
  ValuesField ValuesOf(const ParameterSnapshot& snapshot);

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
  // Whether `worker` is attached and `version` lies in its slot.
  bool SharesSlotOf(int64_t version, int worker) const;
  // Tells the observer how many workers share memory now.
  void TellSharingLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(shm_mu_);
  absl::Status DoAttachSharedMemory(grpc::CallbackServerContext* ctx,
                                    const v1::AttachSharedMemoryRequest& req,
                                    v1::AttachSharedMemoryReply* reply);
  // A push whose gradient lies in the worker's region: that region as its payload (no copy).
  absl::StatusOr<std::shared_ptr<const WirePayload>> SharedGradient(
      const v1::PushGradientRequest& header, const WirePayload& carried);
  friend class PushSessionReactor;
  // A field for `values` at `version`, its head written. Where the values travel as they lie
  // in memory (ValuesAreTheSnapshot) its body is `values` itself and `*encode_to` is null;
  // otherwise the body is a pooled buffer that the values must be encoded to at `*encode_to`.
  ValuesField NewField(int64_t version, std::shared_ptr<const ValueBuffer> values,
                       uint8_t** encode_to);
  // True where the values travel as the snapshot holds them (fp32, little-endian).
  bool ValuesAreTheSnapshot() const;
  // Lets go of the cached serialized version, before the next one is written.
  void ReleaseValuesLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(values_mu_);
  // UpdateSink: the store's update writes the new values into the next answers' buffer.
  void BeginUpdate(int64_t version, std::shared_ptr<const ValueBuffer> after) override;
  void WriteUpdate(size_t offset, absl::Span<const float> values) override;
  void EndUpdate(bool ok, const ParameterSnapshot& snapshot) override;
  // SnapshotMemory (with shared memory on): the parameter slots are made when the store first
  // holds a model of that size, and the store's two snapshot buffers are the slots, whatever
  // the wire dtype: the workers that share memory read the values where the update wrote them
  // (a worker of a 16-bit job rounds them as the wire would), and the server keeps no second
  // copy; the store stamps a slot as it publishes a version there and marks it empty before it
  // writes it again. Where the slots cannot be made, the snapshots stay on the heap and every
  // answer goes over gRPC.
  std::array<std::shared_ptr<ValueBuffer>, 2> CreateSnapshotBuffers(size_t count) override;
  void SnapshotWriting(int index) override;
  void SnapshotPublished(int index, int64_t version) override;
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
  const std::shared_ptr<SlicePool> pool_;
  Gate gate_;
  bool shared_memory_ = true;
  std::function<void()> freed_memory_hook_;
  std::function<void(int worker_id)> model_accepted_hook_;
  std::atomic<bool> registered_told_{false};
  // Calls freed_memory_hook_, the first time only.
  void Registered();
  // Shared memory: the parameter slots, made at registration as the store's snapshots (null
  // where they could not be: `no_slots_` says why); each attached worker's gradient region (a
  // push's payload holds its region, so a replaced one stays mapped until summed).
  mutable absl::Mutex shm_mu_;
  std::shared_ptr<SharedRegion> slots_region_ ABSL_GUARDED_BY(shm_mu_);
  std::unique_ptr<ParameterSlots> slots_ ABSL_GUARDED_BY(shm_mu_);
  std::string no_slots_ ABSL_GUARDED_BY(shm_mu_) = "no model registered yet";
  std::map<int, std::shared_ptr<const SharedRegion>> gradients_ ABSL_GUARDED_BY(shm_mu_);
  // Some push's answer since the last update began went over gRPC (AnswerValues; not a
  // registration's or a pull's, which every worker makes before it shares memory).
  std::atomic<bool> grpc_answers_{false};
  absl::Mutex values_mu_;
  ParameterSnapshot values_of_ ABSL_GUARDED_BY(values_mu_);  // what `values_` holds
  ValuesField values_ ABSL_GUARDED_BY(values_mu_);
  // The update in progress: its field, and where its values are encoded to (none where the
  // field's body is the update's own buffer). Only the store's update touches them (under the
  // store's lock).
  ValuesField updating_;
  uint8_t* updating_values_ = nullptr;
};

}  // namespace dbs

#endif  // DBS_SERVER_PARAMETER_SERVICE_H_
