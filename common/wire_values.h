// Flat model values on the wire: every tensor of the registered layout in layout order,
// concatenated, little-endian, in the job's wire dtype (fp32, bf16 or fp16).
//
// A received payload is a list of byte segments (the pieces of the message as the transport
// delivered them, never copied into one buffer); values may straddle segments. They are read
// where they lie, run by run. Free of gRPC; stateless; thread-safe.
#ifndef DBS_COMMON_WIRE_VALUES_H_
#define DBS_COMMON_WIRE_VALUES_H_

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/config.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"

namespace dbs {

enum class WireDtype { kFp32 = 0, kBf16 = 1, kFp16 = 2 };

// 4 or 2.
size_t BytesPerValue(WireDtype dtype);
// True where fp32 values travel as they lie in memory (a little-endian machine).
constexpr bool Fp32IsWireOrder() {
#ifdef ABSL_IS_LITTLE_ENDIAN
  return true;
#else
  return false;
#endif
}
// "fp32", "bf16", "fp16".
const char* WireDtypeName(WireDtype dtype);
absl::StatusOr<WireDtype> ParseWireDtype(absl::string_view name);

// Round to nearest even; NaN stays NaN, out-of-range values become infinities (fp16).
uint16_t FloatToBf16(float v);
float Bf16ToFloat(uint16_t v);
uint16_t FloatToFp16(float v);
float Fp16ToFloat(uint16_t v);

// Writes `values` in `dtype` to `out` (values.size() * BytesPerValue(dtype) bytes).
void EncodeValues(absl::Span<const float> values, WireDtype dtype, uint8_t* out);
// Reads `out.size()` values in `dtype` from `in`.
void DecodeValues(const uint8_t* in, WireDtype dtype, absl::Span<float> out);
// Copies `n` values from `in` to `out` (which may be `in`) rounded as the wire rounds them:
// DecodeValues(EncodeValues(v)) bit for bit, in one pass (a plain copy in fp32).
void CopyRoundedAsWire(const float* in, size_t n, WireDtype dtype, float* out);

// A received payload of values: byte segments in order, kept alive by `keepalive` (the message
// they point into; may be null when the caller guarantees the lifetime).
struct WirePayload {
  WireDtype dtype = WireDtype::kFp32;
  std::vector<absl::Span<const uint8_t>> segments;
  size_t bytes = 0;  // the sum of the segments' sizes
  std::shared_ptr<const void> keepalive;
  // The bytes lie in memory the sender can still write (its shared-memory region): a reader
  // that checks values must read each one once, and use what it checked.
  bool writable_by_sender = false;

  // How many values the bytes hold; INVALID_ARGUMENT unless that is exactly `count`.
  absl::Status CheckCount(size_t count) const;

  // An owned copy of `values` in `dtype` (tests, in-process clients).
  static std::shared_ptr<const WirePayload> FromFloats(absl::Span<const float> values,
                                                       WireDtype dtype = WireDtype::kFp32);
};

// Values [first, first + count) of `payload` (which must hold them), as a view of its segments:
// no copy, the same keepalive.
WirePayload SubPayload(const WirePayload& payload, size_t first, size_t count);

// Calls `run(first_index, bytes, count)` for each run of `count` consecutive values in the
// payload's dtype (little-endian) where they lie in the segments, possibly unaligned (read fp32
// ones with LoadFp32), a value split across segments as a run of its own. Stops at the first
// non-OK status, which it returns. No copy.
absl::Status ForEachRun(const WirePayload& payload,
                        const std::function<absl::Status(size_t, const uint8_t*, size_t)>& run);
// Value `i` of such a run (an unaligned load).
inline float LoadFp32(const uint8_t* run, size_t i) {
  float v;
  std::memcpy(&v, run + 4 * i, sizeof v);
  return v;
}

// Decodes the whole payload into `out` (which must hold exactly its values).
absl::Status DecodePayload(const WirePayload& payload, absl::Span<float> out);

}  // namespace dbs

#endif  // DBS_COMMON_WIRE_VALUES_H_
