// How a sharded job splits the model among its server processes (dbs_ps --shard=i/k).
//
// The model's values are one flat buffer (common/tensor.h); shard i of k keeps the contiguous
// range ShardRange(total, k, i): k ranges of nearly equal size whose boundaries fall on multiples
// of 16 values (64 bytes), whatever the tensors. A tensor that crosses a boundary is split by
// range. Every worker computes the same ranges from the layout, so the servers need not agree
// on anything but k: each one is registered with the pieces of its range (ShardLayout) as if
// they were a model of their own.
#ifndef DBS_COMMON_SHARD_RANGE_H_
#define DBS_COMMON_SHARD_RANGE_H_

#include <cstddef>
#include <utility>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "common/tensor.h"

namespace dbs {

// The most server processes a job may be split across.
inline constexpr int kMaxShards = 64;

struct ValueRange {
  size_t begin = 0;
  size_t end = 0;
  size_t size() const { return end - begin; }
  bool operator==(const ValueRange& o) const { return begin == o.begin && end == o.end; }
};

// The values shard `index` (0 <= index < count) of a `total`-value model keeps. Ranges of a
// model smaller than 16 values per shard may be empty.
ValueRange ShardRange(size_t total, int count, int index);

// The tensors of `layout` that overlap `range`, cut to it, in order. A tensor cut by the range
// becomes a piece named "name[a:b]" (its flat elements a .. b-1) of shape {b - a}; a tensor
// inside it keeps its name and shape. Buffers stay buffers.
ModelLayout ShardLayout(const ModelLayout& layout, ValueRange range);

// "i/k" (as --shard takes it) -> {i, k}; INVALID_ARGUMENT unless 0 <= i < k <= kMaxShards.
// "ordinal/k" takes i from the trailing "-N" of `host_name` (a Kubernetes StatefulSet pod's
// ordinal: dbs-ps-1 is shard 1), so every pod of the set can be given the same flags.
absl::StatusOr<std::pair<int, int>> ParseShard(absl::string_view text,
                                               absl::string_view host_name = "");

}  // namespace dbs

#endif  // DBS_COMMON_SHARD_RANGE_H_
