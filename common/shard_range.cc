#include "common/shard_range.h"

#include <algorithm>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"

namespace dbs {

namespace {
constexpr size_t kAlign = 16;  // values: 64 bytes of fp32
}  // namespace

ValueRange ShardRange(size_t total, int count, int index) {
  if (count <= 1) return {0, total};
  // Boundaries at multiples of kAlign values, as even as that allows.
  const size_t blocks = (total + kAlign - 1) / kAlign;
  auto boundary = [&](int i) {
    const size_t b = blocks * static_cast<size_t>(i) / static_cast<size_t>(count);
    return std::min(total, b * kAlign);
  };
  return {boundary(index), boundary(index + 1)};
}

ModelLayout ShardLayout(const ModelLayout& layout, ValueRange range) {
  ModelLayout pieces;
  size_t offset = 0;
  for (const TensorSpec& t : layout) {
    const size_t n = static_cast<size_t>(t.NumElements());
    const size_t begin = std::max(offset, range.begin);
    const size_t end = std::min(offset + n, range.end);
    if (begin < end) {
      if (begin == offset && end == offset + n) {
        pieces.push_back(t);
      } else {
        TensorSpec piece;
        piece.name = absl::StrCat(t.name, "[", begin - offset, ":", end - offset, "]");
        piece.shape = {static_cast<int64_t>(end - begin)};
        piece.buffer = t.buffer;
        pieces.push_back(std::move(piece));
      }
    }
    offset += n;
  }
  return pieces;
}

absl::StatusOr<std::pair<int, int>> ParseShard(absl::string_view text,
                                               absl::string_view host_name) {
  const std::vector<absl::string_view> parts = absl::StrSplit(text, '/');
  if (parts.size() == 2 && parts[0] == "ordinal") {
    const size_t dash = host_name.rfind('-');
    const absl::string_view ordinal =
        dash == absl::string_view::npos ? absl::string_view() : host_name.substr(dash + 1);
    int i = 0;
    if (ordinal.empty() || !absl::SimpleAtoi(ordinal, &i)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--shard=ordinal/k takes the shard from the host name's trailing -N (a StatefulSet "
          "pod's ordinal, as in dbs-ps-1); host name '",
          host_name, "' has none"));
    }
    return ParseShard(absl::StrCat(i, "/", parts[1]));
  }
  int i = 0;
  int k = 0;
  if (parts.size() != 2 || !absl::SimpleAtoi(parts[0], &i) || !absl::SimpleAtoi(parts[1], &k) ||
      k < 1 || k > kMaxShards || i < 0 || i >= k) {
    return absl::InvalidArgumentError(
        absl::StrCat("--shard must be i/k with 0 <= i < k <= ", kMaxShards,
                     " (e.g. 0/2 for the first of two shards), or ordinal/k; got '", text, "'"));
  }
  return std::make_pair(i, k);
}

}  // namespace dbs
