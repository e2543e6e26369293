#include "server/parameter_service.h"

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/plan_codec.h"
#include "common/rpc/grpc_status.h"
#include "common/rpc/raw_call.h"
#include "common/status_macros.h"
#include "common/step_wire.h"
#include "common/tensor_codec.h"

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
  // and get the stored values, so their (possibly large) values are not decoded. Values sent
  // while another worker holds the turn to send them are refused (RegistrationClaim).
  std::vector<float> initial;
  if (!req->layout_only() && !store_->registered()) {
    int holder = -1;
    if (!claim_.Take(req->worker_id(), &holder)) return Answer(reactor, ClaimedBy(holder));
  }
  if (!store_->registered()) {
    initial.resize(static_cast<size_t>(TotalElements(*layout)));
    absl::Status decoded = DecodeTensors(req->parameters(), *layout, true, absl::MakeSpan(initial));
    if (!decoded.ok()) {
      claim_.Release(req->worker_id());
      return Answer(reactor, decoded);
    }
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
    reply->values = ValuesOf(*snap);
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
  bool shared = false;
  {
    absl::MutexLock lock(&values_mu_);
    ReleaseValuesLocked();
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
    // In fp32 the answers send the new values from the buffer the update writes them into
    // (the store does not reuse it while a slice holds it). Otherwise WriteUpdate encodes them
    // into the field's own buffer.
    updating_ = NewField(version, std::move(after), &updating_values_);
  } else if (pool_->DropFree() > 0 && freed_memory_hook_) {
    freed_memory_hook_();
  }
}

void ParameterServiceImpl::WriteUpdate(size_t offset, absl::Span<const float> values) {
  if (updating_values_ == nullptr) return;  // the field's body is the update's buffer
  EncodeValues(values, wire_dtype_, updating_values_ + offset * BytesPerValue(wire_dtype_));
}

void ParameterServiceImpl::EndUpdate(bool ok, const ParameterSnapshot& snapshot) {
  ValuesField done = std::move(updating_);
  updating_ = ValuesField{};
  updating_values_ = nullptr;
  if (!ok || done.size() == 0) return;  // not serialized for gRPC (BeginUpdate): ValuesOf will
  absl::MutexLock lock(&values_mu_);
  values_ = std::move(done);
  values_of_ = snapshot;
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
    FillParameters(store_->layout(), parameters, reply->mutable_parameters());
  }
  return Answer(reactor, rp.status());
}

}  // namespace dbs
