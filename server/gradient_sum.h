// The check and the sum of a pushed gradient's values, block by block over the bytes as they
// arrived (fp32, bf16 or fp16, unaligned, in one or more runs): each block checked while it is
// in the L1 cache, then added to the step's sum. No lock, no state: StepAggregator calls it
// before its lock (the check) and under it (the sum).
#ifndef DBS_SERVER_GRADIENT_SUM_H_
#define DBS_SERVER_GRADIENT_SUM_H_

#include <cstddef>
#include <vector>

#include "absl/status/status.h"
#include "common/wire_values.h"

namespace dbs {

// Gradients beyond this magnitude are refused: with at most kMaxGlobalBatch samples a step's
// weighted sum of accepted gradients then stays finite, so accepting a push never needs to look
// at the sum (the values are checked before the aggregator's lock is taken).
inline constexpr float kMaxAbsGradient = 1e30f;
// A pushed gradient is checked and summed in blocks of this many values, each checked while it
// is in the L1 cache and then added; a bad value stops the sum at the start of its block.
inline constexpr size_t kSumBlock = 2048;

// Each block's sum of squares (block k: values [k * kSumBlock, (k + 1) * kSumBlock)) of a
// gradient its sender can still write (shared memory), as it was checked before the lock.
using BlockSquares = std::vector<double>;

// Checks `values` (values [offset, ...) of worker `worker_id`'s gradient) and, with a `sum`,
// adds `weight` times each of them to sum[offset...], in one pass: stops at the first block
// with a value that is not finite or beyond kMaxAbsGradient (the blocks before it are summed)
// and returns the refusal naming it. With `check` false the values were checked already
// (before the lock) and are only summed, which spares a second pass over every received byte;
// values their sender can still write (`WirePayload::writable_by_sender`) are read once, into
// the caller's stack, and checked and summed from there. With `sum_squares`, the squares of the
// values checked are added to it. With `blocks`, each block's sum of squares is recorded there
// (no `sum`: the check before the lock), or, with a `sum`, must equal the recorded one, else
// the sum stops at that block and the refusal says the values changed after their check.
absl::Status CheckAndSum(int worker_id, size_t offset, const WirePayload& values, float* sum,
                         float weight, bool check = true, double* sum_squares = nullptr,
                         BlockSquares* blocks = nullptr);

}  // namespace dbs

#endif  // DBS_SERVER_GRADIENT_SUM_H_
