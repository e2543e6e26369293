#include "server/batch_allocator.h"

#include <algorithm>
#include <numeric>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/status_matchers.h"

namespace dbs {
namespace {

using ::testing::ElementsAre;

int64_t Sum(const std::vector<int64_t>& v) { return std::accumulate(v.begin(), v.end(), 0LL); }

TEST(LargestRemainderTest, SplitsProportionallyAndSumsExactly) {
  EXPECT_THAT(LargestRemainder(128, {0.125, 0.125, 0.25, 0.5}), ElementsAre(16, 16, 32, 64));
  // 100 * (1/3, 1/3, 1/3) = 33.33 each: one leftover unit goes to the lowest index on a tie.
  EXPECT_THAT(LargestRemainder(100, {1.0, 1.0, 1.0}), ElementsAre(34, 33, 33));
  // 10 * (0.55, 0.45) = 5.5, 4.5: floors 5 + 4, the leftover to the first (tie on .5).
  EXPECT_THAT(LargestRemainder(10, {0.55, 0.45}), ElementsAre(6, 4));
  // The largest fraction wins the leftover: 7 * (0.3, 0.7) = 2.1, 4.9.
  EXPECT_THAT(LargestRemainder(7, {0.3, 0.7}), ElementsAre(2, 5));
}

TEST(LargestRemainderTest, UnnormalisedSharesAreScaled) {
  EXPECT_THAT(LargestRemainder(64, {1, 1, 2}), ElementsAre(16, 16, 32));
}

TEST(LargestRemainderTest, SumIsExactForManyAwkwardSplits) {
  for (int64_t total : {1, 2, 3, 7, 63, 64, 127, 256, 1000, 99991}) {
    for (int n : {1, 2, 3, 5, 7, 16, 64}) {
      std::vector<double> shares(n);
      for (int i = 0; i < n; ++i) shares[i] = 1.0 / (i + 1.7);
      const std::vector<int64_t> out = LargestRemainder(total, shares);
      EXPECT_EQ(Sum(out), total) << total << " over " << n;
      for (int64_t v : out) EXPECT_GE(v, 0);
    }
  }
}

TEST(LargestRemainderTest, ZeroShareGetsNothingAndTinyShareMayGetNothing) {
  EXPECT_THAT(LargestRemainder(10, {0.0, 1.0}), ElementsAre(0, 10));
  EXPECT_THAT(LargestRemainder(10, {1e-9, 1.0}), ElementsAre(0, 10));
}

TEST(LargestRemainderTest, HugeRatiosStayExact) {
  const std::vector<int64_t> out = LargestRemainder(256, {1e12, 1.0, 1e-12});
  EXPECT_THAT(out, ElementsAre(256, 0, 0));
}

TEST(AllocateEpochTest, OneWorkerGetsEverything) {
  auto a = AllocateEpoch(1000, 100, 64, {1.0});
  ASSERT_THAT(a, IsOk()) << a.status();
  EXPECT_EQ(a->num_steps, 16);  // 15 full steps of 64 + one of 40
  ASSERT_EQ(a->workers.size(), 1u);
  EXPECT_EQ(a->workers[0].batch_size, 64);
  EXPECT_EQ(a->workers[0].final_batch_size, 1000 - 15 * 64);
  ASSERT_EQ(a->workers[0].train.size(), 16u);
  EXPECT_EQ(a->workers[0].train[0], (SampleRange{0, 64}));
  EXPECT_EQ(a->workers[0].train[15], (SampleRange{960, 1000}));
  EXPECT_EQ(a->workers[0].test, (SampleRange{0, 100}));
}

TEST(AllocateEpochTest, RangesCoverThePermutationExactlyOnce) {
  for (int64_t d : {64, 1000, 6000, 60000, 60001}) {
    for (int b : {1, 7, 64, 128, 256}) {
      const std::vector<double> shares = {0.1, 0.2, 0.3, 0.4, 1e-6};
      auto a = AllocateEpoch(d, 10000, b, shares);
      ASSERT_THAT(a, IsOk()) << a.status();
      std::vector<int> hits(d, 0);
      int64_t batch_sum = 0, last_sum = 0, test_next = 0;
      for (const WorkerAllocation& w : a->workers) {
        for (const SampleRange& r : w.train) {
          for (int64_t i = r.begin; i < r.end; ++i) hits[i]++;
        }
        // The ranges hold exactly the worker's steps.
        EXPECT_EQ(w.train_samples(),
                  static_cast<int64_t>(a->num_steps - 1) * w.batch_size + w.final_batch_size);
        batch_sum += w.batch_size;
        last_sum += w.final_batch_size;
        EXPECT_EQ(w.test.begin, test_next);
        test_next = w.test.end;
      }
      EXPECT_EQ(test_next, 10000);
      EXPECT_EQ(batch_sum, b);
      EXPECT_EQ(last_sum, d % b == 0 ? b : d % b);
      EXPECT_EQ(a->num_steps, (d + b - 1) / b);
      for (int64_t i = 0; i < d; ++i) ASSERT_EQ(hits[i], 1) << "sample " << i << " d=" << d;
    }
  }
}

TEST(AllocateEpochTest, EveryStepUsesTheSameBlockWhateverTheSplit) {
  // 10 samples, B = 4: steps use positions [0,4), [4,8), [8,10) under any split.
  for (const std::vector<double>& shares :
       {std::vector<double>{1.0}, {0.5, 0.5}, {0.1, 0.2, 0.7}, {0.0, 1.0}}) {
    auto a = AllocateEpoch(10, 0, 4, shares);
    ASSERT_THAT(a, IsOk());
    ASSERT_EQ(a->num_steps, 3);
    std::vector<std::vector<int64_t>> per_step(3);
    for (const WorkerAllocation& w : a->workers) {
      size_t k = 0;
      for (int step = 0; step < 3; ++step) {
        const int b = step == 2 ? w.final_batch_size : w.batch_size;
        if (b == 0) continue;
        ASSERT_LT(k, w.train.size());
        EXPECT_EQ(w.train[k].size(), b);
        for (int64_t i = w.train[k].begin; i < w.train[k].end; ++i) per_step[step].push_back(i);
        ++k;
      }
      EXPECT_EQ(k, w.train.size());
    }
    for (auto& v : per_step) std::sort(v.begin(), v.end());
    EXPECT_EQ(per_step[0], (std::vector<int64_t>{0, 1, 2, 3}));
    EXPECT_EQ(per_step[1], (std::vector<int64_t>{4, 5, 6, 7}));
    EXPECT_EQ(per_step[2], (std::vector<int64_t>{8, 9}));
  }
}

TEST(AllocateEpochTest, DatasetSmallerThanBatchIsOnePartialStep) {
  auto a = AllocateEpoch(10, 0, 64, {0.5, 0.5});
  ASSERT_THAT(a, IsOk());
  EXPECT_EQ(a->num_steps, 1);
  EXPECT_EQ(a->workers[0].final_batch_size + a->workers[1].final_batch_size, 10);
}

TEST(AllocateEpochTest, RejectsBadInput) {
  EXPECT_THAT(AllocateEpoch(0, 0, 64, {1.0}), StatusCodeIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(AllocateEpoch(10, 0, 0, {1.0}), StatusCodeIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(AllocateEpoch(10, 0, 8, {}), StatusCodeIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(AllocateEpoch(10, 0, 8, {0.0, 0.0}),
              StatusCodeIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(AllocateEpoch(10, 0, 8, {-1.0, 2.0}),
              StatusCodeIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(AllocateEpoch(10, 0, 8, {std::nan(""), 1.0}),
              StatusCodeIs(absl::StatusCode::kInvalidArgument));
}

}  // namespace
}  // namespace dbs
