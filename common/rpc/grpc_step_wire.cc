#include "common/rpc/grpc_step_wire.h"

#include <algorithm>
#include <string>

#include "absl/base/config.h"
#include "absl/strings/str_cat.h"

namespace dbs {

Segments SegmentsOf(const grpc::ByteBuffer& buffer, std::vector<grpc::Slice>* keep) {
  keep->clear();
  Segments segments;
  if (!buffer.Dump(keep).ok()) return segments;
  segments.reserve(keep->size());
  for (const grpc::Slice& s : *keep) {
    if (s.size() > 0) segments.emplace_back(s.begin(), s.size());
  }
  return segments;
}

// Received slices outlive their call and may be let go on any thread, the server's reducer
// among them. Under a memory quota's pressure, letting go of the last reference to received
// memory wakes gRPC's reclaimer, which needs the execution context that gRPC's own threads and
// calls set up; without one dbs_ps crashed (a 10M job at --memory_quota_mb=96: 5 runs of 12).
// So the last references go inside grpc_byte_buffer_destroy, a gRPC call that sets one up.
std::shared_ptr<std::vector<grpc::Slice>> ReceivedSlices() {
  return std::shared_ptr<std::vector<grpc::Slice>>(
      new std::vector<grpc::Slice>(), [](std::vector<grpc::Slice>* slices) {
        if (!slices->empty()) {
          grpc::ByteBuffer last(slices->data(), slices->size());  // a reference more to each
          slices->clear();
        }  // ~ByteBuffer
        delete slices;
      });
}

grpc::Status RawDecode(grpc::ByteBuffer* in, PushRequest* request) {
  auto slices = ReceivedSlices();
  const Segments message = SegmentsOf(*in, slices.get());
  auto gradient = std::make_shared<WirePayload>();
  absl::Status parsed = ParsePushRequest(message, &request->header, gradient.get());
  if (!parsed.ok()) {
    return grpc::Status(
        grpc::StatusCode::INVALID_ARGUMENT,
        absl::StrCat("malformed request (dbs.v1.PushGradientRequest): ", parsed.message()));
  }
  gradient->keepalive = std::move(slices);  // the segments point into these
  request->gradient = std::move(gradient);
  return grpc::Status::OK;
}

bool EncodeShared(const google::protobuf::MessageLite& head, const ValuesField& values,
                  grpc::ByteBuffer* out) {
  std::string bytes;
  if (!head.SerializeToString(&bytes)) return false;
  std::vector<grpc::Slice> slices = {grpc::Slice(bytes)};
  for (const grpc::Slice* s : {&values.head, &values.body}) {
    if (s->size() > 0) slices.push_back(*s);
  }
  *out = grpc::ByteBuffer(slices.data(), slices.size());
  return true;
}

grpc::Slice SliceOfMemory(const void* data, size_t bytes, std::shared_ptr<const void> keep) {
  auto* held = new std::shared_ptr<const void>(std::move(keep));
  return grpc::Slice(
      const_cast<void*>(data), bytes,
      [](void* p) { delete static_cast<std::shared_ptr<const void>*>(p); }, held);
}

ValuesField FieldOf(const EncodedValues& values) {
  if (values.bytes == nullptr) return ValuesField{};
  uint8_t head[64];
  const size_t n = WriteValuesFieldHead(values.version, values.dtype, values.count, head);
  return ValuesField{
      grpc::Slice(head, n),
      SliceOfMemory(values.bytes, values.count * BytesPerValue(values.dtype), values.keep)};
}

LentValues::LentValues(absl::Span<const float> values) : values_(values) {}

grpc::Slice LentValues::Range(size_t from, size_t count) {
  {
    absl::MutexLock lock(&state_->mu);
    ++state_->out;
  }
  auto* held = new std::shared_ptr<State>(state_);
  return grpc::Slice(
      const_cast<float*>(values_.data() + from), count * sizeof(float),
      [](void* p) {
        auto* state = static_cast<std::shared_ptr<State>*>(p);
        {
          absl::MutexLock lock(&(*state)->mu);
          --(*state)->out;
        }
        delete state;
      },
      held);
}

bool LentValues::AwaitReturned(absl::Duration timeout) const {
  State* s = state_.get();
  absl::MutexLock lock(&s->mu);
  return s->mu.AwaitWithTimeout(absl::Condition(&LentValues::NoneOut, s), timeout);
}

GradientOnWire::GradientOnWire(absl::Span<const float> gradient, WireDtype dtype, BytePool* pool)
    : width_(BytesPerValue(dtype)) {
  if (dtype == WireDtype::kFp32 && Fp32IsWireOrder()) {
    lent_.emplace(gradient);
    return;
  }
  const size_t size = GradientFieldSize(gradient.size(), dtype);
  std::shared_ptr<uint8_t> buffer = pool->Acquire(size);
  uint8_t* data = buffer.get();
  WriteGradientField(dtype, gradient, data);
  encoded_ = SliceOfMemory(data, size, std::move(buffer));
  start_ = encoded_.size() - gradient.size() * width_;
}

grpc::Slice GradientOnWire::Range(size_t from, size_t count) {
  if (lent_.has_value()) return lent_->Range(from, count);
  return encoded_.sub(start_ + from * width_, start_ + (from + count) * width_);
}

bool GradientOnWire::AwaitReturned(absl::Duration timeout) const {
  return !lent_.has_value() || lent_->AwaitReturned(timeout);
}

}  // namespace dbs
