#include "worker/micro_batch.h"

#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/status_matchers.h"

namespace dbs {
namespace {

using ::testing::ElementsAre;

TEST(MicroBatchTest, CountsTheMicroBatchesABatchTakes) {
  EXPECT_EQ(MicroBatches(10, 0), 1) << "no limit";
  EXPECT_EQ(MicroBatches(10, 10), 1);
  EXPECT_EQ(MicroBatches(10, 4), 3);
  EXPECT_EQ(MicroBatches(11, 1), 11);
}

// A model of two trained values and one buffer. A micro-batch's "gradient" is the mean of its
// sample indices and of their squares; the buffer counts the micro-batches seen (like BatchNorm's
// running statistics, it changes with every forward pass).
class Recorder {
 public:
  absl::StatusOr<double> Compute(absl::Span<const int64_t> indices, absl::Span<float> grad) {
    if (fail_at_ == static_cast<int>(sizes_.size())) return absl::FailedPreconditionError("no");
    sizes_.push_back(static_cast<int>(indices.size()));
    double sum = 0.0, squares = 0.0;
    for (int64_t i : indices) {
      sum += i;
      squares += static_cast<double>(i) * i;
    }
    grad[0] = static_cast<float>(sum / indices.size());
    grad[1] = static_cast<float>(squares / indices.size());
    grad[2] = static_cast<float>(sizes_.size());
    return sum;
  }
  ComputeFn fn() {
    return [this](absl::Span<const int64_t> i, absl::Span<float> g) { return Compute(i, g); };
  }
  std::vector<int> sizes_;
  int fail_at_ = -1;
};

const ModelLayout kLayout = {{"w", {2}}, {"running_mean", {1}, /*buffer=*/true}};

TEST(MicroBatchTest, TheMeanOfTheMicroBatchesIsTheWholeBatchsMean) {
  std::vector<int64_t> indices;
  for (int64_t i = 0; i < 10; ++i) indices.push_back(i);
  Recorder r;
  std::vector<float> grad(3), scratch;
  absl::StatusOr<double> loss =
      ComputeInMicroBatches(kLayout, indices, 4, r.fn(), absl::MakeSpan(grad), &scratch);
  ASSERT_THAT(loss, IsOk());
  EXPECT_THAT(r.sizes_, ElementsAre(4, 3, 3)) << "sizes differ by at most one";
  EXPECT_EQ(*loss, 45.0) << "the summed loss of every sample";
  EXPECT_FLOAT_EQ(grad[0], 4.5f);   // mean of 0..9
  EXPECT_FLOAT_EQ(grad[1], 28.5f);  // mean of their squares
  EXPECT_EQ(grad[2], 3.0f) << "a buffer keeps the last micro-batch's value";
}

TEST(MicroBatchTest, ABatchWithinTheLimitIsOneCall) {
  const std::vector<int64_t> indices = {3, 5};
  Recorder r;
  std::vector<float> grad(3), scratch;
  ASSERT_THAT(ComputeInMicroBatches(kLayout, indices, 0, r.fn(), absl::MakeSpan(grad), &scratch),
              IsOk());
  EXPECT_THAT(r.sizes_, ElementsAre(2));
  EXPECT_FLOAT_EQ(grad[0], 4.0f);
  EXPECT_TRUE(scratch.empty()) << "no second buffer is needed";
}

TEST(MicroBatchTest, AFailingMicroBatchFailsTheBatch) {
  const std::vector<int64_t> indices = {0, 1, 2, 3};
  Recorder r;
  r.fail_at_ = 1;
  std::vector<float> grad(3), scratch;
  EXPECT_THAT(ComputeInMicroBatches(kLayout, indices, 2, r.fn(), absl::MakeSpan(grad), &scratch),
              StatusCodeIs(absl::StatusCode::kFailedPrecondition));
}

}  // namespace
}  // namespace dbs
