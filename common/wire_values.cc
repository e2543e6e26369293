#include "common/wire_values.h"

#include <algorithm>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "common/multiversion.h"
#include "common/status_macros.h"

namespace dbs {
namespace {

uint32_t Bits(float v) {
  uint32_t x;
  std::memcpy(&x, &v, sizeof x);
  return x;
}

float FromBits(uint32_t x) {
  float v;
  std::memcpy(&v, &x, sizeof v);
  return v;
}

}  // namespace

size_t BytesPerValue(WireDtype dtype) { return dtype == WireDtype::kFp32 ? 4 : 2; }

const char* WireDtypeName(WireDtype dtype) {
  switch (dtype) {
    case WireDtype::kFp32:
      return "fp32";
    case WireDtype::kBf16:
      return "bf16";
    case WireDtype::kFp16:
      return "fp16";
  }
  return "fp32";
}

absl::StatusOr<WireDtype> ParseWireDtype(absl::string_view name) {
  if (name == "fp32") return WireDtype::kFp32;
  if (name == "bf16") return WireDtype::kBf16;
  if (name == "fp16") return WireDtype::kFp16;
  return absl::InvalidArgumentError(
      absl::StrCat("unknown wire dtype '", name, "': use fp32, bf16 or fp16"));
}

uint16_t FloatToBf16(float v) {
  uint32_t x = Bits(v);
  if ((x & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((x >> 16) | 0x40);  // NaN
  x += 0x7fffu + ((x >> 16) & 1u);  // round to nearest even; overflow rounds to infinity
  return static_cast<uint16_t>(x >> 16);
}

float Bf16ToFloat(uint16_t v) { return FromBits(static_cast<uint32_t>(v) << 16); }

uint16_t FloatToFp16(float v) {
  const uint32_t x = Bits(v);
  const uint32_t sign = (x >> 16) & 0x8000u;
  const uint32_t exp = (x >> 23) & 0xffu;
  uint32_t mant = x & 0x7fffffu;
  if (exp == 0xffu) return static_cast<uint16_t>(sign | 0x7c00u | (mant != 0 ? 0x200u : 0u));
  const int e = static_cast<int>(exp) - 127 + 15;
  if (e >= 0x1f) return static_cast<uint16_t>(sign | 0x7c00u);  // too large: infinity
  if (e <= 0) {                                                 // a subnormal half, or zero
    if (e < -10) return static_cast<uint16_t>(sign);
    mant |= 0x800000u;
    const int shift = 14 - e;
    uint32_t half = mant >> shift;
    const uint32_t rem = mant & ((1u << shift) - 1);
    const uint32_t halfway = 1u << (shift - 1);
    if (rem > halfway || (rem == halfway && (half & 1u))) ++half;
    return static_cast<uint16_t>(sign | half);
  }
  uint32_t half = sign | (static_cast<uint32_t>(e) << 10) | (mant >> 13);
  const uint32_t rem = mant & 0x1fffu;
  if (rem > 0x1000u || (rem == 0x1000u && (half & 1u))) ++half;  // may carry into infinity
  return static_cast<uint16_t>(half);
}

float Fp16ToFloat(uint16_t h) {
  const uint32_t sign = (static_cast<uint32_t>(h) & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu;
  const uint32_t mant = h & 0x3ffu;
  if (exp == 0) {
    const float magnitude = static_cast<float>(mant) * (1.0f / 16777216.0f);  // mant * 2^-24
    return sign != 0 ? -magnitude : magnitude;
  }
  if (exp == 0x1f) return FromBits(sign | 0x7f800000u | (mant << 13));
  return FromBits(sign | ((exp + 112) << 23) | (mant << 13));
}

namespace {

// Raw pointers: absl::Span's operator[] checks its bound (Debian builds Abseil hardened), and
// that branch would keep these loops scalar.
template <uint16_t (*kToHalf)(float)>
void EncodeHalves(absl::Span<const float> values, uint8_t* out) {
  const float* const v = values.data();
  const size_t n = values.size();
  for (size_t i = 0; i < n; ++i) {
    const uint16_t h = kToHalf(v[i]);
    std::memcpy(out + 2 * i, &h, 2);
  }
}

// bf16's encode on its own, compiled for AVX2 too (multiversion.h): SSE2 cannot narrow 32-bit
// lanes to 16 bits, so its copy takes about twice the instructions. The decode, a shift, is
// bound by memory either way.
DBS_WIDE_VECTORS void EncodeBf16(absl::Span<const float> values, uint8_t* out) {
  EncodeHalves<FloatToBf16>(values, out);
}

template <float (*kFromHalf)(uint16_t)>
void DecodeHalves(const uint8_t* in, absl::Span<float> out) {
  float* const v = out.data();
  const size_t n = out.size();
  for (size_t i = 0; i < n; ++i) {
    uint16_t h;
    std::memcpy(&h, in + 2 * i, 2);
    v[i] = kFromHalf(h);
  }
}

}  // namespace

void EncodeValues(absl::Span<const float> values, WireDtype dtype, uint8_t* out) {
  if (values.empty()) return;  // its data() may be null, which memcpy must not get
  switch (dtype) {
    case WireDtype::kFp32:
      std::memcpy(out, values.data(), values.size() * sizeof(float));
      return;
    case WireDtype::kBf16:
      return EncodeBf16(values, out);
    case WireDtype::kFp16:
      return EncodeHalves<FloatToFp16>(values, out);
  }
}

void DecodeValues(const uint8_t* in, WireDtype dtype, absl::Span<float> out) {
  if (out.empty()) return;
  switch (dtype) {
    case WireDtype::kFp32:
      std::memcpy(out.data(), in, out.size() * sizeof(float));
      return;
    case WireDtype::kBf16:
      return DecodeHalves<Bf16ToFloat>(in, out);
    case WireDtype::kFp16:
      return DecodeHalves<Fp16ToFloat>(in, out);
  }
}

namespace {

template <uint16_t (*kToHalf)(float), float (*kFromHalf)(uint16_t)>
void RoundHalves(const float* in, size_t n, float* out) {
  for (size_t i = 0; i < n; ++i) out[i] = kFromHalf(kToHalf(in[i]));
}

// bf16's, compiled for AVX2 too (multiversion.h), as its encode is.
DBS_WIDE_VECTORS void RoundBf16(const float* in, size_t n, float* out) {
  RoundHalves<FloatToBf16, Bf16ToFloat>(in, n, out);
}

}  // namespace

void CopyRoundedAsWire(const float* in, size_t n, WireDtype dtype, float* out) {
  if (n == 0) return;
  switch (dtype) {
    case WireDtype::kFp32:
      if (in != out) std::memcpy(out, in, n * sizeof(float));
      return;
    case WireDtype::kBf16:
      return RoundBf16(in, n, out);
    case WireDtype::kFp16:
      return RoundHalves<FloatToFp16, Fp16ToFloat>(in, n, out);
  }
}

absl::Status WirePayload::CheckCount(size_t count) const {
  const size_t bpv = BytesPerValue(dtype);
  if (bytes % bpv != 0 || bytes / bpv != count) {
    return absl::InvalidArgumentError(absl::StrCat("the payload holds ", bytes, " bytes (",
                                                   WireDtypeName(dtype), "); the model needs ",
                                                   count, " values = ", count * bpv, " bytes"));
  }
  return absl::OkStatus();
}

std::shared_ptr<const WirePayload> WirePayload::FromFloats(absl::Span<const float> values,
                                                           WireDtype dtype) {
  auto storage = std::make_shared<std::vector<uint8_t>>(values.size() * BytesPerValue(dtype));
  EncodeValues(values, dtype, storage->data());
  auto p = std::make_shared<WirePayload>();
  p->dtype = dtype;
  p->bytes = storage->size();
  if (!storage->empty()) p->segments.push_back(absl::MakeConstSpan(*storage));
  p->keepalive = storage;
  return p;
}

absl::Status ForEachRun(const WirePayload& payload,
                        const std::function<absl::Status(size_t, const uint8_t*, size_t)>& run) {
  const size_t width = BytesPerValue(payload.dtype);
  uint8_t carry[4];
  size_t carried = 0;
  size_t index = 0;
  for (absl::Span<const uint8_t> seg : payload.segments) {
    const uint8_t* p = seg.data();
    size_t n = seg.size();
    if (carried > 0) {  // a value split across segments
      const size_t take = std::min(width - carried, n);
      std::memcpy(carry + carried, p, take);
      carried += take;
      p += take;
      n -= take;
      if (carried == width) {
        DBS_RETURN_IF_ERROR(run(index++, carry, 1));
        carried = 0;
      }
    }
    if (n >= width) {
      DBS_RETURN_IF_ERROR(run(index, p, n / width));
      index += n / width;
      p += n / width * width;
      n %= width;
    }
    if (n > 0) {
      std::memcpy(carry, p, n);
      carried = n;
    }
  }
  if (carried > 0) return absl::InvalidArgumentError("the payload ends inside a value");
  return absl::OkStatus();
}

WirePayload SubPayload(const WirePayload& payload, size_t first, size_t count) {
  WirePayload view;
  view.dtype = payload.dtype;
  view.keepalive = payload.keepalive;
  view.writable_by_sender = payload.writable_by_sender;
  const size_t width = BytesPerValue(payload.dtype);
  size_t skip = first * width;  // bytes to pass over
  size_t want = count * width;  // bytes still to take
  for (absl::Span<const uint8_t> seg : payload.segments) {
    if (want == 0) break;
    if (skip >= seg.size()) {
      skip -= seg.size();
      continue;
    }
    const size_t take = std::min(seg.size() - skip, want);
    view.segments.push_back(seg.subspan(skip, take));
    view.bytes += take;
    want -= take;
    skip = 0;
  }
  return view;
}

absl::Status DecodePayload(const WirePayload& payload, absl::Span<float> out) {
  DBS_RETURN_IF_ERROR(payload.CheckCount(out.size()));
  // Each received run straight into its place in `out`: one pass, no buffer between (a bf16
  // model of 10M values decoded through a block buffer spent 13% of the worker's CPU copying
  // the buffer out).
  return ForEachRun(payload, [&](size_t first, const uint8_t* bytes, size_t count) {
    DecodeValues(bytes, payload.dtype, out.subspan(first, count));
    return absl::OkStatus();
  });
}

}  // namespace dbs
