#include "common/shard_range.h"

#include <random>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/status_matchers.h"

namespace dbs {
namespace {

using ::testing::HasSubstr;

TEST(ShardRangeTest, RangesTileTheModelEvenlyOnAlignedBoundaries) {
  std::mt19937 rng(7);
  for (int trial = 0; trial < 500; ++trial) {
    const size_t total = std::uniform_int_distribution<size_t>(0, 1 << 20)(rng);
    const int k = std::uniform_int_distribution<int>(1, kMaxShards)(rng);
    size_t next = 0;
    size_t smallest = total;
    size_t largest = 0;
    for (int i = 0; i < k; ++i) {
      const ValueRange r = ShardRange(total, k, i);
      ASSERT_EQ(r.begin, next) << total << " " << k << " " << i;
      ASSERT_LE(r.begin, r.end);
      if (i + 1 < k) {
        EXPECT_EQ(r.end % 16, 0u);
      }
      smallest = std::min(smallest, r.size());
      largest = std::max(largest, r.size());
      next = r.end;
    }
    EXPECT_EQ(next, total);
    // Balanced to one 16-value block (and the last block's remainder).
    EXPECT_LE(largest - smallest, 32u) << total << " " << k;
  }
  EXPECT_EQ(ShardRange(1000, 1, 0), (ValueRange{0, 1000}));
  EXPECT_EQ(ShardRange(1000, 2, 0), (ValueRange{0, 496}));
  EXPECT_EQ(ShardRange(1000, 2, 1), (ValueRange{496, 1000}));
}

TEST(ShardRangeTest, LayoutPiecesCutTensorsByRange) {
  const ModelLayout layout = {{"conv.weight", {4, 10}, false},
                              {"conv.bias", {4}, false},
                              {"bn.mean", {6}, true},
                              {"fc.weight", {3, 30}, false}};            // 40 + 4 + 6 + 90 = 140
  const ModelLayout first = ShardLayout(layout, ShardRange(140, 2, 0));  // [0, 64)
  ASSERT_EQ(first.size(), 4u);
  EXPECT_EQ(first[0], layout[0]);
  EXPECT_EQ(first[1], layout[1]);
  EXPECT_EQ(first[2], layout[2]);
  EXPECT_EQ(first[3].name, "fc.weight[0:14]");
  EXPECT_EQ(first[3].shape, std::vector<int64_t>{14});
  const ModelLayout second = ShardLayout(layout, ShardRange(140, 2, 1));  // [64, 140)
  ASSERT_EQ(second.size(), 1u);
  EXPECT_EQ(second[0].name, "fc.weight[14:90]");
  EXPECT_EQ(TotalElements(first) + TotalElements(second), 140);
  // A cut buffer stays a buffer.
  const ModelLayout mid = ShardLayout(layout, {46, 48});
  ASSERT_EQ(mid.size(), 1u);
  EXPECT_EQ(mid[0].name, "bn.mean[2:4]");
  EXPECT_TRUE(mid[0].buffer);
  EXPECT_THAT(ValidateLayout(first), IsOk());
  EXPECT_THAT(ValidateLayout(second), IsOk());
}

TEST(ShardRangeTest, ParsesShardFlag) {
  auto ok = ParseShard("1/3");
  ASSERT_THAT(ok.status(), IsOk());
  EXPECT_EQ(ok->first, 1);
  EXPECT_EQ(ok->second, 3);
  for (const char* bad : {"", "3/3", "-1/2", "1", "a/b", "0/0", "0/65", "1/2/3"}) {
    EXPECT_THAT(ParseShard(bad).status(),
                StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("--shard")))
        << bad;
  }
}

TEST(ShardRangeTest, AnOrdinalShardComesFromTheHostName) {
  auto one = ParseShard("ordinal/2", "dbs-ps-1");
  ASSERT_THAT(one.status(), IsOk());
  EXPECT_EQ(*one, std::make_pair(1, 2));
  EXPECT_EQ(*ParseShard("ordinal/3", "my-job-dbs-ps-0"), std::make_pair(0, 3));
  EXPECT_THAT(ParseShard("ordinal/2", "laptop").status(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("'laptop' has none")));
  EXPECT_THAT(ParseShard("ordinal/2", "dbs-ps-x").status(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("has none")));
  EXPECT_THAT(ParseShard("ordinal/2", "dbs-ps-2").status(),  // a third pod of a 2-shard job
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("got '2/2'")));
}

}  // namespace
}  // namespace dbs
