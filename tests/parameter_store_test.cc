#include "server/parameter_store.h"

#include <cmath>
#include <limits>
#include <memory>
#include <utility>
#include <vector>

#include "common/status_matchers.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace dbs {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

// Records what an update hands to its sink.
class RecordingSink : public UpdateSink {
 public:
  void BeginUpdate(int64_t version, size_t count) override {
    began.emplace_back(version, count);
    written.assign(count, std::nanf(""));
    next = 0;
  }
  void WriteUpdate(size_t offset, absl::Span<const float> values) override {
    EXPECT_EQ(offset, next) << "blocks come in order, each once";
    std::copy(values.begin(), values.end(), written.begin() + offset);
    next = offset + values.size();
  }
  void EndUpdate(bool ok, const ParameterSnapshot& snapshot) override {
    ended.push_back(ok);
    last = snapshot;
  }
  std::vector<std::pair<int64_t, size_t>> began;
  std::vector<float> written;
  size_t next = 0;
  std::vector<bool> ended;
  ParameterSnapshot last;
};

std::unique_ptr<ParameterStore> SgdStore(double lr) {
  return std::make_unique<ParameterStore>(
      std::make_unique<SgdOptimizer>(SgdConfig{lr, 0.0, 0.0, false}));
}

TEST(ParameterStoreTest, TheUpdateScalesPerRangeClearsTheSumAndFeedsTheSink) {
  // 10,000 values: several blocks; a buffer tensor across a block boundary.
  const size_t n = 10000;
  auto store = SgdStore(1.0);
  ModelLayout layout = {{"w", {4000}}, {"running_mean", {2000}, /*buffer=*/true}, {"b", {4000}}};
  ASSERT_THAT(store->Register(layout, std::vector<float>(n, 1.0f)), IsOk());
  RecordingSink sink;
  store->SetUpdateSink(&sink);
  std::vector<float> sum(n, 8.0f);
  // Values before 5000 summed over 4 samples, the rest over 2.
  const std::vector<GradientScale> scales = {{5000, 0.25f}, {n, 0.5f}};
  absl::StatusOr<ParameterSnapshot> snap = store->ApplyGradient(absl::MakeSpan(sum), scales);
  ASSERT_THAT(snap, IsOk());
  EXPECT_EQ(snap->version, 1);
  for (size_t i = 0; i < n; ++i) {
    const float mean = i < 5000 ? 2.0f : 4.0f;
    const bool buffer = i >= 4000 && i < 6000;
    ASSERT_EQ((*snap->values)[i], buffer ? mean : 1.0f - mean) << i;
    ASSERT_EQ(sum[i], 0.0f) << "the sum is cleared for the next step";
  }
  ASSERT_EQ(sink.began.size(), 1u);
  EXPECT_EQ(sink.began[0], std::make_pair(int64_t{1}, n));
  EXPECT_EQ(sink.next, n);
  EXPECT_EQ(sink.written, *snap->values);
  EXPECT_THAT(sink.ended, ElementsAre(true));
  EXPECT_EQ(sink.last.values, snap->values);
  // Removed, it hears nothing more; another sink is not removed by it.
  store->RemoveUpdateSink(&sink);
  std::vector<float> zero(n, 0.0f);
  ASSERT_THAT(store->ApplyGradient(absl::MakeSpan(zero), scales), IsOk());
  EXPECT_EQ(sink.began.size(), 1u);
}

TEST(ParameterStoreTest, AnUpdateThatOverflowsChangesNothingAndVoidsTheSinksValues) {
  auto store = SgdStore(1e30);
  ASSERT_THAT(store->Register({{"w", {3}}}, std::vector<float>{1.0f, 2.0f, 3.0f}), IsOk());
  RecordingSink sink;
  store->SetUpdateSink(&sink);
  std::vector<float> sum = {0.0f, 1e30f, 0.0f};
  const std::vector<GradientScale> scales = {{3, 1.0f}};
  EXPECT_THAT(store->ApplyGradient(absl::MakeSpan(sum), scales),
              StatusIs(absl::StatusCode::kDataLoss, HasSubstr("made element 1 non-finite")));
  EXPECT_THAT(*store->Snapshot()->values, ElementsAre(1.0f, 2.0f, 3.0f));
  EXPECT_EQ(store->Snapshot()->version, 0);
  EXPECT_THAT(sink.ended, ElementsAre(false));
}

}  // namespace
}  // namespace dbs
