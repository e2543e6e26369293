#include "server/parameter_service.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/plan_codec.h"
#include "common/rpc/grpc_status.h"
#include "common/rpc/raw_call.h"
#include "common/status_macros.h"
#include "common/step_wire.h"
#include "common/tensor_codec.h"
#include "common/tsan.h"

namespace dbs {
namespace {

void FillParameters(const ModelLayout& layout, const ParameterSnapshot& snap, v1::Parameters* out) {
  out->set_version(snap.version);
  EncodeTensors(layout, *snap.values, out->mutable_parameters());
}

}  // namespace

grpc::ServerUnaryReactor* ParameterServiceImpl::RegisterModel(grpc::CallbackServerContext* ctx,
                                                              const grpc::ByteBuffer* in,
                                                              grpc::ByteBuffer* out) {
  return ServeRaw<v1::RegisterModelRequest, ParametersAnswer>(
      ctx, in, out, "RegisterModel", hooks_,
      [this](auto* c, const auto& req, auto* reply, WaitingReactor* r) {
        DoRegisterModel(c, req, reply, r);
      });
}

grpc::ServerUnaryReactor* ParameterServiceImpl::PushGradient(grpc::CallbackServerContext* ctx,
                                                             const grpc::ByteBuffer* in,
                                                             grpc::ByteBuffer* out) {
  return ServeRaw<PushRequest, PushAnswer>(
      ctx, in, out, "PushGradient", hooks_,
      [this](auto* c, const auto& req, auto* reply, WaitingReactor* r) {
        DoPushGradient(c, req, reply, r);
      });
}

grpc::ServerUnaryReactor* ParameterServiceImpl::PullParameters(grpc::CallbackServerContext* ctx,
                                                               const grpc::ByteBuffer* in,
                                                               grpc::ByteBuffer* out) {
  return ServeRaw<v1::PullParametersRequest, ParametersAnswer>(
      ctx, in, out, "PullParameters", hooks_,
      [this](auto* c, const auto& req, auto* reply, WaitingReactor* r) {
        DoPullParameters(c, req, reply, r);
      });
}

grpc::ServerUnaryReactor* ParameterServiceImpl::Resume(grpc::CallbackServerContext* ctx,
                                                       const grpc::ByteBuffer* in,
                                                       grpc::ByteBuffer* out) {
  return ServeRaw<v1::ResumeRequest, v1::ResumeReply>(
      ctx, in, out, "Resume", hooks_,
      [this](auto* c, const auto& req, auto* reply, WaitingReactor* r) {
        DoResume(c, req, reply, r);
      });
}

grpc::ServerUnaryReactor* ParameterServiceImpl::AttachSharedMemory(grpc::CallbackServerContext* ctx,
                                                                   const grpc::ByteBuffer* in,
                                                                   grpc::ByteBuffer* out) {
  return ServeRaw<v1::AttachSharedMemoryRequest, v1::AttachSharedMemoryReply>(
      ctx, in, out, "AttachSharedMemory", hooks_,
      [this](auto* c, const auto& req, auto* reply, WaitingReactor* r) {
        Answer(r, DoAttachSharedMemory(c, req, reply));
      });
}

namespace {
// The names of the memory files, which the opening side checks (SharedRegion::Open).
constexpr char kGradientRegion[] = "dbs-gradient";
constexpr char kParameterRegion[] = "dbs-parameters";
}  // namespace

absl::Status ParameterServiceImpl::DoAttachSharedMemory(grpc::CallbackServerContext* ctx,
                                                        const v1::AttachSharedMemoryRequest& req,
                                                        v1::AttachSharedMemoryReply* reply) {
  DBS_RETURN_IF_ERROR(Allowed(ctx, req.worker_id()));
  if (!shared_memory_) {
    return absl::FailedPreconditionError(
        "this dbs_ps shares no memory (--shared_memory=false, or a shard of a sharded job): push "
        "over gRPC");
  }
  if (!store_->registered()) return absl::FailedPreconditionError("register the model first");
  const size_t count = static_cast<size_t>(TotalElements(store_->layout()));
  const size_t bytes = count * BytesPerValue(wire_dtype_);
  if (req.gradient().bytes() != bytes) {
    return absl::InvalidArgumentError(absl::StrCat("a gradient region of ", req.gradient().bytes(),
                                                   " bytes; the model's ", count, " values in ",
                                                   WireDtypeName(wire_dtype_), " take ", bytes));
  }
  RegionLocation where;
  where.pid = req.gradient().pid();
  where.fd = req.gradient().fd();
  where.bytes = req.gradient().bytes();
  DBS_ASSIGN_OR_RETURN(std::unique_ptr<SharedRegion> region,
                       SharedRegion::Open(where, kGradientRegion));
  absl::MutexLock lock(&shm_mu_);
  // Made at registration as the store's snapshot buffers (CreateSnapshotBuffers), or not at all.
  if (slots_ == nullptr || slots_->count() != count) {
    return absl::FailedPreconditionError(absl::StrCat(
        "this dbs_ps keeps no parameters in shared memory (", no_slots_, "): push over gRPC"));
  }
  gradients_[req.worker_id()] = std::move(region);
  TellSharingLocked();
  const RegionLocation slots = slots_region_->location();
  reply->mutable_parameters()->set_pid(slots.pid);
  reply->mutable_parameters()->set_fd(slots.fd);
  reply->mutable_parameters()->set_bytes(slots.bytes);
  return absl::OkStatus();
}

void ParameterServiceImpl::Registered() {
  if (freed_memory_hook_ && !registered_told_.exchange(true)) freed_memory_hook_();
}

void ParameterServiceImpl::ServeSharedMemory(bool on) {
  shared_memory_ = on;
  store_->SetSnapshotMemory(on ? this : nullptr);
}

std::array<std::shared_ptr<ValueBuffer>, 2> ParameterServiceImpl::CreateSnapshotBuffers(
    size_t count) {
  absl::MutexLock lock(&shm_mu_);
  // A former model size's slots (a restored checkpoint of another model) go once nothing holds
  // them; the workers attached to them attach again.
  gradients_.clear();
  TellSharingLocked();
  slots_.reset();
  slots_region_.reset();
  if (!Fp32IsWireOrder()) {
    // The slots hold the values as they lie in memory, which a worker reads as the wire's.
    no_slots_ = "this machine's floats are not little-endian";
    return {};
  }
  absl::StatusOr<std::unique_ptr<SharedRegion>> region =
      SharedRegion::Create(kParameterRegion, ParameterSlots::RegionBytes(count));
  if (!region.ok()) {  // the snapshots stay on the heap, the answers go over gRPC
    no_slots_ = std::string(region.status().message());
    return {};
  }
  slots_region_ = std::move(*region);
  slots_ = std::make_unique<ParameterSlots>(slots_region_.get(), count);
  slots_->Clear();
  std::array<std::shared_ptr<ValueBuffer>, 2> buffers;
  for (int i = 0; i < 2; ++i) {
    buffers[i] = std::make_shared<ValueBuffer>(slots_->Fp32Slot(i), count, slots_region_);
  }
  return buffers;
}

void ParameterServiceImpl::SnapshotWriting(int index) {
  absl::MutexLock lock(&shm_mu_);
  if (slots_ != nullptr) slots_->MarkEmpty(index);
}

void ParameterServiceImpl::SnapshotPublished(int index, int64_t version) {
  absl::MutexLock lock(&shm_mu_);
  if (slots_ != nullptr && version % 2 == index) slots_->MarkHolds(version);
}

void ParameterServiceImpl::DropSharedMemory(const std::set<int>& workers) {
  absl::MutexLock lock(&shm_mu_);
  for (int id : workers) gradients_.erase(id);
  TellSharingLocked();
}

void ParameterServiceImpl::TellSharingLocked() {
  if (hooks_.observer != nullptr) {
    hooks_.observer->OnSharedMemoryWorkers(static_cast<int>(gradients_.size()));
  }
}

int ParameterServiceImpl::shared_memory_workers() const {
  absl::MutexLock lock(&shm_mu_);
  return static_cast<int>(gradients_.size());
}

absl::StatusOr<std::shared_ptr<const WirePayload>> ParameterServiceImpl::SharedGradient(
    const v1::PushGradientRequest& header, const WirePayload& carried) {
  if (carried.bytes > 0) {
    return absl::InvalidArgumentError(
        "a push with its gradient in shared memory carries no gradient bytes");
  }
  if (header.num_samples() == 0) return std::make_shared<const WirePayload>();
  if (static_cast<WireDtype>(header.wire_dtype()) != wire_dtype_) {
    return absl::InvalidArgumentError(absl::StrCat(
        "the gradient is in ", WireDtypeName(static_cast<WireDtype>(header.wire_dtype())),
        "; this job's wire dtype is ", WireDtypeName(wire_dtype_)));
  }
  std::shared_ptr<const SharedRegion> region;
  {
    absl::MutexLock lock(&shm_mu_);
    auto it = gradients_.find(header.worker_id());
    if (it != gradients_.end()) region = it->second;
  }
  if (region == nullptr) {
    return absl::FailedPreconditionError(
        absl::StrCat("worker ", header.worker_id(),
                     " has no shared memory attached here: attach it, or send the gradient"));
  }
  auto payload = std::make_shared<WirePayload>();
  payload->dtype = wire_dtype_;
  payload->bytes = region->size();
  payload->segments.emplace_back(region->data(), region->size());
  payload->keepalive = std::move(region);
  payload->writable_by_sender = true;
  return payload;
}

bool ParameterServiceImpl::SharesSlotOf(int64_t version, int worker) const {
  absl::MutexLock lock(&shm_mu_);
  return slots_ != nullptr && gradients_.count(worker) > 0 && slots_->Holds(version);
}

ValuesField ParameterServiceImpl::AnswerValues(const ParameterSnapshot& snap, int worker,
                                               bool shared) {
  if (shared && SharesSlotOf(snap.version, worker)) {
    v1::PushGradientReply field;
    v1::FlatParameters* values = field.mutable_values();
    values->set_version(snap.version);
    values->set_wire_dtype(static_cast<v1::WireDtype>(wire_dtype_));
    values->set_in_shared_memory(true);
    return ValuesField{grpc::Slice(field.SerializeAsString()), grpc::Slice()};
  }
  // A version that is not in its slot lies elsewhere (the slot was held when its update began)
  // and goes over gRPC.
  if (shared && hooks_.observer != nullptr) hooks_.observer->OnSharedAnswerOverGrpc();
  grpc_answers_.store(true, std::memory_order_relaxed);
  return ValuesOf(snap);
}

namespace {
// A follower shard answers calls ahead of its leader UNAVAILABLE at once (it never waits on a
// callback thread); the worker comes back in a few ms, which is when the leader's word arrives.
absl::Status PushBackIfUnavailable(grpc::CallbackServerContext* ctx, absl::Status s) {
  if (absl::IsUnavailable(s)) ctx->AddTrailingMetadata(kRetryAfterMsKey, "2");
  return s;
}
}  // namespace

absl::Status ParameterServiceImpl::Allowed(grpc::CallbackServerContext* ctx, int worker_id) const {
  return PushBackIfUnavailable(
      ctx, authenticate_(worker_id, ClientMetadata(ctx, kWorkerTokenKey), ClientIdentity(ctx)));
}

namespace {

// The answer to a worker that may not send the model's initial values now (RegistrationClaim).
absl::Status ClaimedBy(int holder) {
  return absl::AbortedError(
      holder >= 0 ? absl::StrCat("worker ", holder,
                                 " is sending the model's initial values; ask again once the "
                                 "model is registered")
                  : "this worker's turn to send the model's initial values ran out; ask again "
                    "(another worker may send them first)");
}

}  // namespace

void ParameterServiceImpl::DoRegisterModel(grpc::CallbackServerContext* ctx,
                                           const v1::RegisterModelRequest& request,
                                           ParametersAnswer* reply, WaitingReactor* reactor) {
  const v1::RegisterModelRequest* req = &request;
  if (absl::Status a = Allowed(ctx, req->worker_id()); !a.ok()) return Answer(reactor, a);
  absl::StatusOr<ModelLayout> layout = LayoutOf(req->parameters(), !req->layout_only());
  if (!layout.ok()) return Answer(reactor, layout.status());
  if (req->layout_only() && !store_->registered()) {
    // One worker sends its values, the others wait for them (RegistrationClaim).
    int holder = -1;
    if (!claim_.Take(req->worker_id(), &holder)) return Answer(reactor, ClaimedBy(holder));
    // The holder registers before it lets the claim go, so a claim taken just after it did
    // finds the model here: the stored values go back below and nobody sends a second copy.
    if (!store_->registered()) {
      return Answer(reactor, absl::FailedPreconditionError(
                                 "no model is registered yet: send the initial values"));
    }
    claim_.Release(req->worker_id());
  }
  // Only the first registration's values are kept; later ones are checked against its layout
  // and get the stored values, so their (possibly large) values are not decoded.
  std::vector<float> initial;
  if (!store_->registered()) {
    initial.resize(static_cast<size_t>(TotalElements(*layout)));
    absl::Status decoded = DecodeTensors(req->parameters(), *layout, true, absl::MakeSpan(initial));
    if (!decoded.ok()) return Answer(reactor, decoded);
  }
  const bool first = !initial.empty();
  absl::StatusOr<ParameterSnapshot> snap = store_->Register(*layout, initial);
  claim_.Release(req->worker_id());
  if (first && snap.ok()) {
    std::vector<float>().swap(initial);
    Registered();
  }
  if (snap.ok()) {
    reply->head.set_version(snap->version);
    if (!req->omit_values()) reply->values = ValuesOf(*snap);
    if (model_accepted_hook_) model_accepted_hook_(req->worker_id());
  }
  return Answer(reactor, snap.status());
}

void ParameterServiceImpl::DoPullParameters(grpc::CallbackServerContext* ctx,
                                            const v1::PullParametersRequest& request,
                                            ParametersAnswer* reply, WaitingReactor* reactor) {
  const v1::PullParametersRequest* req = &request;
  if (absl::Status a = Allowed(ctx, req->worker_id()); !a.ok()) return Answer(reactor, a);
  absl::StatusOr<ParameterSnapshot> snap = store_->Snapshot();
  if (snap.ok()) {
    reply->head.set_version(snap->version);
    reply->values = ValuesOf(*snap);
  }
  return Answer(reactor, snap.status());
}

void ParameterServiceImpl::ReleaseValuesLocked() {
  // Once gRPC has sent the last answer of the version let go here (every worker that pushes the
  // next step has received it), its buffer goes back to the pool (or, where the answers were
  // the snapshot itself, to the store's), and the next version reuses it.
  values_ = ValuesField{};
  values_of_ = ParameterSnapshot{};
}

bool ParameterServiceImpl::ValuesAreTheSnapshot() const {
  return wire_dtype_ == WireDtype::kFp32 && Fp32IsWireOrder();
}

ValuesField ParameterServiceImpl::NewField(int64_t version,
                                           std::shared_ptr<const ValueBuffer> values,
                                           uint8_t** encode_to) {
  const size_t count = values->size();
  uint8_t head[64];
  const size_t n = WriteValuesFieldHead(version, wire_dtype_, count, head);
  if (ValuesAreTheSnapshot()) {
    *encode_to = nullptr;
    return ValuesField{grpc::Slice(head, n), SliceOfValues(std::move(values))};
  }
  // A buffer of its own for the body, not a sub-slice of a buffer with the head: gRPC copies a
  // sub-slice of a few bytes at once, before the values are encoded into the buffer.
  return ValuesField{grpc::Slice(head, n),
                     pool_->Acquire(count * BytesPerValue(wire_dtype_), encode_to)};
}

ValuesField ParameterServiceImpl::ValuesOf(const ParameterSnapshot& snap) {
  absl::MutexLock lock(&values_mu_);
  if (values_of_.values != snap.values || values_of_.version != snap.version) {
    ReleaseValuesLocked();
    uint8_t* encode_to = nullptr;
    values_ = NewField(snap.version, snap.values, &encode_to);
    if (encode_to != nullptr) EncodeValues(*snap.values, wire_dtype_, encode_to);
    values_of_ = snap;  // holds the snapshot: its buffer is not reused while cached
  }
  return values_;
}

void ParameterServiceImpl::BeginUpdate(int64_t version, std::shared_ptr<const ValueBuffer> after) {
  const size_t count = after->size();
  bool shared = false;
  {
    absl::MutexLock lock(&values_mu_);
    ReleaseValuesLocked();
    progress_ = Progress{};
    absl::MutexLock shm(&shm_mu_);
    shared = slots_ != nullptr && !gradients_.empty();
  }
  // Where every answer of the last version came from the slots, this one's are not serialized
  // for gRPC as the update runs (in 16 bits that is a pass over the model and a buffer of its
  // own): an answer over gRPC after all serializes them on first use (ValuesOf). The buffers
  // kept for such encodings go too (the registration's, in a job whose workers all share
  // memory), so that a job that sends nothing over gRPC keeps no encoded copy of the model.
  const bool for_grpc = grpc_answers_.exchange(false) || !shared;
  if (for_grpc) {
    // In fp32 the answers send the new values from the buffer the update writes them into:
    // ranges of it are sent only once final, and the store does not reuse it while a slice
    // holds it. Otherwise WriteUpdate encodes them into the field's own buffer.
    updating_ = NewField(version, std::move(after), &updating_values_);
  } else if (pool_->DropFree() > 0 && freed_memory_hook_) {
    freed_memory_hook_();
  }
  absl::MutexLock lock(&values_mu_);
  progress_.version = version;
  progress_.field = updating_;
  progress_.count = count;
}

void ParameterServiceImpl::WriteUpdate(size_t offset, absl::Span<const float> values) {
  if (updating_values_ == nullptr) return;  // the field's body is the update's buffer
  EncodeValues(values, wire_dtype_, updating_values_ + offset * BytesPerValue(wire_dtype_));
}

void ParameterServiceImpl::EndUpdate(bool ok, const ParameterSnapshot& snapshot) {
  ValuesField done = std::move(updating_);
  updating_ = ValuesField{};
  updating_values_ = nullptr;
  absl::MutexLock lock(&values_mu_);
  if (!ok) {
    progress_ = Progress{};  // its streams get the step's error
    return;
  }
  if (done.size() == 0) return;  // not serialized for gRPC (BeginUpdate): ValuesOf will
  values_ = std::move(done);
  values_of_ = snapshot;
  progress_.ready = progress_.count;
}

absl::Status ParameterServiceImpl::CheckPushHeader(grpc::CallbackServerContext* ctx,
                                                   const PushRequest& request, GradientPush* push) {
  const v1::PushGradientRequest* req = &request.header;
  DBS_RETURN_IF_ERROR(Allowed(ctx, req->worker_id()));
  if (req->num_samples() < 0) return absl::InvalidArgumentError("num_samples is negative");
  // A loss steers nothing, but a step's and an epoch's sums of them must stay finite.
  if (!std::isfinite(req->loss_sum()) ||
      std::abs(req->loss_sum()) > kMaxLossPerSample * std::max<int64_t>(1, req->num_samples())) {
    return absl::InvalidArgumentError(
        absl::StrCat("loss_sum ", req->loss_sum(), " over ", req->num_samples(),
                     " samples is not finite or beyond ", kMaxLossPerSample, " a sample"));
  }
  if (request.gradient->bytes > 0 && static_cast<WireDtype>(req->wire_dtype()) != wire_dtype_) {
    return absl::InvalidArgumentError(absl::StrCat(
        "the gradient travels in ", WireDtypeName(static_cast<WireDtype>(req->wire_dtype())),
        "; this job's wire dtype is ", WireDtypeName(wire_dtype_)));
  }
  push->worker_id = req->worker_id();
  push->epoch = req->epoch();
  push->step = req->step();
  push->num_samples = req->num_samples();
  push->loss_sum = req->loss_sum();
  push->compute_seconds = std::isfinite(req->compute_seconds()) ? req->compute_seconds() : 0.0;
  if (gate_) {
    DBS_RETURN_IF_ERROR(
        PushBackIfUnavailable(ctx, gate_(push->worker_id, push->epoch, push->step)));
  }
  // Who, which step and how many samples are checked before the values are read: a push the
  // barrier would refuse costs no pass over its (possibly 512 MiB) payload.
  DBS_RETURN_IF_ERROR(aggregator_->Precheck(*push));
  if (req->num_samples() > 0 && !store_->registered()) {
    return absl::FailedPreconditionError("no model registered yet");
  }
  return absl::OkStatus();
}

absl::StatusOr<GradientPush> ParameterServiceImpl::AcceptPush(grpc::CallbackServerContext* ctx,
                                                              const PushRequest& request) {
  GradientPush push;
  DBS_RETURN_IF_ERROR(CheckPushHeader(ctx, request, &push));
  std::shared_ptr<const WirePayload> gradient = request.gradient;
  if (request.header.gradient_in_shared_memory()) {
    DBS_ASSIGN_OR_RETURN(gradient, SharedGradient(request.header, *request.gradient));
  }
  if (gradient->bytes > 0 || push.num_samples > 0) push.gradient = std::move(gradient);
  return push;
}

void ParameterServiceImpl::FillAnswerHead(const StepResult& r, int worker,
                                          v1::PushGradientReply* head) {
  if (r.revisions != nullptr) {
    auto rev = r.revisions->find(worker);
    if (rev != r.revisions->end()) ToProto(rev->second, head->mutable_revision());
  }
  head->set_epoch(r.epoch);
  head->set_step(r.step);
  head->set_global_loss(r.global_loss);
  head->set_global_samples(r.global_samples);
}

void ParameterServiceImpl::DoPushGradient(grpc::CallbackServerContext* ctx,
                                          const PushRequest& request, PushAnswer* reply,
                                          WaitingReactor* reactor) {
  absl::StatusOr<GradientPush> push = AcceptPush(ctx, request);
  if (!push.ok()) return Answer(reactor, push.status());
  const int worker = push->worker_id;
  const bool shared = request.header.answer_in_shared_memory();
  const uint64_t ticket = aggregator_->Push(
      *push, [this, reactor, reply, worker, shared](const absl::StatusOr<StepResult>& r) {
        if (r.ok()) {
          FillAnswerHead(*r, worker, &reply->head);
          reply->values = AnswerValues(r->parameters, worker, shared);
        }
        Answer(reactor, r.status());
      });
  if (ticket != 0) {
    reactor->SetWithdraw([agg = aggregator_, ticket] { return agg->CancelWait(ticket); });
  }
}

// What the push reactors (PushStreamReactor, PushSessionReactor) share: the service and the
// call, their reference count (gRPC's, until OnDone, and one per callback from elsewhere still to
// run; the last frees the reactor) and a push's wait for its step's result.
class PushReactor
    : public tsan::Reactor<grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>> {
 public:
  void Ref() { refs_.fetch_add(1); }
  void Unref() {
    if (refs_.fetch_sub(1) == 1) delete this;
  }

 protected:
  PushReactor(ParameterServiceImpl* service, grpc::CallbackServerContext* ctx)
      : service_(service), ctx_(ctx) {}
  ~PushReactor() override = default;
  // The step's result for `worker`'s push, or its refusal (ends the stream).
  virtual void Answer(const StepResult& r, int worker) = 0;
  virtual void Refuse(const grpc::Status& status) = 0;
  // Reads the next message, unless the stream has ended.
  virtual void Read() = 0;

  // From the derived constructor: reads the first message, or refuses the stream while the
  // server is starting, or with `refusal`.
  void Open(const grpc::Status& refusal = grpc::Status::OK) {
    if (grpc::Status serving = ServingStatus(service_->hooks_); !serving.ok()) {
      return Refuse(serving);
    }
    if (!refusal.ok()) return Refuse(refusal);
    Read();
  }

  // Counts `push` in its step; the result comes to Answer or Refuse, with a reference held
  // until then.
  void AwaitStep(StepAggregator* aggregator, const GradientPush& push) {
    Ref();
    const int worker = push.worker_id;
    const uint64_t ticket =
        aggregator->Push(push, [this, worker](const absl::StatusOr<StepResult>& r) {
          ticket_.store(0);
          if (!r.ok()) {
            Refuse(ToGrpcStatus(r.status()));
          } else {
            Answer(*r, worker);
          }
          Unref();
        });
    if (ticket != 0) {
      ticket_.store(ticket);
      // The client may have gone while the push was being counted (Withdraw found no ticket).
      if (cancelled_.load() && ticket_.exchange(0) != 0 && aggregator->CancelWait(ticket)) {
        Unref();
      }
    }
  }

  // The client went away: a waiting push is withdrawn (its callback will not run). True if
  // there was one.
  bool Withdraw(StepAggregator* aggregator) {
    cancelled_.store(true);
    const uint64_t ticket = ticket_.exchange(0);
    if (ticket == 0 || !aggregator->CancelWait(ticket)) return false;
    Unref();
    return true;
  }

  ParameterServiceImpl* const service_;
  grpc::CallbackServerContext* const ctx_;

 private:
  std::atomic<uint64_t> ticket_{0};
  std::atomic<bool> cancelled_{false};
  std::atomic<int> refs_{1};
};

// A streamed push (PushGradientStream). The reactor reads one piece, hands it to the aggregator
// and reads the next only once the piece is summed (or, in worker order, queued behind lower
// ids): the server holds at most one piece per stream, and a worker whose turn has not come
// waits in its transport's flow control.
//
// The answer goes back as pieces of the new parameters, each a view of the bytes serialized once
// for every worker, and ends with a message carrying the step's result (known only once the
// step completes). With a pipelined update the pieces go out as soon as their values are final,
// while this and the other workers still push the rest (the reactor watches the service's
// progress: OnValuesReady); otherwise, and for a retry of a completed step, once the step's
// result is in. When the client closes its side, the push is complete.
//
// Callbacks from the aggregator (a piece taken, the step's result) and from the service (values
// ready) come from other threads. Each holds a reference to the reactor until it has run (the
// object is freed when gRPC is done with it and the last such callback has run), and every
// operation starts under `mu_` and only before Finish. gRPC never runs a bidi reaction inline
// from StartRead, StartWrite or Finish, so holding `mu_` across them cannot deadlock with a
// reaction. Lock order: `mu_`, then the service's `values_mu_`.
class PushStreamReactor final : public PushReactor {
 public:
  PushStreamReactor(ParameterServiceImpl* service, grpc::CallbackServerContext* ctx)
      : PushReactor(service, ctx) {
    Open();
  }

  void OnReadDone(bool ok) override {
    const auto reacting = Reacting();
    if (Finished()) return;
    if (!ok) return EndOfPieces();
    received_ += in_.Length();
    PushRequest piece;
    grpc::ByteBuffer bytes(in_);  // shares the slices
    if (grpc::Status parsed = RawDecode(&bytes, &piece); !parsed.ok()) return FinishOnce(parsed);
    in_.Clear();
    absl::Status s = Take(piece);
    if (!s.ok()) FinishOnce(ToGrpcStatus(s));
  }

  void OnWriteDone(bool ok) override {
    const auto reacting = Reacting();
    if (!ok) return FinishOnce(grpc::Status(grpc::StatusCode::CANCELLED, "the client went away"));
    absl::MutexLock lock(&mu_);
    writing_ = false;
    PumpLocked();
  }

  void OnCancel() override {
    const auto reacting = Reacting();
    // A waiting answer is withdrawn; a piece queued in the aggregator still ends (summed, or
    // dropped with the step) and releases its hold then.
    Withdraw(service_->aggregator_);
    FinishOnce(grpc::Status(grpc::StatusCode::CANCELLED, "the client went away"));
  }

  void OnDone() override {
    { const auto reacting = Reacting(); }
    Unref();
  }

  // Sends what has become final of the answer (the service's OnValuesReady).
  void Pump() {
    absl::MutexLock lock(&mu_);
    PumpLocked();
  }

 private:
  // Checks a piece against the stream's first and gives its values to the aggregator.
  absl::Status Take(const PushRequest& piece) {
    const v1::PushGradientRequest& h = piece.header;
    if (pieces_ == 0) {
      DBS_RETURN_IF_ERROR(service_->CheckPushHeader(ctx_, piece, &push_));
      Watch();
    } else if (h.worker_id() != push_.worker_id || h.epoch() != push_.epoch ||
               h.step() != push_.step || h.num_samples() != push_.num_samples) {
      return absl::InvalidArgumentError(
          "a streamed push's pieces must all name the same worker, epoch, step and samples");
    } else if (piece.gradient->bytes > 0 &&
               static_cast<WireDtype>(h.wire_dtype()) != service_->wire_dtype_) {
      return absl::InvalidArgumentError("a piece travels in another wire dtype than the job's");
    }
    if (++pieces_ > static_cast<int64_t>(kMaxStreamChunks)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "a streamed push may have at most ", kMaxStreamChunks, " pieces: send larger ones"));
    }
    if (piece.gradient->bytes == 0) {
      Read();  // a header alone (a push of no samples)
      return absl::OkStatus();
    }
    if (h.gradient_offset() < 0) return absl::InvalidArgumentError("gradient_offset is negative");
    {
      absl::MutexLock lock(&mu_);
      piece_values_ =
          std::max(piece_values_, piece.gradient->bytes / BytesPerValue(service_->wire_dtype_));
    }
    // Summed (and the update advanced) on the service's reducer thread; the next piece is read
    // once this one is taken.
    Ref();
    service_->reducer_->Schedule(
        [this, offset = static_cast<size_t>(h.gradient_offset()), values = piece.gradient] {
          Ref();
          absl::Status s = service_->aggregator_->PushChunk(push_, offset, values,
                                                            [this](const absl::Status& taken) {
                                                              if (taken.ok()) {
                                                                Read();
                                                              } else {
                                                                FinishOnce(ToGrpcStatus(taken));
                                                              }
                                                              Unref();
                                                            });
          if (!s.ok()) {  // refused: `taken` never runs
            FinishOnce(ToGrpcStatus(s));
            Unref();
          }
          Unref();
        });
    return absl::OkStatus();
  }

  // The client closed its side: the push is complete. Counted on the reducer thread, after the
  // stream's pieces (the step may complete here, and its update end).
  void EndOfPieces() {
    if (pieces_ == 0) {
      return FinishOnce(grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                                     "a streamed push ended before its first piece"));
    }
    Ref();
    service_->reducer_->Schedule([this] {
      CountPush();
      Unref();
    });
  }

  void CountPush() {
    GradientPush push = push_;
    push.streamed = push.num_samples > 0;
    AwaitStep(service_->aggregator_, push);
  }

  void Refuse(const grpc::Status& status) override { FinishOnce(status); }

  // The step's result: every value is final, and the message that ends the answer is known.
  void Answer(const StepResult& r, int worker) override {
    v1::PushGradientReply head;
    ParameterServiceImpl::FillAnswerHead(r, worker, &head);
    const ValuesField field = service_->ValuesOf(r.parameters);  // usually the watched buffer
    const size_t count = r.parameters.values->size();
    absl::MutexLock lock(&mu_);
    if (finished_) return;
    if (answer_.field.size() == 0 || answer_.version != r.parameters.version) {
      if (next_ > 0) {  // cannot happen: the watched update is the step's
        return FinishLocked(grpc::Status(grpc::StatusCode::INTERNAL,
                                         "the step's parameters changed while they were sent"));
      }
      answer_.version = r.parameters.version;
      answer_.field = field;
      answer_.count = count;
    }
    answer_.ready = answer_.count;
    result_ = head.SerializeAsString();
    result_known_ = true;
    if (writing_) return;  // OnWriteDone goes on
    Ref();
    service_->sender_->Schedule([this] {
      Pump();
      Unref();
    });
  }

  // Writes the next message of the answer that is final, if no write is in flight: a range of
  // values as large as the client's pieces, and at last the step's result; then finishes.
  void PumpLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (finished_ || writing_) return;
    if (!result_known_) {
      ParameterServiceImpl::Progress p;
      if (service_->ProgressOf(push_.epoch, push_.step, &p)) {
        if (answer_.field.size() == 0) {
          answer_ = std::move(p);
        } else if (p.version == answer_.version) {
          answer_.ready = std::max(answer_.ready, p.ready);
        }
      }
    }
    if (answer_.field.size() == 0) return;
    const WireDtype dtype = service_->wire_dtype_;
    const size_t width = BytesPerValue(dtype);
    const size_t model = answer_.count;
    if (next_ < model) {
      const size_t per = std::max(piece_values_ > 0 ? piece_values_ : model,
                                  (model + kMaxStreamChunks - 1) / kMaxStreamChunks);
      const size_t end = std::min(model, next_ + per);
      if (end > answer_.ready) return;  // not final yet
      grpc::Slice slices[2] = {
          grpc::Slice(ValuesPiecePrefix(answer_.version, dtype, next_, end - next_)),
          answer_.field.body.sub(next_ * width, end * width)};
      out_ = grpc::ByteBuffer(slices, 2);
      next_ = end;
      return WriteLocked();
    }
    if (!result_known_) return;
    if (!result_sent_) {
      // The step's result, with an empty range at the model's end.
      grpc::Slice last(result_ + ValuesPiecePrefix(answer_.version, dtype, model, 0));
      out_ = grpc::ByteBuffer(&last, 1);
      result_sent_ = true;
      return WriteLocked();
    }
    FinishLocked(grpc::Status::OK);
  }

  void WriteLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    sent_ += out_.Length();
    writing_ = true;
    StartWrite(&out_);
  }

  void Watch() {
    absl::MutexLock lock(&mu_);
    if (finished_ || watching_) return;
    watching_ = true;
    service_->Watch(this);
  }

  bool Finished() {
    absl::MutexLock lock(&mu_);
    return finished_;
  }

  void Read() override {
    absl::MutexLock lock(&mu_);
    if (!finished_) StartRead(&in_);
  }

  void FinishOnce(const grpc::Status& status) {
    absl::MutexLock lock(&mu_);
    FinishLocked(status);
  }

  void FinishLocked(const grpc::Status& status) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (finished_) return;
    finished_ = true;
    if (watching_) {
      watching_ = false;
      service_->Unwatch(this);  // not the last reference: gRPC's lasts until OnDone
    }
    if (service_->hooks_.observer != nullptr) {
      service_->hooks_.observer->OnCall("PushGradientStream", received_, status.ok() ? sent_ : 0,
                                        static_cast<int>(status.error_code()));
    }
    Finish(status);
  }

  grpc::ByteBuffer in_;
  GradientPush push_;  // the header, from the first piece
  int64_t pieces_ = 0;
  size_t received_ = 0;
  absl::Mutex mu_;
  bool finished_ ABSL_GUARDED_BY(mu_) = false;
  // The answer: the new parameters' serialized field (with how many values are final), the
  // next value to send, the step's result once known, the message being written.
  size_t piece_values_ ABSL_GUARDED_BY(mu_) = 0;  // the largest piece's: the answer's are as large
  bool watching_ ABSL_GUARDED_BY(mu_) = false;
  ParameterServiceImpl::Progress answer_ ABSL_GUARDED_BY(mu_);
  size_t next_ ABSL_GUARDED_BY(mu_) = 0;
  std::string result_ ABSL_GUARDED_BY(mu_);
  bool result_known_ ABSL_GUARDED_BY(mu_) = false;
  bool result_sent_ ABSL_GUARDED_BY(mu_) = false;
  bool writing_ ABSL_GUARDED_BY(mu_) = false;
  grpc::ByteBuffer out_ ABSL_GUARDED_BY(mu_);
  size_t sent_ ABSL_GUARDED_BY(mu_) = 0;
};

grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>*
ParameterServiceImpl::PushGradientStream(grpc::CallbackServerContext* ctx) {
  return new PushStreamReactor(this, ctx);
}

// A worker's whole-message pushes of many steps on one stream (PushGradientSession). Each push
// goes through what PushGradient does (AcceptPush: the header's checks, the gradient held
// where it arrived; then the aggregator's barrier) and is answered with PushGradient's reply, the
// shared serialized parameters included; the next push is read only once that answer is
// written, so the server holds at most one push per stream. The first refusal ends the stream
// with PushGradient's status for it.
//
// The aggregator's callback (the step's result) comes from another thread, or from inside
// Push when this push completes the step; it holds a reference until it has run, as does
// gRPC until OnDone. Operations start under `mu_` and only before Finish.
class PushSessionReactor final : public PushReactor {
 public:
  PushSessionReactor(ParameterServiceImpl* service, grpc::CallbackServerContext* ctx)
      : PushReactor(service, ctx) {
    Open(service->push_sessions_
             ? grpc::Status::OK
             : grpc::Status(grpc::StatusCode::UNIMPLEMENTED,
                            "this dbs_ps serves no push sessions (--push_sessions=false): push "
                            "with PushGradient"));
  }

  void OnReadDone(bool ok) override {
    const auto reacting = Reacting();
    if (!ok) return FinishOnce(grpc::Status::OK);  // the client closed its side
    received_ = in_.Length();
    PushRequest request;
    grpc::ByteBuffer bytes(in_);  // shares the slices
    in_.Clear();
    if (grpc::Status parsed = RawDecode(&bytes, &request); !parsed.ok()) {
      return FinishOnce(parsed);
    }
    const int worker = request.header.worker_id();
    if (worker_ < 0) worker_ = worker;
    if (worker != worker_) {
      return FinishOnce(grpc::Status(
          grpc::StatusCode::INVALID_ARGUMENT,
          absl::StrCat("a push session carries one worker's pushes: this one began with worker ",
                       worker_, "'s, not ", worker, "'s")));
    }
    absl::StatusOr<GradientPush> push = service_->AcceptPush(ctx_, request);
    if (!push.ok()) return FinishOnce(ToGrpcStatus(push.status()));
    shared_answer_ = request.header.answer_in_shared_memory();
    AwaitStep(service_->aggregator_, *push);
  }

  void OnWriteDone(bool ok) override {
    const auto reacting = Reacting();
    if (!ok) return FinishOnce(grpc::Status(grpc::StatusCode::CANCELLED, "the client went away"));
    Read();
  }

  void OnCancel() override {
    const auto reacting = Reacting();
    // A waiting answer is withdrawn (its callback will not run: drop its reference).
    // A client ends its session between pushes this way too: only a withdrawn push is told
    // to the observer.
    const bool withdrawn = Withdraw(service_->aggregator_);
    FinishOnce(grpc::Status(grpc::StatusCode::CANCELLED, "the client went away"), withdrawn);
  }

  void OnDone() override {
    { const auto reacting = Reacting(); }
    Unref();
  }

 private:
  void Refuse(const grpc::Status& status) override { FinishOnce(status); }

  void Answer(const StepResult& r, int worker) override {
    PushAnswer answer;
    ParameterServiceImpl::FillAnswerHead(r, worker, &answer.head);
    answer.values = service_->AnswerValues(r.parameters, worker, shared_answer_);
    absl::MutexLock lock(&mu_);
    if (finished_) return;
    if (!RawEncode(answer, &out_)) {
      return FinishLocked(grpc::Status(grpc::StatusCode::INTERNAL, "cannot serialize the reply"));
    }
    if (service_->hooks_.observer != nullptr) {
      service_->hooks_.observer->OnCall("PushGradientSession", received_, out_.Length(), 0);
    }
    StartWrite(&out_);
  }

  void Read() override {
    absl::MutexLock lock(&mu_);
    if (!finished_) StartRead(&in_);
  }

  // Ends the stream; a refusal (`observed`) is told to the observer as a refused call.
  void FinishOnce(const grpc::Status& status, bool observed = true) {
    absl::MutexLock lock(&mu_);
    FinishLocked(status, observed);
  }

  void FinishLocked(const grpc::Status& status, bool observed = true)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (finished_) return;
    finished_ = true;
    if (observed && !status.ok() && service_->hooks_.observer != nullptr) {
      service_->hooks_.observer->OnCall("PushGradientSession", received_, 0,
                                        static_cast<int>(status.error_code()));
    }
    Finish(status);
  }

  grpc::ByteBuffer in_;  // the push being read (only between StartRead and OnReadDone)
  int worker_ = -1;      // the stream's, from its first push (OnReadDone only)
  // The push being answered asked for its answer in shared memory (set before AwaitStep).
  std::atomic<bool> shared_answer_{false};
  std::atomic<size_t> received_{0};  // the last push's bytes
  absl::Mutex mu_;
  bool finished_ ABSL_GUARDED_BY(mu_) = false;
  grpc::ByteBuffer out_ ABSL_GUARDED_BY(mu_);  // the answer being written
};

grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>*
ParameterServiceImpl::PushGradientSession(grpc::CallbackServerContext* ctx) {
  return new PushSessionReactor(this, ctx);
}

void ParameterServiceImpl::OnValuesReady(int epoch, int step, int64_t version, size_t ready) {
  std::vector<PushStreamReactor*> told;
  {
    absl::MutexLock lock(&values_mu_);
    if (progress_.version != version || progress_.field.size() == 0) return;  // a late call
    progress_.epoch = epoch;
    progress_.step = step;
    progress_.ready = std::max(progress_.ready, std::min(ready, progress_.count));
    told.assign(watchers_.begin(), watchers_.end());
    for (PushStreamReactor* r : told) r->Ref();  // they stay while they are told
  }
  // Started from the sender thread: gRPC may write to the socket on the thread that starts a
  // write, and the reducer has the next pieces to sum.
  sender_->Schedule([told = std::move(told)] {
    for (PushStreamReactor* r : told) {
      r->Pump();
      r->Unref();
    }
  });
}

bool ParameterServiceImpl::ProgressOf(int epoch, int step, Progress* out) {
  absl::MutexLock lock(&values_mu_);
  if (progress_.epoch != epoch || progress_.step != step || progress_.ready == 0) return false;
  *out = progress_;
  return true;
}

void ParameterServiceImpl::Watch(PushStreamReactor* reactor) {
  grpc_answers_.store(true, std::memory_order_relaxed);
  absl::MutexLock lock(&values_mu_);
  if (watchers_.insert(reactor).second) reactor->Ref();
}

void ParameterServiceImpl::Unwatch(PushStreamReactor* reactor) {
  bool erased = false;
  {
    absl::MutexLock lock(&values_mu_);
    erased = watchers_.erase(reactor) > 0;
  }
  if (erased) reactor->Unref();
}

std::vector<grpc::ByteBuffer> ParameterServiceImpl::ChunkedValues(const ParameterSnapshot& snap,
                                                                  const std::string& first_head,
                                                                  const std::string& other_head,
                                                                  size_t per_chunk, size_t* bytes) {
  const ValuesField values = ValuesOf(snap);
  const size_t width = BytesPerValue(wire_dtype_);
  const size_t model = snap.values->size();
  const size_t step = std::max(per_chunk > 0 ? per_chunk : model,
                               (model + kMaxStreamChunks - 1) / kMaxStreamChunks);
  std::vector<grpc::ByteBuffer> out;
  size_t from = 0;
  do {
    const size_t count = std::min(step, model - from);
    std::string prefix = out.empty() ? first_head : other_head;
    prefix += ValuesPiecePrefix(snap.version, wire_dtype_, from, count);
    grpc::Slice slices[2] = {grpc::Slice(prefix),
                             values.body.sub(from * width, (from + count) * width)};
    out.emplace_back(slices, count > 0 ? 2 : 1);
    *bytes += out.back().Length();
    from += count;
  } while (from < model);
  return out;
}

// PullParametersStream: the current parameters as a stream of ranges, each a view of the bytes
// serialized once for every answer of that version. Nothing outside gRPC calls into it.
class PullStreamReactor final : public tsan::Reactor<grpc::ServerWriteReactor<grpc::ByteBuffer>> {
 public:
  PullStreamReactor(ParameterServiceImpl* service, grpc::CallbackServerContext* ctx,
                    const grpc::ByteBuffer* in)
      : service_(service), received_(in->Length()) {
    if (grpc::Status serving = ServingStatus(service_->hooks_); !serving.ok()) {
      Done(serving);
      return;
    }
    grpc::Status status = Prepare(ctx, in);
    if (!status.ok()) {
      Done(status);
      return;
    }
    StartWrite(&out_[0]);
  }

  void OnWriteDone(bool ok) override {
    const auto reacting = Reacting();
    if (!ok) return Done(grpc::Status(grpc::StatusCode::CANCELLED, "the client went away"));
    if (++written_ < out_.size()) return StartWrite(&out_[written_]);
    Done(grpc::Status::OK);
  }

  void OnDone() override {
    { const auto reacting = Reacting(); }
    delete this;
  }

 private:
  // Checks the request and lays out the answer's messages.
  grpc::Status Prepare(grpc::CallbackServerContext* ctx, const grpc::ByteBuffer* in) {
    v1::PullParametersRequest req;
    grpc::ByteBuffer bytes(*in);
    if (grpc::Status parsed = RawDecode(&bytes, &req); !parsed.ok()) return parsed;
    if (absl::Status a = service_->Allowed(ctx, req.worker_id()); !a.ok()) return ToGrpcStatus(a);
    absl::StatusOr<ParameterSnapshot> snap = service_->store_->Snapshot();
    if (!snap.ok()) return ToGrpcStatus(snap.status());
    v1::Parameters head;
    head.set_version(snap->version);
    out_ = service_->ChunkedValues(*snap, head.SerializeAsString(), head.SerializeAsString(),
                                   kDefaultStreamChunkBytes / BytesPerValue(service_->wire_dtype_),
                                   &sent_);
    return grpc::Status::OK;
  }

  void Done(const grpc::Status& status) {
    if (service_->hooks_.observer != nullptr) {
      service_->hooks_.observer->OnCall("PullParametersStream", received_, status.ok() ? sent_ : 0,
                                        static_cast<int>(status.error_code()));
    }
    Finish(status);
  }

  ParameterServiceImpl* const service_;
  const size_t received_;
  size_t sent_ = 0;
  std::vector<grpc::ByteBuffer> out_;
  size_t written_ = 0;
};

grpc::ServerWriteReactor<grpc::ByteBuffer>* ParameterServiceImpl::PullParametersStream(
    grpc::CallbackServerContext* ctx, const grpc::ByteBuffer* in) {
  return new PullStreamReactor(this, ctx, in);
}

// RegisterModelStream: the layout first, then the initial values in consecutive fp32 ranges,
// appended as they arrive (what the server holds grows with what the client really sent, not
// with the size it claims). The first registration's values win; later ones are read and only
// their layout is checked. The answer carries the version.
class RegisterStreamReactor final
    : public tsan::Reactor<grpc::ServerReadReactor<grpc::ByteBuffer>> {
 public:
  RegisterStreamReactor(ParameterServiceImpl* service, grpc::CallbackServerContext* ctx,
                        grpc::ByteBuffer* out)
      : service_(service), ctx_(ctx), out_(out) {
    if (grpc::Status serving = ServingStatus(service_->hooks_); !serving.ok()) {
      Done(serving);
      return;
    }
    StartRead(&in_);
  }

  void OnReadDone(bool ok) override {
    const auto reacting = Reacting();
    if (!ok) return Done(ToGrpcStatus(Register()));
    received_ += in_.Length();
    v1::RegisterModelRequest req;
    grpc::ByteBuffer bytes(in_);
    if (grpc::Status parsed = RawDecode(&bytes, &req); !parsed.ok()) return Done(parsed);
    in_.Clear();
    absl::Status s = Take(req);
    if (!s.ok()) return Done(ToGrpcStatus(s));
    StartRead(&in_);
  }

  void OnDone() override {
    { const auto reacting = Reacting(); }
    delete this;
  }

 private:
  absl::Status Take(const v1::RegisterModelRequest& req) {
    if (++messages_ > static_cast<int64_t>(kMaxStreamChunks) + 1) {
      return absl::InvalidArgumentError(absl::StrCat("a streamed registration may have at most ",
                                                     kMaxStreamChunks + 1, " messages"));
    }
    if (messages_ == 1) {
      worker_id_ = req.worker_id();
      DBS_RETURN_IF_ERROR(service_->Allowed(ctx_, worker_id_));
      DBS_ASSIGN_OR_RETURN(layout_, LayoutOf(req.parameters(), false));
      total_ = static_cast<size_t>(TotalElements(layout_));
      if (!service_->store_->registered()) {
        // Only one worker's values at a time (RegistrationClaim): the server holds one copy
        // of the model being registered, not one per worker.
        int holder = -1;
        if (!service_->claim_.Take(worker_id_, &holder)) return ClaimedBy(holder);
        claimed_ = !service_->store_->registered();  // registered meanwhile: not needed
        if (!claimed_) service_->claim_.Release(worker_id_);
      }
      return absl::OkStatus();
    }
    if (req.worker_id() != worker_id_) {
      return absl::InvalidArgumentError("a streamed registration's messages must name one worker");
    }
    if (claimed_) service_->claim_.Renew(worker_id_);
    const v1::FlatParameters& chunk = req.initial();
    const std::string& bytes = chunk.values();
    if (chunk.wire_dtype() != v1::WIRE_FP32 || bytes.size() % 4 != 0) {
      return absl::InvalidArgumentError("initial values travel as whole fp32 values");
    }
    if (chunk.offset() != static_cast<int64_t>(initial_.size()) ||
        bytes.size() / 4 > total_ - initial_.size()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "initial values ", chunk.offset(), "..", chunk.offset() + bytes.size() / 4,
          " do not follow the ", initial_.size(), " received, within the model's ", total_));
    }
    // Room for the whole model at once (its layout bounds it), rather than a vector that
    // grows by doubling: each growth would copy what arrived and leave a freed buffer behind,
    // which the server's allocator keeps mapped.
    if (initial_.capacity() < total_) initial_.reserve(total_);
    const size_t at = initial_.size();
    initial_.resize(at + bytes.size() / 4);
    std::memcpy(initial_.data() + at, bytes.data(), bytes.size());
    for (size_t i = at; i < initial_.size(); ++i) {
      if (!std::isfinite(initial_[i])) {
        return absl::InvalidArgumentError(
            absl::StrCat("initial value ", i, " is not finite (", initial_[i], ")"));
      }
    }
    return absl::OkStatus();
  }

  absl::Status Register() {
    if (messages_ == 0) return absl::InvalidArgumentError("a registration with no layout");
    const bool first = !service_->store_->registered();
    if (first && initial_.size() != total_) {
      return absl::InvalidArgumentError(absl::StrCat("the initial values ended after ",
                                                     initial_.size(), " of the model's ", total_));
    }
    DBS_ASSIGN_OR_RETURN(
        ParameterSnapshot snap,
        service_->store_->Register(layout_, first ? initial_ : std::vector<float>{}));
    if (first) {
      std::vector<float>().swap(initial_);
      service_->Registered();
    }
    if (service_->model_accepted_hook_) service_->model_accepted_hook_(worker_id_);
    v1::Parameters reply;
    reply.set_version(snap.version);
    if (!RawEncode(reply, out_)) return absl::InternalError("cannot serialize the reply");
    return absl::OkStatus();
  }

  void Done(const grpc::Status& status) {
    if (claimed_) service_->claim_.Release(worker_id_);
    claimed_ = false;
    if (service_->hooks_.observer != nullptr) {
      service_->hooks_.observer->OnCall("RegisterModelStream", received_,
                                        status.ok() ? out_->Length() : 0,
                                        static_cast<int>(status.error_code()));
    }
    Finish(status);
  }

  ParameterServiceImpl* const service_;
  grpc::CallbackServerContext* const ctx_;
  grpc::ByteBuffer* const out_;
  grpc::ByteBuffer in_;
  int64_t messages_ = 0;
  int worker_id_ = 0;
  ModelLayout layout_;
  size_t total_ = 0;
  std::vector<float> initial_;
  size_t received_ = 0;
  bool claimed_ = false;  // this stream holds the registration claim
};

grpc::ServerReadReactor<grpc::ByteBuffer>* ParameterServiceImpl::RegisterModelStream(
    grpc::CallbackServerContext* ctx, grpc::ByteBuffer* out) {
  return new RegisterStreamReactor(this, ctx, out);
}

void ParameterServiceImpl::DoResume(grpc::CallbackServerContext* ctx,
                                    const v1::ResumeRequest& request, v1::ResumeReply* reply,
                                    WaitingReactor* reactor) {
  const v1::ResumeRequest* req = &request;
  if (!resume_) return Answer(reactor, absl::UnimplementedError("resume is not wired"));
  if (absl::Status a = Allowed(ctx, req->worker_id()); !a.ok()) return Answer(reactor, a);
  ParameterSnapshot parameters;
  absl::StatusOr<ResumePoint> rp = resume_(req->worker_id(), &parameters);
  if (rp.ok()) {
    reply->set_finished(rp->finished);
    reply->set_epoch(rp->epoch);
    reply->set_step(rp->step);
    reply->set_plan_ready(rp->has_plan);
    if (rp->has_plan) {
      ToProto(rp->plan, reply->mutable_plan());
      ToProto(rp->schedule, reply->mutable_schedule());
    }
    if (req->omit_parameters()) {
      reply->mutable_parameters()->set_version(parameters.version);
    } else {
      FillParameters(store_->layout(), parameters, reply->mutable_parameters());
    }
  }
  return Answer(reactor, rp.status());
}

}  // namespace dbs
