#include "server/gradient_sum.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>

#include "absl/strings/str_cat.h"
#include "common/multiversion.h"
#include "common/status_macros.h"

namespace dbs {

namespace {

// The check and the sum over every pushed value, free functions over raw little-endian bytes
// (unaligned loads), so that each is compiled for AVX2 too (multiversion.h), and branch-free, so
// that the compiler vectorizes them.
// Whether every one of the n fp32 values is finite and at most `limit` in magnitude.
DBS_WIDE_VECTORS bool AllWithin(const uint8_t* values, size_t n, float limit) {
  int bad = 0;
  for (size_t i = 0; i < n; ++i) bad |= !(std::fabs(LoadFp32(values, i)) <= limit);
  return bad == 0;
}

// Lanes of a sum of squares: a loop the compiler vectorizes without reordering a single sum,
// into enough independent accumulators that the additions' latency does not bound it.
constexpr size_t kSquareLanes = 64;

// The sum of the squares of n fp32 values. Every square is a float, so the sum is finite only
// when every value is finite and below 1.8e19 in magnitude (its square at most FLT_MAX).
DBS_WIDE_VECTORS double SumOfSquares(const uint8_t* values, size_t n) {
  float lanes[kSquareLanes] = {};
  size_t i = 0;
  for (; i + kSquareLanes <= n; i += kSquareLanes) {
    for (size_t k = 0; k < kSquareLanes; ++k) {
      const float v = LoadFp32(values, i + k);
      lanes[k] += v * v;
    }
  }
  double total = 0.0;
  for (float l : lanes) total += l;
  for (; i < n; ++i) {
    const float v = LoadFp32(values, i);
    total += v * v;
  }
  return total;
}

// sum[i] += weight * values[i], fp32 values.
DBS_WIDE_VECTORS void AddScaled(float* sum, const uint8_t* values, size_t n, float weight) {
  for (size_t i = 0; i < n; ++i) sum[i] += weight * LoadFp32(values, i);
}

uint16_t LoadBf16(const uint8_t* values, size_t i) {
  uint16_t h;
  std::memcpy(&h, values + 2 * i, sizeof h);
  return h;
}

// The same check on bf16 values, on their bits: a bf16 value's magnitude grows with its bits
// without the sign, infinities and NaNs above every finite value. `limit_bits`: the bits of
// the largest bf16 value at most the limit.
DBS_WIDE_VECTORS bool AllWithinBf16(const uint8_t* values, size_t n, uint16_t limit_bits) {
  int bad = 0;
  for (size_t i = 0; i < n; ++i) bad |= (LoadBf16(values, i) & 0x7fffu) > limit_bits;
  return bad == 0;
}

// sum[i] += weight * values[i], bf16 values decoded on the way (a bf16 value is the top half of
// the fp32 one, exactly): the same additions as decoding them first, in one pass.
DBS_WIDE_VECTORS void AddScaledBf16(float* sum, const uint8_t* values, size_t n, float weight) {
  for (size_t i = 0; i < n; ++i) {
    const uint32_t bits = static_cast<uint32_t>(LoadBf16(values, i)) << 16;
    float v;
    std::memcpy(&v, &bits, sizeof v);
    sum[i] += weight * v;
  }
}

// The same on bf16 values.
DBS_WIDE_VECTORS double SumOfSquaresBf16(const uint8_t* values, size_t n) {
  float lanes[kSquareLanes] = {};
  size_t i = 0;
  for (; i + kSquareLanes <= n; i += kSquareLanes) {
    for (size_t k = 0; k < kSquareLanes; ++k) {
      const uint32_t bits = static_cast<uint32_t>(LoadBf16(values, i + k)) << 16;
      float v;
      std::memcpy(&v, &bits, sizeof v);
      lanes[k] += v * v;
    }
  }
  double total = 0.0;
  for (float l : lanes) total += l;
  for (; i < n; ++i) {
    const uint32_t bits = static_cast<uint32_t>(LoadBf16(values, i)) << 16;
    float v;
    std::memcpy(&v, &bits, sizeof v);
    total += v * v;
  }
  return total;
}

// The bits of the largest bf16 value at most `limit` (positive, finite): fp32's bits cut to
// their top half, which rounds toward zero.
uint16_t Bf16LimitBits(float limit) {
  uint32_t bits;
  std::memcpy(&bits, &limit, sizeof bits);
  return static_cast<uint16_t>(bits >> 16);
}

// Block k of a gradient its sender can still write, starting at value `at`: its squares are
// recorded (`record`: the check before the lock) or must be the recorded ones (the sum), so that
// what is summed has the norm that was screened.
absl::Status RecordOrMatchSquares(bool record, int worker_id, size_t at, size_t count,
                                  double squares, BlockSquares* blocks) {
  const size_t k = at / kSumBlock;
  if (at % kSumBlock != 0) {
    return absl::InternalError(absl::StrCat("a block of worker ", worker_id,
                                            "'s gradient starts at element ", at,
                                            ", not at a multiple of ", kSumBlock));
  }
  if (record) {
    if (k != blocks->size()) return absl::InternalError("the blocks are checked out of order");
    blocks->push_back(squares);
    return absl::OkStatus();
  }
  if (k < blocks->size() && (*blocks)[k] == squares) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat("worker ", worker_id, "'s elements ", at, " to ", at + count - 1,
                   " changed after they were checked (their sum of squares ", squares, ", checked ",
                   k < blocks->size() ? absl::StrCat((*blocks)[k]) : std::string("none"), ")"));
}

// The refusal naming the first of a block's values that is not finite or beyond the limit
// (the block has one); `first`: the block's first value in the gradient.
absl::Status BadValue(int worker_id, size_t first, WireDtype dtype, const uint8_t* raw,
                      const uint8_t* fp32) {
  for (size_t i = 0;; ++i) {
    const float x = dtype == WireDtype::kBf16 ? Bf16ToFloat(LoadBf16(raw, i)) : LoadFp32(fp32, i);
    if (!(std::fabs(x) <= kMaxAbsGradient)) {  // NaN fails too
      return absl::InvalidArgumentError(
          absl::StrCat("gradient rejected: worker ", worker_id, "'s element ", first + i, " is ", x,
                       " (not finite, or beyond ", kMaxAbsGradient, "); the push is refused"));
    }
  }
}

}  // namespace

absl::Status CheckAndSum(int worker_id, size_t offset, const WirePayload& values, float* sum,
                         float weight, bool check, double* sum_squares, BlockSquares* blocks) {
  // Block by block: each block is checked while it is in the L1 cache, the culprit named only
  // when there is one, and then added. A bad value stops the sum at the start of its block.
  // `raw` holds the block's values as they arrived, little-endian in the payload's dtype:
  // fp32 and bf16 are checked and summed where they lie, fp16 is decoded into `decoded` first.
  static const uint16_t kBf16Limit = Bf16LimitBits(kMaxAbsGradient);
  const WireDtype dtype = values.dtype;
  float decoded[kSumBlock];
  // Values their sender can still write (shared memory) are copied first, block by block, so
  // that what is summed is what was checked.
  alignas(64) uint8_t copy[kSumBlock * sizeof(float)];
  const bool copy_first = check && sum != nullptr && values.writable_by_sender;
  auto block = [&](size_t first, size_t count, const uint8_t* raw) {
    if (copy_first) {
      std::memcpy(copy, raw, count * BytesPerValue(dtype));
      raw = copy;
    }
    const uint8_t* fp32 = raw;
    if (dtype == WireDtype::kFp16) {
      DecodeValues(raw, dtype, absl::MakeSpan(decoded, count));
      fp32 = reinterpret_cast<const uint8_t*>(decoded);
    }
    const bool squared = sum_squares != nullptr || blocks != nullptr;
    const double squares = !squared ? 0.0
                                    : (dtype == WireDtype::kBf16 ? SumOfSquaresBf16(raw, count)
                                                                 : SumOfSquares(fp32, count));
    // A finite sum of float squares vouches for every value (finite, below 1.8e19, within the
    // limit): only a block whose squares are not finite needs its values checked one by one.
    const bool ok = !check || (squared && std::isfinite(squares)) ||
                    (dtype == WireDtype::kBf16 ? AllWithinBf16(raw, count, kBf16Limit)
                                               : AllWithin(fp32, count, kMaxAbsGradient));
    if (!ok) return BadValue(worker_id, offset + first, dtype, raw, fp32);
    if (sum_squares != nullptr) *sum_squares += squares;
    if (blocks != nullptr) {
      DBS_RETURN_IF_ERROR(
          RecordOrMatchSquares(sum == nullptr, worker_id, offset + first, count, squares, blocks));
    }
    if (sum != nullptr) {
      if (dtype == WireDtype::kBf16) {
        AddScaledBf16(sum + offset + first, raw, count, weight);
      } else {
        AddScaled(sum + offset + first, fp32, count, weight);
      }
    }
    return absl::OkStatus();
  };
  const size_t width = BytesPerValue(dtype);
  // Values [from, from + count) of the payload.
  auto range = [&](size_t from, const uint8_t* data, size_t count) -> absl::Status {
    for (size_t b = 0; b < count; b += kSumBlock) {
      const size_t hi = std::min(count, b + kSumBlock);
      DBS_RETURN_IF_ERROR(block(from + b, hi - b, data + width * b));
    }
    return absl::OkStatus();
  };
  return ForEachRun(values, range);
}

}  // namespace dbs
