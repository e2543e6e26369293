#include "server/answer_cache.h"

#include <utility>

#include "common/step_wire.h"

namespace dbs {

void AnswerCache::ReleaseLocked() {
  // Once gRPC has sent the last answer of the version let go here (every worker that pushes the
  // next step has received it), its buffer goes back to the pool (or, where the answers were
  // the snapshot itself, to the store's), and the next version reuses it.
  values_ = ValuesField{};
  values_of_ = ParameterSnapshot{};
}

ValuesField AnswerCache::NewField(int64_t version, std::shared_ptr<const ValueBuffer> values,
                                  uint8_t** encode_to) {
  const size_t count = values->size();
  uint8_t head[64];
  const size_t n = WriteValuesFieldHead(version, wire_dtype_, count, head);
  if (wire_dtype_ == WireDtype::kFp32 && Fp32IsWireOrder()) {
    *encode_to = nullptr;
    return ValuesField{grpc::Slice(head, n), SliceOfValues(std::move(values))};
  }
  // A buffer of its own for the body, not a sub-slice of a buffer with the head: gRPC copies a
  // sub-slice of a few bytes at once, before the values are encoded into the buffer.
  return ValuesField{grpc::Slice(head, n),
                     pool_->Acquire(count * BytesPerValue(wire_dtype_), encode_to)};
}

ValuesField AnswerCache::ValuesOf(const ParameterSnapshot& snap) {
  absl::MutexLock lock(&mu_);
  if (values_of_.values != snap.values || values_of_.version != snap.version) {
    ReleaseLocked();
    uint8_t* encode_to = nullptr;
    values_ = NewField(snap.version, snap.values, &encode_to);
    if (encode_to != nullptr) EncodeValues(*snap.values, wire_dtype_, encode_to);
    values_of_ = snap;  // holds the snapshot: its buffer is not reused while cached
  }
  return values_;
}

void AnswerCache::BeginUpdate(int64_t version, std::shared_ptr<const ValueBuffer> after) {
  {
    absl::MutexLock lock(&mu_);
    ReleaseLocked();
  }
  // The buffers kept for encodings go when nothing went over gRPC (the registration's, in a job
  // whose workers all share memory), so that such a job keeps no encoded copy of the model.
  if (grpc_answers_.exchange(false) || !sharing_()) {
    // In fp32 the answers send the new values from the buffer the update writes them into
    // (the store does not reuse it while a slice holds it). Otherwise WriteUpdate encodes them
    // into the field's own buffer.
    updating_ = NewField(version, std::move(after), &updating_values_);
  } else if (pool_->DropFree() > 0 && freed_memory_hook_) {
    freed_memory_hook_();
  }
}

void AnswerCache::WriteUpdate(size_t offset, absl::Span<const float> values) {
  if (updating_values_ == nullptr) return;  // the field's body is the update's buffer
  EncodeValues(values, wire_dtype_, updating_values_ + offset * BytesPerValue(wire_dtype_));
}

void AnswerCache::EndUpdate(bool ok, const ParameterSnapshot& snapshot) {
  ValuesField done = std::move(updating_);
  updating_ = ValuesField{};
  updating_values_ = nullptr;
  if (!ok || done.size() == 0) return;  // not serialized as it ran: ValuesOf will
  absl::MutexLock lock(&mu_);
  values_ = std::move(done);
  values_of_ = snapshot;
}

}  // namespace dbs
