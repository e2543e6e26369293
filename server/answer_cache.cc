#include "server/answer_cache.h"

#include <utility>

namespace dbs {

EncodedValues AnswerCache::NewEncoding(int64_t version, std::shared_ptr<const ValueBuffer> values,
                                       uint8_t** encode_to) {
  const size_t count = values->size();
  if (wire_dtype_ == WireDtype::kFp32 && Fp32IsWireOrder()) {
    *encode_to = nullptr;
    const auto* bytes = reinterpret_cast<const uint8_t*>(values->data());
    return EncodedValues{version, wire_dtype_, count, bytes, std::move(values)};
  }
  std::shared_ptr<uint8_t> buffer = pool_->Acquire(count * BytesPerValue(wire_dtype_));
  *encode_to = buffer.get();
  return EncodedValues{version, wire_dtype_, count, buffer.get(), std::move(buffer)};
}

EncodedValues AnswerCache::ValuesOf(const ParameterSnapshot& snap) {
  absl::MutexLock lock(&mu_);
  if (values_of_.values != snap.values || values_of_.version != snap.version) {
    uint8_t* encode_to = nullptr;
    values_ = NewEncoding(snap.version, snap.values, &encode_to);
    if (encode_to != nullptr) EncodeValues(*snap.values, wire_dtype_, encode_to);
    values_of_ = snap;  // holds the snapshot: its buffer is not reused while cached
  }
  return values_;
}

void AnswerCache::BeginUpdate(int64_t version, std::shared_ptr<const ValueBuffer> after) {
  {
    // Once the last answer of the version let go here has been sent (every worker that pushes
    // the next step has received it), its buffer goes back to the pool (or, where the answers
    // were the snapshot itself, to the store's), and the next version reuses it.
    absl::MutexLock lock(&mu_);
    values_ = EncodedValues{};
    values_of_ = ParameterSnapshot{};
  }
  // The buffers kept for encodings go when nothing went over the socket (the registration's, in
  // a job whose workers all share memory), so that such a job keeps no encoded copy of the model.
  if (socket_answers_.exchange(false) || !sharing_()) {
    // In fp32 the answers send the new values from the buffer the update writes them into
    // (the store does not reuse it while an answer holds it). Otherwise WriteUpdate encodes them
    // into a buffer of their own.
    updating_ = NewEncoding(version, std::move(after), &updating_values_);
  } else if (pool_->DropFree() > 0 && freed_memory_hook_) {
    freed_memory_hook_();
  }
}

void AnswerCache::WriteUpdate(size_t offset, absl::Span<const float> values) {
  if (updating_values_ == nullptr) return;  // the encoding is the update's buffer
  EncodeValues(values, wire_dtype_, updating_values_ + offset * BytesPerValue(wire_dtype_));
}

void AnswerCache::EndUpdate(bool ok, const ParameterSnapshot& snapshot) {
  EncodedValues done = std::move(updating_);
  updating_ = EncodedValues{};
  updating_values_ = nullptr;
  if (!ok || done.bytes == nullptr) return;  // not encoded as it ran: ValuesOf will
  absl::MutexLock lock(&mu_);
  values_ = std::move(done);
  values_of_ = snapshot;
}

}  // namespace dbs
