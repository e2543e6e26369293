// The per-step messages over gRPC without copies (the adapter half of common/step_wire.h).
//
//  - A received message is read where gRPC delivered it: its slices are referenced, not
//    flattened, and a gradient stays in them until the aggregator has summed it.
//  - Outgoing payloads (a worker's gradient, a step's parameters) are lent to gRPC where they
//    lie, or written once into a BytePool's buffer, which comes back when gRPC lets go of the
//    last slice: the same memory serves every step, and one step's parameters are shared by all
//    N replies.
#ifndef DBS_COMMON_GRPC_STEP_WIRE_H_
#define DBS_COMMON_GRPC_STEP_WIRE_H_

#include <cstdint>
#include <memory>
#include <optional>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "common/byte_pool.h"
#include "common/step_wire.h"
#include "common/wire_values.h"
#include "grpcpp/support/byte_buffer.h"
#include "grpcpp/support/slice.h"
#include "grpcpp/support/status.h"
#include "proto/dbs.pb.h"

namespace dbs {

// The segments of `buffer`; `keep` receives references to its slices (which the segments point
// into). No bytes are copied.
Segments SegmentsOf(const grpc::ByteBuffer& buffer, std::vector<grpc::Slice>* keep);

// A push as the server reads it: the header, and the gradient still in the received slices.
struct PushRequest {
  v1::PushGradientRequest header;
  std::shared_ptr<const WirePayload> gradient;
};
grpc::Status RawDecode(grpc::ByteBuffer* in, PushRequest* request);

// The parameters of one version as the field that carries them (field 7 of both
// PushGradientReply and Parameters, WriteValuesField): its head (tag, length, version, dtype
// and the values' own tag and length) and the values' bytes, which are `values`' own memory
// (no copy), shared by every answer of that version. Both empty: no values.
struct ValuesField {
  grpc::Slice head;
  grpc::Slice body;
  size_t size() const { return head.size() + body.size(); }
};
ValuesField FieldOf(const EncodedValues& values);

// A slice of `bytes` bytes at `data`, which `keep` keeps alive until gRPC lets go of it (and of
// every sub-slice): no copy. While anyone holds the slice, it counts one more user of `keep`.
grpc::Slice SliceOfMemory(const void* data, size_t bytes, std::shared_ptr<const void> keep);

// Lends memory the caller owns (a worker's gradient) to gRPC without a copy: `Range` makes
// slices that point into it, and `AwaitReturned` waits until gRPC has let go of every one, after
// which the memory may change again. The slices may outlive this object (their bookkeeping is
// shared), though not the memory they point into.
class LentValues {
 public:
  explicit LentValues(absl::Span<const float> values);
  // Values [from, from + count) as a slice.
  grpc::Slice Range(size_t from, size_t count);
  // True once no slice is held; false if some still are after `timeout`.
  bool AwaitReturned(absl::Duration timeout) const;

 private:
  struct State {
    absl::Mutex mu;
    int out ABSL_GUARDED_BY(mu) = 0;
  };
  static bool NoneOut(State* s) ABSL_EXCLUSIVE_LOCKS_REQUIRED(s->mu) { return s->out == 0; }
  absl::Span<const float> values_;
  std::shared_ptr<State> state_ = std::make_shared<State>();
};

// A gradient's values as a push sends them, a range at a time: in fp32 on a little-endian
// machine, where a float's bytes in memory are its bytes on the wire, the gradient's own memory
// lent to gRPC (LentValues, no copy); otherwise encoded once into a buffer from `pool`.
class GradientOnWire {
 public:
  GradientOnWire(absl::Span<const float> gradient, WireDtype dtype, BytePool* pool);
  // Values [from, from + count) in the wire's dtype, without their field's tag and length
  // (GradientFieldPrefix).
  grpc::Slice Range(size_t from, size_t count);
  // True once gRPC holds none of the gradient's memory, after which the caller may change it
  // (at once when it was encoded into a buffer of its own); false if it still does after
  // `timeout`.
  bool AwaitReturned(absl::Duration timeout) const;

 private:
  std::optional<LentValues> lent_;
  grpc::Slice encoded_;  // the whole field, tag and length first, when not lent
  size_t start_ = 0;     // where its values begin
  size_t width_;
};

// An answer made of its own fields (`head`) and the parameters serialized once per version
// and shared by every such answer; an empty field when the answer has none.
template <typename Head>
struct SharedAnswer {
  Head head;
  ValuesField values;
};
using PushAnswer = SharedAnswer<v1::PushGradientReply>;
using ParametersAnswer = SharedAnswer<v1::Parameters>;

// The head's bytes followed by the shared ones.
bool EncodeShared(const google::protobuf::MessageLite& head, const ValuesField& values,
                  grpc::ByteBuffer* out);
template <typename Head>
bool RawEncode(const SharedAnswer<Head>& answer, grpc::ByteBuffer* out) {
  return EncodeShared(answer.head, answer.values, out);
}

}  // namespace dbs

#endif  // DBS_COMMON_GRPC_STEP_WIRE_H_
