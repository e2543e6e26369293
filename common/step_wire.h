// The per-step messages on the wire without copies: PushGradientRequest's `gradient` and
// PushGradientReply's `values` (FlatParameters) are read as byte segments that point into the
// received message, and written straight into a caller's buffer; every other field goes through
// the ordinary generated parser. Free of gRPC (protobuf's zero-copy streams only); stateless.
#ifndef DBS_COMMON_STEP_WIRE_H_
#define DBS_COMMON_STEP_WIRE_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/types/span.h"
#include "common/tensor.h"
#include "common/wire_values.h"
#include "google/protobuf/io/zero_copy_stream.h"
#include "proto/dbs.pb.h"

namespace dbs {

using Segments = std::vector<absl::Span<const uint8_t>>;

// A ZeroCopyInputStream over byte segments (the slices of a received message).
class SegmentsInputStream : public google::protobuf::io::ZeroCopyInputStream {
 public:
  explicit SegmentsInputStream(const Segments& segments) : segments_(segments) {}
  bool Next(const void** data, int* size) override;
  void BackUp(int count) override;
  bool Skip(int count) override;
  int64_t ByteCount() const override { return position_; }

 private:
  const Segments& segments_;
  size_t index_ = 0;   // the segment Next returns next
  size_t offset_ = 0;  // within segments_[index_]
  int64_t position_ = 0;
  int last_size_ = 0;  // of the last Next, for BackUp
};

// Reads one message from `in`. Length-delimited field `field` (at most once) comes back as the
// segments of its bytes (pointing into `in`'s buffers: valid while those are); every other field
// is re-encoded into `rest`, for the message's generated parser. INVALID_ARGUMENT if the bytes
// are not a well-formed message.
absl::Status SplitField(google::protobuf::io::ZeroCopyInputStream* in, int field, std::string* rest,
                        Segments* segments, bool* present);

// A push as received: its header (every field but the gradient) and its gradient's bytes.
absl::Status ParsePushRequest(const Segments& message, v1::PushGradientRequest* header,
                              WirePayload* gradient);

// The bytes of PushGradientReply field `values` (a FlatParameters holding `count` values of
// `dtype` at `version`) before the values, tag and length included: written once per step, and
// with the values (which follow them, encoded by EncodeValues) appended to every worker's reply;
// returns how many there are.
size_t WriteValuesFieldHead(int64_t version, WireDtype dtype, size_t count, uint8_t* out);

// The values of one version as an answer's field carries them after its head: `count` values in
// `dtype` at `bytes`, which `keep` keeps valid and unchanged. Null bytes: no values.
struct EncodedValues {
  int64_t version = 0;
  WireDtype dtype = WireDtype::kFp32;
  size_t count = 0;
  const uint8_t* bytes = nullptr;
  std::shared_ptr<const void> keep;
};

// The bytes of PushGradientRequest field `gradient` (tag and length included).
size_t GradientFieldSize(size_t count, WireDtype dtype);
void WriteGradientField(WireDtype dtype, absl::Span<const float> values, uint8_t* out);

// Reads a reply: every field but `values` into `head`; the values, which must be exactly
// `params.size()` finite-or-not floats, decoded straight into `params`, their version into
// `*version`. Nothing is written to `params` unless the whole reply is well formed.
// With `in_shared_memory`, a reply whose values lie in the server's shared slots
// (FlatParameters.in_shared_memory) is accepted too: `*in_shared_memory` is set, `*version` is
// theirs, and `params` is left alone for the caller to read them from the slots.
absl::Status ParsePushReply(const Segments& message, v1::PushGradientReply* head,
                            absl::Span<float> params, int64_t* version,
                            bool* in_shared_memory = nullptr);

// What precedes a gradient's `count` values in a push: PushGradientRequest field `gradient`'s
// tag and length (the header's own bytes go before it, the values after).
std::string GradientFieldPrefix(size_t count, WireDtype dtype);

// The values of a Parameters message into `params` (TotalElements(layout) floats): its flat
// `values` when present, else its tensors (ResumeReply). Nothing is written on error.
absl::Status DecodeParameters(const v1::Parameters& message, const ModelLayout& layout,
                              absl::Span<float> params);

}  // namespace dbs

#endif  // DBS_COMMON_STEP_WIRE_H_
