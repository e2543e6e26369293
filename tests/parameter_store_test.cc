#include "server/parameter_store.h"

#include <cmath>
#include <limits>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/status_matchers.h"

namespace dbs {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

// Records what an update hands to its sink.
class RecordingSink : public UpdateSink {
 public:
  void BeginUpdate(int64_t version, std::shared_ptr<const ValueBuffer> buffer) override {
    began.emplace_back(version, buffer->size());
    written.assign(buffer->size(), std::nanf(""));
    next = 0;
    after = std::move(buffer);
  }
  void WriteUpdate(size_t offset, absl::Span<const float> values) override {
    EXPECT_EQ(offset, next) << "blocks come in order, each once";
    EXPECT_EQ(values.data(), after->data() + offset) << "the values lie in the update's buffer";
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
  std::shared_ptr<const ValueBuffer> after;  // the update's buffer, held
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
  EXPECT_EQ(sink.after, snap->values) << "the buffer the sink held is the new snapshot";
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

// Three steps of an optimizer with state on a layout with a buffer; the sum in a buffer of its
// own, or `in_place` in the buffer reserved for the update's new values.
std::vector<float> ThreeSteps(std::unique_ptr<Optimizer> optimizer, RecordingSink* sink,
                              bool in_place) {
  const size_t n = 10000;
  ParameterStore store(std::move(optimizer));
  ModelLayout layout = {{"w", {4000}}, {"running_mean", {2000}, /*buffer=*/true}, {"b", {4000}}};
  std::vector<float> initial(n);
  for (size_t i = 0; i < n; ++i) initial[i] = 0.001f * static_cast<float>(i % 97);
  EXPECT_THAT(store.Register(layout, initial), IsOk());
  store.SetUpdateSink(sink);
  const std::vector<GradientScale> scales = {{5000, 0.25f}, {n, 0.5f}};
  for (int step = 0; step < 3; ++step) {
    std::vector<float> own(n);
    absl::Span<float> sum = absl::MakeSpan(own);
    if (in_place) {
      const absl::StatusOr<absl::Span<float>> next = store.ReserveNextBuffer();
      EXPECT_THAT(next, IsOk());
      if (!next.ok()) return {};
      sum = *next;
      EXPECT_NE(sum.data(), store.Snapshot()->values->data()) << "not the parameters served";
    }
    for (size_t i = 0; i < n; ++i) sum[i] = std::sin(0.01f * static_cast<float>(i * (step + 1)));
    const absl::StatusOr<ParameterSnapshot> snap = store.ApplyGradient(sum, scales);
    EXPECT_THAT(snap, IsOk());
    EXPECT_EQ(snap.ok() ? snap->version : -1, step + 1);
    if (in_place && snap.ok()) {
      EXPECT_EQ(snap->values->data(), sum.data()) << "the new values went where the sum lay";
    }
  }
  return *store.Snapshot()->values;
}

TEST(ParameterStoreTest, AnUpdateWithItsSumInTheNewValuesBufferIsBitIdentical) {
  for (int adam = 0; adam < 2; ++adam) {
    auto make = [adam]() -> std::unique_ptr<Optimizer> {
      if (adam) return std::make_unique<AdamOptimizer>(AdamConfig{0.01, 0.9, 0.999, 1e-8, 0.01});
      return std::make_unique<SgdOptimizer>(SgdConfig{0.1, 0.9, 1e-4, true});
    };
    RecordingSink own_sink, in_place_sink;
    const std::vector<float> own = ThreeSteps(make(), &own_sink, /*in_place=*/false);
    EXPECT_EQ(ThreeSteps(make(), &in_place_sink, /*in_place=*/true), own)
        << (adam ? "adam" : "sgd");
    EXPECT_EQ(in_place_sink.written, own_sink.written);
  }
}

TEST(ParameterStoreTest, TheNextBufferIsReservedUntilAnUpdateTakesIt) {
  auto store = SgdStore(1.0);
  EXPECT_THAT(store->ReserveNextBuffer(),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("no model")));
  ASSERT_THAT(store->Register({{"w", {4}}}, std::vector<float>{1, 2, 3, 4}), IsOk());
  const ParameterSnapshot held = *store->Snapshot();  // a reader still holds version 0
  absl::StatusOr<absl::Span<float>> next = store->ReserveNextBuffer();
  ASSERT_THAT(next, IsOk());
  EXPECT_EQ(next->size(), 4u);
  EXPECT_NE(next->data(), held.values->data());
  EXPECT_EQ(store->ReserveNextBuffer()->data(), next->data()) << "the same until it is taken";
  // An update in a buffer of its own (a sum elsewhere) still takes the reserved one.
  std::vector<float> sum = {1, 1, 1, 1};
  const std::vector<GradientScale> scales = {{4, 1.0f}};
  absl::StatusOr<ParameterSnapshot> v1 = store->ApplyGradient(absl::MakeSpan(sum), scales);
  ASSERT_THAT(v1, IsOk());
  EXPECT_EQ(v1->values->data(), next->data());
  EXPECT_THAT(*v1->values, ElementsAre(0.0f, 1.0f, 2.0f, 3.0f));
  EXPECT_THAT(sum, ElementsAre(0.0f, 0.0f, 0.0f, 0.0f)) << "a sum of its own is left zeroed";
  EXPECT_THAT(*held.values, ElementsAre(1.0f, 2.0f, 3.0f, 4.0f)) << "what a reader holds stays";
  // Neither the parameters served nor a buffer a reader holds is reserved next.
  next = store->ReserveNextBuffer();
  ASSERT_THAT(next, IsOk());
  EXPECT_NE(next->data(), v1->values->data());
  EXPECT_NE(next->data(), held.values->data());
  // A restored checkpoint drops the reservation: what is reserved after it is not the values.
  StoreState state = store->SaveState();
  ASSERT_THAT(store->LoadState(state), IsOk());
  next = store->ReserveNextBuffer();
  ASSERT_THAT(next, IsOk());
  EXPECT_NE(next->data(), store->Snapshot()->values->data());
}

// Two buffers of its own, with what the store told about them, in order: "w<i>" (buffer i is
// about to be written) and "p<i>:<version>" (it holds that version).
class RecordingMemory : public SnapshotMemory {
 public:
  std::array<std::shared_ptr<ValueBuffer>, 2> CreateSnapshotBuffers(size_t count) override {
    ++created;
    if (refuse) return {};
    std::array<std::shared_ptr<ValueBuffer>, 2> buffers;  // the store's alone
    for (int i = 0; i < 2; ++i) {
      memory[i] = std::make_shared<std::vector<float>>(count);
      buffers[i] = std::make_shared<ValueBuffer>(memory[i]->data(), count, memory[i]);
    }
    return buffers;
  }
  void SnapshotWriting(int index) override { told.push_back("w" + std::to_string(index)); }
  void SnapshotPublished(int index, int64_t version) override {
    told.push_back("p" + std::to_string(index) + ":" + std::to_string(version));
  }
  const float* at(int i) const { return memory[i]->data(); }
  bool refuse = false;
  int created = 0;
  std::shared_ptr<std::vector<float>> memory[2];
  std::vector<std::string> told;
};

// With snapshot memory the version v lies in its buffer v % 2, marked as written before and
// published after; a buffer someone still holds is not written (that version goes to the heap,
// unpublished), and the next free one is used again.
TEST(ParameterStoreTest, SnapshotsLieInTheGivenBuffersByVersionWhenFree) {
  auto store = SgdStore(1.0);
  RecordingMemory memory;
  store->SetSnapshotMemory(&memory);
  ASSERT_THAT(store->Register({{"w", {4}}}, std::vector<float>{1, 2, 3, 4}), IsOk());
  EXPECT_EQ(memory.created, 1);
  EXPECT_EQ(store->Snapshot()->values->data(), memory.at(0));
  EXPECT_THAT(memory.told, ElementsAre("w0", "p0:0"));
  memory.told.clear();
  const std::vector<GradientScale> scales = {{4, 1.0f}};
  // The step's sum lies in the next version's buffer, reserved (and so marked) at once.
  absl::StatusOr<absl::Span<float>> next = store->ReserveNextBuffer();
  ASSERT_THAT(next, IsOk());
  EXPECT_EQ(next->data(), memory.at(1));
  EXPECT_THAT(memory.told, ElementsAre("w1"));
  std::fill(next->begin(), next->end(), 1.0f);
  absl::StatusOr<ParameterSnapshot> v1 = store->ApplyGradient(*next, scales);
  ASSERT_THAT(v1, IsOk());
  EXPECT_EQ(v1->values->data(), memory.at(1));
  EXPECT_THAT(*v1->values, ElementsAre(0.0f, 1.0f, 2.0f, 3.0f));
  EXPECT_THAT(memory.told, ElementsAre("w1", "p1:1"));
  memory.told.clear();
  // Version 2 goes where version 0 was, nobody holding it.
  std::vector<float> sum = {1, 1, 1, 1};
  absl::StatusOr<ParameterSnapshot> v2 = store->ApplyGradient(absl::MakeSpan(sum), scales);
  ASSERT_THAT(v2, IsOk());
  EXPECT_EQ(v2->values->data(), memory.at(0));
  EXPECT_THAT(memory.told, ElementsAre("w0", "p0:2"));
  memory.told.clear();
  // A reader still holds version 1: version 3 lies on the heap and its buffer is left alone.
  ParameterSnapshot held = *v1;
  v1 = absl::StatusOr<ParameterSnapshot>();
  sum = {1, 1, 1, 1};
  absl::StatusOr<ParameterSnapshot> v3 = store->ApplyGradient(absl::MakeSpan(sum), scales);
  ASSERT_THAT(v3, IsOk());
  EXPECT_TRUE(v3->values->owns_memory());
  EXPECT_THAT(*v3->values, ElementsAre(-2.0f, -1.0f, 0.0f, 1.0f));
  EXPECT_THAT(*held.values, ElementsAre(0.0f, 1.0f, 2.0f, 3.0f)) << "what a reader holds stays";
  EXPECT_TRUE(memory.told.empty());
  // Version 4 is in buffer 0 again (version 2 is nobody's any more).
  v2 = absl::StatusOr<ParameterSnapshot>();
  sum = {1, 1, 1, 1};
  absl::StatusOr<ParameterSnapshot> v4 = store->ApplyGradient(absl::MakeSpan(sum), scales);
  ASSERT_THAT(v4, IsOk());
  EXPECT_EQ(v4->values->data(), memory.at(0));
  EXPECT_THAT(memory.told, ElementsAre("w0", "p0:4"));
  memory.told.clear();
  // An update that fails leaves its buffer marked written, never published.
  held = ParameterSnapshot{};
  sum = {std::numeric_limits<float>::infinity(), 0, 0, 0};
  v3 = absl::StatusOr<ParameterSnapshot>();
  EXPECT_THAT(store->ApplyGradient(absl::MakeSpan(sum), scales),
              StatusIs(absl::StatusCode::kDataLoss, ::testing::_));
  EXPECT_THAT(memory.told, ElementsAre("w1"));
  memory.told.clear();
  // A restored checkpoint lies in its version's buffer too (version 7: buffer 1).
  StoreState state = store->SaveState();
  state.version = 7;
  ASSERT_THAT(store->LoadState(state), IsOk());
  EXPECT_EQ(store->Snapshot()->values->data(), memory.at(1));
  EXPECT_THAT(*store->Snapshot()->values, ElementsAre(-3.0f, -2.0f, -1.0f, 0.0f));
  EXPECT_THAT(memory.told, ElementsAre("w1", "p1:7"));
  EXPECT_EQ(memory.created, 1) << "the same model size keeps the same buffers";
}

// Memory that gives no buffers leaves the snapshots on the heap, asked once per model size.
TEST(ParameterStoreTest, SnapshotMemoryThatGivesNoneLeavesTheHeap) {
  auto store = SgdStore(1.0);
  RecordingMemory memory;
  memory.refuse = true;
  store->SetSnapshotMemory(&memory);
  ASSERT_THAT(store->Register({{"w", {4}}}, std::vector<float>{1, 2, 3, 4}), IsOk());
  std::vector<float> sum = {1, 1, 1, 1};
  const std::vector<GradientScale> scales = {{4, 1.0f}};
  for (int i = 0; i < 3; ++i) {
    sum = {1, 1, 1, 1};
    ASSERT_THAT(store->ApplyGradient(absl::MakeSpan(sum), scales), IsOk());
  }
  EXPECT_TRUE(store->Snapshot()->values->owns_memory());
  EXPECT_THAT(*store->Snapshot()->values, ElementsAre(-2.0f, -1.0f, 0.0f, 1.0f));
  EXPECT_EQ(memory.created, 1);
  EXPECT_TRUE(memory.told.empty());
}

}  // namespace
}  // namespace dbs
