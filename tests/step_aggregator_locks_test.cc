// The step barrier's three locks: pushes from many threads at once give the sequential result
// bit for bit, and nothing waits for a step's model-sized work but what must.
#include <chrono>
#include <future>
#include <map>
#include <memory>
#include <thread>
#include <vector>

#include "absl/synchronization/notification.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/step_aggregator.h"
#include "tests/push_outcome.h"
#include "tests/status_matchers.h"

namespace dbs {
namespace {

constexpr int kWorkers = 4;
constexpr int kSteps = 24;
// Several of the reduction's windows, so that workers' sums interleave window by window.
constexpr size_t kModel = 40000;

// Worker w's gradient at `step`: large and small magnitudes mixed, so that the fp32 sum depends
// on the order of addition.
std::vector<float> Gradient(int w, int step) {
  std::vector<float> g(kModel);
  for (size_t i = 0; i < kModel; ++i) {
    g[i] = (w % 2 == 0 ? 1e6f : 1.0f) *
           (1.0f + 0.1f * static_cast<float>((w * 7 + i + step) % 11)) *
           (((w + i + step) % 3 == 0) ? -1.0f : 1.0f);
  }
  return g;
}

struct Job {
  ParameterStore store{std::make_unique<SgdOptimizer>(SgdConfig{1e-3, 0.9, 0.0, false})};
  std::unique_ptr<StepAggregator> agg;
  std::map<int, int> quota;

  Job() {
    EXPECT_THAT(
        store.Register({{"w", {static_cast<int64_t>(kModel)}}}, std::vector<float>(kModel, 0.0f)),
        IsOk());
    agg = std::make_unique<StepAggregator>(&store);
    for (int w = 0; w < kWorkers; ++w) quota[w] = 1 + w;
    agg->BeginEpoch(0, StepQuotas(kSteps, quota));
  }

  GradientPush PushOf(int w, int step, const std::vector<float>& g) {
    return GradientPush{w, 0, step, quota[w], 0.5 * (w + 1), g};
  }
};

TEST(StepAggregatorLocksTest, PushesFromManyThreadsGiveTheSequentialResultBitForBit) {
  Job sequential;
  for (int step = 0; step < kSteps; ++step) {
    std::vector<Outcome> outcomes(kWorkers);
    for (int w = 0; w < kWorkers; ++w) {
      sequential.agg->Push(sequential.PushOf(w, step, Gradient(w, step)), outcomes[w].callback());
    }
    for (const Outcome& o : outcomes) ASSERT_TRUE(o.result.has_value() && o.result->ok());
  }

  for (int round = 0; round < 3; ++round) {
    Job concurrent;
    std::vector<std::thread> workers;
    for (int w = 0; w < kWorkers; ++w) {
      workers.emplace_back([&concurrent, w] {
        for (int step = 0; step < kSteps; ++step) {
          const std::vector<float> g = Gradient(w, step);
          std::promise<absl::StatusOr<StepResult>> answer;
          std::future<absl::StatusOr<StepResult>> answered = answer.get_future();
          concurrent.agg->Push(
              concurrent.PushOf(w, step, g),
              [&answer](const absl::StatusOr<StepResult>& r) { answer.set_value(r); });
          const absl::StatusOr<StepResult> r = answered.get();
          ASSERT_THAT(r, IsOk());
          EXPECT_EQ(r->parameters.version, step + 1);
        }
      });
    }
    // Status reports read the barrier all along, as the liveness monitor and /metrics do.
    std::atomic<bool> done{false};
    std::thread reader([&] {
      while (!done.load()) {
        const StepProgress p = concurrent.agg->Progress();
        EXPECT_LE(p.pushed, kWorkers);
        concurrent.agg->LossOf(0);
      }
    });
    for (std::thread& t : workers) t.join();
    done = true;
    reader.join();
    EXPECT_EQ(*concurrent.store.Snapshot()->values, *sequential.store.Snapshot()->values)
        << "round " << round;
    const EpochLoss loss = concurrent.agg->LossOf(0);
    EXPECT_EQ(loss.steps_completed, kSteps);
    EXPECT_EQ(loss.samples, kSteps * (1 + 2 + 3 + 4));
    EXPECT_EQ(concurrent.agg->AcceptedPushes(0).size(), static_cast<size_t>(kSteps * kWorkers));
  }
}

// Holds the store's update at its start until released.
class HeldUpdate : public UpdateSink {
 public:
  void BeginUpdate(int64_t, std::shared_ptr<const ValueBuffer>) override {
    entered.Notify();
    release.WaitForNotification();
  }
  void WriteUpdate(size_t, absl::Span<const float>) override {}
  void EndUpdate(bool, const ParameterSnapshot&) override {}
  absl::Notification entered, release;
};

TEST(StepAggregatorLocksTest, StatusAndChecksDoNotWaitForAStepBeingApplied) {
  Job job;
  HeldUpdate held;
  job.store.SetUpdateSink(&held);
  std::vector<Outcome> outcomes(kWorkers);
  for (int w = 0; w + 1 < kWorkers; ++w) {
    job.agg->Push(job.PushOf(w, 0, Gradient(w, 0)), outcomes[w].callback());
  }
  const std::vector<float> last = Gradient(kWorkers - 1, 0);
  std::thread completer(
      [&] { job.agg->Push(job.PushOf(kWorkers - 1, 0, last), outcomes[kWorkers - 1].callback()); });
  held.entered.WaitForNotification();
  // The step is being applied (its update is held): what reads the barrier or the statistics
  // answers meanwhile.
  auto readers = std::async(std::launch::async, [&] {
    const StepProgress p = job.agg->Progress();
    EXPECT_EQ(p.step, 0);
    EXPECT_EQ(p.pushed, kWorkers);
    EXPECT_TRUE(p.waiting_for.empty());
    EXPECT_EQ(p.accepted_pushes, kWorkers);
    // A retry of a push of the step passes the header's checks; a push of the next step does
    // not yet.
    EXPECT_THAT(job.agg->Precheck(job.PushOf(0, 0, {})), IsOk());
    EXPECT_THAT(job.agg->Precheck(job.PushOf(0, 1, {})),
                StatusIs(absl::StatusCode::kFailedPrecondition, ::testing::_));
    EXPECT_EQ(job.agg->LossOf(0).steps_completed, 0);
    EXPECT_EQ(job.agg->AcceptedPushes(0).size(), static_cast<size_t>(kWorkers));
    EXPECT_EQ(job.agg->Quota(0, 1), job.quota);
  });
  const bool answered = readers.wait_for(std::chrono::seconds(30)) == std::future_status::ready;
  held.release.Notify();
  completer.join();
  EXPECT_TRUE(answered) << "a reader waited for the step's update";
  readers.wait();
  for (const Outcome& o : outcomes) {
    ASSERT_TRUE(o.result.has_value());
    ASSERT_THAT(*o.result, IsOk());
    EXPECT_EQ((*o.result)->parameters.version, 1);
  }
  // Taken after the step, the barrier's state and the parameters agree.
  const StepAggregator::State s = job.agg->SaveState();
  EXPECT_EQ(s.step, 1);
  EXPECT_EQ(s.store.version, 1);
  EXPECT_EQ(job.agg->LossOf(0).steps_completed, 1);
  job.store.RemoveUpdateSink(&held);
}

}  // namespace
}  // namespace dbs
