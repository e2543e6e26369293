#include "server/step_aggregator.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <deque>
#include <limits>
#include <map>
#include <memory>
#include <optional>
#include <random>
#include <set>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/clock.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/push_outcome.h"
#include "tests/status_matchers.h"

namespace dbs {
namespace {

using ::testing::ElementsAre;
using ::testing::FloatNear;
using ::testing::HasSubstr;

class StepAggregatorTest : public ::testing::Test {
 protected:
  void SetUp() override {
    // Plain SGD with lr 1 so the update equals the aggregated gradient: p' = p - g.
    store_ = std::make_unique<ParameterStore>(
        std::make_unique<SgdOptimizer>(SgdConfig{1.0, 0.0, 0.0, false}));
    ASSERT_THAT(store_->Register({{"w", {2}}}, std::vector<float>{0.0f, 0.0f}), IsOk());
    agg_ = std::make_unique<StepAggregator>(store_.get());
    // Worker 0: batch 1 (final 1); worker 1: batch 3 (final 0); two steps.
    agg_->BeginEpoch(0, {{{0, 1}, {1, 3}}, {{0, 1}, {1, 0}}});
  }

  GradientPush Push(int worker, int step, int n, const std::vector<float>& g, double loss = 0) {
    grads_.push_back(g);
    GradientPush p;
    p.worker_id = worker;
    p.epoch = 0;
    p.step = step;
    p.num_samples = n;
    p.loss_sum = loss;
    p.gradient = grads_.back();
    return p;
  }

  std::vector<float> Params() { return *store_->Snapshot()->values; }

  std::unique_ptr<ParameterStore> store_;
  std::unique_ptr<StepAggregator> agg_;
  std::vector<std::vector<float>> grads_{};

  void TearDown() override {}
};

TEST_F(StepAggregatorTest, WeightsEachGradientBySampleCount) {
  grads_.reserve(16);
  Outcome a, b;
  agg_->Push(Push(0, 0, 1, {4.0f, 0.0f}, 2.0), a.callback());
  EXPECT_FALSE(a.result.has_value()) << "must wait for worker 1";
  agg_->Push(Push(1, 0, 3, {0.0f, 8.0f}, 6.0), b.callback());
  ASSERT_TRUE(a.result.has_value() && b.result.has_value());
  ASSERT_TRUE(a.result->ok());
  // g = (1 * [4, 0] + 3 * [0, 8]) / 4 = [1, 6]; p = -g.
  EXPECT_THAT(Params(), ElementsAre(FloatNear(-1.0f, 1e-6), FloatNear(-6.0f, 1e-6)));
  EXPECT_EQ((*a.result)->global_samples, 4);
  EXPECT_DOUBLE_EQ((*a.result)->global_loss, 2.0);  // (2 + 6) / 4
  EXPECT_EQ((*a.result)->parameters.version, 1);
  EXPECT_EQ((*b.result)->parameters.values, (*a.result)->parameters.values);
}

TEST_F(StepAggregatorTest, ZeroSampleWorkerStillSynchronisesButAddsNothing) {
  grads_.reserve(16);
  Outcome a, b, c, d;
  agg_->Push(Push(0, 0, 1, {1.0f, 1.0f}), a.callback());
  agg_->Push(Push(1, 0, 3, {1.0f, 1.0f}), b.callback());
  // Last step: worker 1 has a final batch of 0 and pushes no gradient.
  GradientPush empty = Push(1, 1, 0, {});
  agg_->Push(empty, c.callback());
  EXPECT_FALSE(c.result.has_value());
  agg_->Push(Push(0, 1, 1, {2.0f, -2.0f}), d.callback());
  ASSERT_TRUE(d.result.has_value() && d.result->ok());
  EXPECT_EQ((*d.result)->global_samples, 1);
  EXPECT_THAT(Params(), ElementsAre(FloatNear(-3.0f, 1e-6), FloatNear(1.0f, 1e-6)));
  EXPECT_EQ(agg_->LossOf(0).steps_completed, 2);
  EXPECT_EQ(agg_->LossOf(0).samples, 5);
}

TEST_F(StepAggregatorTest, BadPushesChangeNothing) {
  grads_.reserve(16);
  Outcome unknown, stale, future, wrong_count, wrong_size;
  agg_->Push(Push(7, 0, 1, {1.0f, 1.0f}), unknown.callback());
  EXPECT_THAT(unknown.result->status(), StatusCodeIs(absl::StatusCode::kNotFound));
  agg_->Push(Push(0, 1, 1, {1.0f, 1.0f}), future.callback());
  EXPECT_THAT(future.result->status(), StatusCodeIs(absl::StatusCode::kFailedPrecondition));
  agg_->Push(Push(0, 0, 2, {1.0f, 1.0f}), wrong_count.callback());
  EXPECT_THAT(wrong_count.result->status(), StatusCodeIs(absl::StatusCode::kInvalidArgument));
  agg_->Push(Push(0, 0, 1, {1.0f, 1.0f, 1.0f}), wrong_size.callback());
  EXPECT_THAT(wrong_size.result->status(), StatusCodeIs(absl::StatusCode::kInvalidArgument));
  GradientPush old_epoch = Push(0, 0, 1, {1.0f, 1.0f});
  old_epoch.epoch = -1;
  agg_->Push(old_epoch, stale.callback());
  EXPECT_THAT(stale.result->status(), StatusCodeIs(absl::StatusCode::kFailedPrecondition));

  // The step is untouched: a correct round gives exactly the expected update.
  Outcome a, b;
  agg_->Push(Push(0, 0, 1, {4.0f, 0.0f}), a.callback());
  agg_->Push(Push(1, 0, 3, {0.0f, 8.0f}), b.callback());
  ASSERT_TRUE(b.result->ok());
  EXPECT_THAT(Params(), ElementsAre(FloatNear(-1.0f, 1e-6), FloatNear(-6.0f, 1e-6)));
}

TEST_F(StepAggregatorTest, AWholePushWithABadValueIsRefusedAtOnceEvenBeforeItsTurn) {
  // Its values are checked before the lock, and only there: the sum does not check them again.
  // Worker 1's push would be held for worker 0's (the sum goes in worker order), but a bad
  // value refuses it on arrival.
  grads_.reserve(16);
  Outcome bad;
  agg_->Push(Push(1, 0, 3, {1.0f, std::numeric_limits<float>::quiet_NaN()}), bad.callback());
  ASSERT_TRUE(bad.result.has_value()) << "refused at once, not held for its turn";
  EXPECT_THAT(bad.result->status(), StatusIs(absl::StatusCode::kInvalidArgument,
                                             HasSubstr("worker 1's element 1 is nan")));
  Outcome a, b;
  agg_->Push(Push(0, 0, 1, {4.0f, 0.0f}), a.callback());
  agg_->Push(Push(1, 0, 3, {0.0f, 8.0f}), b.callback());
  ASSERT_TRUE(b.result.has_value());
  ASSERT_THAT(*b.result, IsOk());
  EXPECT_THAT(Params(), ElementsAre(FloatNear(-1.0f, 1e-6), FloatNear(-6.0f, 1e-6)));
}

// A gradient in the worker's shared memory can change after it was checked, while it is held
// for its turn: what is summed is what was checked (each value read once), a value that went
// bad refuses that push when the step completes, and the step completes for everyone else.
TEST_F(StepAggregatorTest, AGradientInSharedMemoryThatGoesBadAfterItsCheckIsRefusedNotSummed) {
  grads_.reserve(16);
  // Unchanged, it is summed as a received one is: p' = -(1 * (4, 0) + 3 * (0, 8)) / 4.
  std::vector<float> region = {0.0f, 8.0f};
  Outcome a, b;
  GradientPush from_region = Push(1, 0, 3, {});
  from_region.gradient = SharedRegion(&region);
  agg_->Push(from_region, b.callback());
  agg_->Push(Push(0, 0, 1, {4.0f, 0.0f}), a.callback());
  ASSERT_TRUE(a.result.has_value() && b.result.has_value());
  ASSERT_THAT(*b.result, IsOk());
  EXPECT_THAT(Params(), ElementsAre(FloatNear(-1.0f, 1e-6), FloatNear(-6.0f, 1e-6)));
  // Step 1 (worker 1 has no samples in it), then epoch 1: worker 1 pushes first and is held.
  Outcome c, d;
  agg_->Push(Push(0, 1, 1, {0.0f, 0.0f}), c.callback());
  agg_->Push(Push(1, 1, 0, {}), d.callback());
  ASSERT_THAT(*d.result, IsOk());
  agg_->BeginEpoch(1, {{{0, 1}, {1, 3}}});
  Outcome held, other;
  from_region.epoch = 1;
  agg_->Push(from_region, held.callback());
  EXPECT_FALSE(held.result.has_value()) << "checked and held for worker 0's push";
  region[1] = std::numeric_limits<float>::quiet_NaN();
  region[0] = 1e38f;
  GradientPush first = Push(0, 0, 1, {4.0f, 0.0f});
  first.epoch = 1;
  agg_->Push(first, other.callback());
  ASSERT_TRUE(other.result.has_value() && held.result.has_value());
  EXPECT_THAT(*other.result, IsOk()) << "the step completes for the others";
  EXPECT_THAT(held.result->status(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("changed after it was")));
  for (float p : Params()) EXPECT_TRUE(std::isfinite(p)) << p;
  EXPECT_THAT(Params(), ElementsAre(FloatNear(-2.0f, 1e-6), FloatNear(-6.0f, 1e-6)))
      << "worker 1's values were left out, its samples still count in the mean";
}

// A rewrite to other values within the bound is caught too: each block's sum of squares must be
// the one that was checked (and screened), so what is summed has the screened norm at most.
// Values that keep every block's squares (a sign flip, values swapped) are what the worker
// could have pushed in the first place, and are summed.
TEST_F(StepAggregatorTest, AFiniteRewriteOfASharedGradientIsRefusedOneWithTheSameSquaresSummed) {
  std::vector<float> region = {0.0f, 8.0f};
  GradientPush from_region = Push(1, 0, 3, {});
  from_region.gradient = SharedRegion(&region);
  Outcome held, other;
  agg_->Push(from_region, held.callback());
  ASSERT_FALSE(held.result.has_value()) << "held for worker 0's push";
  region[1] = 8000.0f;
  agg_->Push(Push(0, 0, 1, {4.0f, 0.0f}), other.callback());
  ASSERT_TRUE(other.result.has_value() && held.result.has_value());
  EXPECT_THAT(*other.result, IsOk());
  EXPECT_THAT(held.result->status(),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("worker 1's elements 0 to 1 changed after they were checked "
                                 "(their sum of squares 6.4e+07, checked 64)")));
  EXPECT_THAT(Params(), ElementsAre(FloatNear(-1.0f, 1e-6), FloatNear(0.0f, 1e-6)))
      << "only worker 0's values";

  Outcome d, e, flipped, first;
  agg_->Push(Push(0, 1, 1, {0.0f, 0.0f}), d.callback());
  agg_->Push(Push(1, 1, 0, {}), e.callback());
  ASSERT_THAT(*e.result, IsOk());
  agg_->BeginEpoch(1, {{{0, 1}, {1, 3}}});
  region = {0.0f, 8.0f};
  from_region.epoch = 1;
  agg_->Push(from_region, flipped.callback());
  region = {-8.0f, 0.0f};
  GradientPush zero = Push(0, 0, 1, {0.0f, 0.0f});
  zero.epoch = 1;
  agg_->Push(zero, first.callback());
  ASSERT_TRUE(flipped.result.has_value());
  EXPECT_THAT(*flipped.result, IsOk());
  EXPECT_THAT(Params(), ElementsAre(FloatNear(5.0f, 1e-6), FloatNear(0.0f, 1e-6)))
      << "-1 - 3 * (-8) / 4";
}

// A faulty GPU's push (StepAggregator's screen). A norm far above the job's recent ones is held
// until the step's other pushes are in: one worker's outlier is faulty (kEvict: not summed, its
// worker handed to the hook, which removes it, and its push refused; kLog: reported and summed),
// a spike every worker shares is summed. A value no GPU computes is faulty at once.
class ScreenTest : public ::testing::TestWithParam<FaultyGradients> {
 protected:
  void SetUp() override {
    ASSERT_THAT(store_.Register({{"w", {2}}}, std::vector<float>{0.0f, 0.0f}), IsOk());
    AggregatorOptions options;
    options.screen.mode = GetParam();
    options.screen.min_history = 4;
    agg_ = std::make_unique<StepAggregator>(&store_, nullptr, options);
    agg_->SetFaultyHook([this](const FaultyPush& f) { faulty_.push_back(f); });
    // Workers 0 and 1, batch 1 each, six steps; steps 0 and 1 make the history (norms 5).
    agg_->BeginEpoch(0, StepQuotas(6, {{0, 1}, {1, 1}}));
    grads_.reserve(32);
    for (int step = 0; step < 2; ++step) {
      Outcome a, b;
      Push(0, step, {3.0f, 4.0f}, &a);
      Push(1, step, {4.0f, 3.0f}, &b);
      ASSERT_THAT(*b.result, IsOk());
    }
  }
  void Push(int worker, int step, std::vector<float> g, Outcome* out) {
    grads_.push_back(std::move(g));
    agg_->Push(GradientPush{worker, 0, step, 1, 0.0, grads_.back()}, out->callback());
  }

  std::vector<float> Params() { return *store_.Snapshot()->values; }

  ParameterStore store_{std::make_unique<SgdOptimizer>(SgdConfig{1.0, 0.0, 0.0, false})};
  std::unique_ptr<StepAggregator> agg_;
  std::vector<FaultyPush> faulty_;
  std::vector<std::vector<float>> grads_;
};

TEST_P(ScreenTest, OneWorkersOutlierIsFaulty) {
  Outcome a, b;
  Push(1, 2, {4000.0f, 3000.0f}, &b);  // 1000 times the others'
  EXPECT_FALSE(b.result.has_value()) << "held for the step's other pushes";
  EXPECT_TRUE(faulty_.empty());
  Push(0, 2, {3.0f, 4.0f}, &a);
  ASSERT_EQ(faulty_.size(), 1u);
  EXPECT_EQ(faulty_[0].worker_id, 1);
  EXPECT_EQ(faulty_[0].step, 2);
  EXPECT_THAT(faulty_[0].why.message(), HasSubstr("1000 times the median 5 of the other 1"));
  if (GetParam() == FaultyGradients::kEvict) {
    EXPECT_TRUE(faulty_[0].quarantine);
    ASSERT_TRUE(b.result.has_value());
    EXPECT_THAT(b.result->status(),
                StatusIs(absl::StatusCode::kAborted, HasSubstr("worker 1 is quarantined")));
    EXPECT_FALSE(a.result.has_value()) << "the step waits for worker 1's removal";
    EXPECT_THAT(agg_->Progress().waiting_for, ElementsAre(1));
    ASSERT_TRUE(agg_->Evict(0, 2, {1}));
    agg_->CompleteEviction(PlanChange{StepQuotas(3, {{0, 2}}), {}});
    ASSERT_TRUE(a.result.has_value());
    ASSERT_THAT(*a.result, IsOk());
    EXPECT_THAT(Params(), ElementsAre(FloatNear(-10.0f, 1e-5), FloatNear(-11.0f, 1e-5)))
        << "steps 0 and 1 moved both by 7; step 2 is worker 0's gradient alone";
  } else {
    EXPECT_FALSE(faulty_[0].quarantine);
    ASSERT_TRUE(a.result.has_value() && b.result.has_value());
    EXPECT_THAT(*b.result, IsOk()) << "summed";
  }
}

// A push whose values in shared memory changed after their check is refused as it is summed,
// and under kEvict its worker is handed to the hook once the step completes, to be removed
// from the next step (its push of this step was counted).
TEST_P(ScreenTest, AWorkerWhoseSharedGradientChangedAfterItsCheckIsQuarantinedFromTheNextStep) {
  std::vector<float> region = {4.0f, 3.0f};
  Outcome a, b;
  agg_->Push(GradientPush{1, 0, 2, 1, 0.0, SharedRegion(&region)}, b.callback());
  region = {400.0f, 300.0f};
  Push(0, 2, {3.0f, 4.0f}, &a);
  ASSERT_TRUE(a.result.has_value() && b.result.has_value());
  EXPECT_THAT(*a.result, IsOk()) << "the step completes with worker 0's values";
  EXPECT_THAT(Params(), ElementsAre(FloatNear(-8.5f, 1e-5), FloatNear(-9.0f, 1e-5)))
      << "steps 0 and 1 moved both by 7; step 2 by worker 0's gradient over 2 samples";
  if (GetParam() == FaultyGradients::kEvict) {
    EXPECT_THAT(b.result->status(),
                StatusIs(absl::StatusCode::kAborted, HasSubstr("worker 1 is quarantined")));
    ASSERT_EQ(faulty_.size(), 1u);
    EXPECT_EQ(faulty_[0].worker_id, 1);
    EXPECT_TRUE(faulty_[0].quarantine);
    EXPECT_TRUE(faulty_[0].counted);
    EXPECT_EQ(faulty_[0].step, 2);
    EXPECT_EQ(faulty_[0].removal_step(), 3);
    EXPECT_THAT(agg_->Progress().waiting_for, ElementsAre(0, 1)) << "step 3 waits for it";
  } else {
    EXPECT_THAT(b.result->status(), StatusIs(absl::StatusCode::kInvalidArgument,
                                             HasSubstr("changed after they were checked")));
    EXPECT_TRUE(faulty_.empty()) << "refused, not quarantined";
  }
}

TEST_P(ScreenTest, ASpikeEveryWorkerSharesIsSummed) {
  Outcome a, b;
  Push(0, 2, {3000.0f, 4000.0f}, &a);
  Push(1, 2, {4000.0f, 3000.0f}, &b);
  ASSERT_TRUE(a.result.has_value() && b.result.has_value());
  EXPECT_THAT(*a.result, IsOk());
  EXPECT_THAT(*b.result, IsOk());
  EXPECT_TRUE(faulty_.empty());
}

TEST_P(ScreenTest, AValueNoGpuComputesIsFaultyAtOnce) {
  Outcome c;
  Push(1, 2, {std::numeric_limits<float>::quiet_NaN(), 1.0f}, &c);
  ASSERT_TRUE(c.result.has_value());
  if (GetParam() == FaultyGradients::kEvict) {
    ASSERT_EQ(faulty_.size(), 1u);
    EXPECT_THAT(faulty_[0].why.message(), HasSubstr("is nan"));
    EXPECT_THAT(c.result->status(), StatusIs(absl::StatusCode::kAborted, HasSubstr("")));
  } else {  // refused as a malformed push, the worker kept
    EXPECT_TRUE(faulty_.empty());
    EXPECT_THAT(c.result->status(), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("")));
  }
}

INSTANTIATE_TEST_SUITE_P(Modes, ScreenTest,
                         ::testing::Values(FaultyGradients::kEvict, FaultyGradients::kLog),
                         [](const auto& info) {
                           return std::string(FaultyGradientsName(info.param));
                         });

TEST_F(StepAggregatorTest, DuplicatePushIsNotCountedTwice) {
  grads_.reserve(16);
  Outcome a, a_again, b, b_late_retry;
  agg_->Push(Push(0, 0, 1, {4.0f, 0.0f}), a.callback());
  agg_->Push(Push(0, 0, 1, {400.0f, 0.0f}), a_again.callback());  // retry while pending
  EXPECT_FALSE(a_again.result.has_value());
  // The retry took the first call's place: one waiting answer per worker, however many retries.
  ASSERT_TRUE(a.result.has_value());
  EXPECT_THAT(a.result->status(), StatusCodeIs(absl::StatusCode::kAborted));
  agg_->Push(Push(1, 0, 3, {0.0f, 8.0f}), b.callback());
  ASSERT_TRUE(a_again.result->ok() && b.result->ok());
  EXPECT_THAT(Params(), ElementsAre(FloatNear(-1.0f, 1e-6), FloatNear(-6.0f, 1e-6)));
  // A retry of the completed step gets the same answer and changes nothing.
  agg_->Push(Push(1, 0, 3, {0.0f, 8.0f}), b_late_retry.callback());
  ASSERT_TRUE(b_late_retry.result->ok());
  EXPECT_EQ((*b_late_retry.result)->parameters.version, 1);
  EXPECT_THAT(Params(), ElementsAre(FloatNear(-1.0f, 1e-6), FloatNear(-6.0f, 1e-6)));
  EXPECT_EQ(store_->Snapshot()->version, 1);
}

TEST_F(StepAggregatorTest, AWithdrawnWaitIsNeverAnsweredButItsPushStillCounts) {
  grads_.reserve(16);
  Outcome a, b;
  const uint64_t ticket = agg_->Push(Push(0, 0, 1, {4.0f, 0.0f}), a.callback());
  ASSERT_NE(ticket, 0u);
  EXPECT_TRUE(agg_->CancelWait(ticket));
  EXPECT_FALSE(agg_->CancelWait(ticket)) << "a wait is withdrawn once";
  EXPECT_EQ(agg_->Push(Push(1, 0, 3, {0.0f, 8.0f}), b.callback()), 0u) << "b completes the step";
  ASSERT_TRUE(b.result.has_value() && b.result->ok());
  EXPECT_FALSE(a.result.has_value());
  EXPECT_THAT(Params(), ElementsAre(FloatNear(-1.0f, 1e-6), FloatNear(-6.0f, 1e-6)));
  // Too late to withdraw an answered wait.
  Outcome c;
  const uint64_t next = agg_->Push(Push(0, 1, 1, {1.0f, 1.0f}), c.callback());
  agg_->Abort(absl::AbortedError("stop"));
  EXPECT_FALSE(agg_->CancelWait(next));
  EXPECT_TRUE(c.result.has_value());
}

TEST_F(StepAggregatorTest, PrecheckRefusesWhatPushWouldRefuseWithoutTheGradient) {
  grads_.reserve(16);
  GradientPush header;
  header.worker_id = 0;
  header.num_samples = 1;  // gradient left empty: only who, when and how many are checked
  EXPECT_THAT(agg_->Precheck(header), IsOk());
  header.step = 3;
  EXPECT_THAT(agg_->Precheck(header), StatusCodeIs(absl::StatusCode::kFailedPrecondition));
  header.step = 0;
  header.worker_id = 9;
  EXPECT_THAT(agg_->Precheck(header), StatusCodeIs(absl::StatusCode::kNotFound));
  header.worker_id = 0;
  header.num_samples = 2;
  EXPECT_THAT(agg_->Precheck(header), StatusCodeIs(absl::StatusCode::kInvalidArgument));
  // A retry of a pending push passes (it is answered, not counted).
  Outcome a;
  agg_->Push(Push(0, 0, 1, {1.0f, 1.0f}), a.callback());
  header.num_samples = 1;
  EXPECT_THAT(agg_->Precheck(header), IsOk());
}

TEST(StepAggregatorMemoryTest, TheSumLiesWhereTheNewParametersGoAndStartsFromZeroEachStep) {
  // No model-sized sum of its own: each step sums into the buffer the store reserved for its
  // new values, which held parameters before (stale), so every step must start from zero.
  ParameterStore store(std::make_unique<SgdOptimizer>(SgdConfig{1.0, 0.0, 0.0, false}));
  ASSERT_THAT(store.Register({{"w", {2}}}, std::vector<float>{10.0f, 20.0f}), IsOk());
  StepAggregator agg(&store);
  agg.BeginEpoch(0, {{{0, 1}, {1, 1}}, {{0, 1}, {1, 1}}, {{0, 1}, {1, 1}}});
  std::vector<float> g0 = {2.0f, 4.0f}, g1 = {4.0f, 8.0f};
  std::set<const float*> buffers;
  for (int step = 0; step < 3; ++step) {
    Outcome a, b;  // their results (which hold the parameters) go at the end of the step
    agg.Push(GradientPush{0, 0, step, 1, 0.0, g0}, a.callback());
    ASSERT_FALSE(a.result.has_value());
    const absl::StatusOr<absl::Span<float>> next = store.ReserveNextBuffer();
    ASSERT_THAT(next, IsOk());
    EXPECT_NE(next->data(), store.Snapshot()->values->data());
    EXPECT_EQ(next->data()[0], 2.0f) << "worker 0's value, summed there";
    agg.Push(GradientPush{1, 0, step, 1, 0.0, g1}, b.callback());
    ASSERT_TRUE(a.result.has_value() && a.result->ok());
    EXPECT_EQ((*a.result)->parameters.values->data(), next->data());
    // The mean [3 6] taken from the parameters once a step.
    const float k = static_cast<float>(step + 1);
    EXPECT_THAT(*store.Snapshot()->values, ElementsAre(10.0f - 3.0f * k, 20.0f - 6.0f * k));
    buffers.insert(next->data());
  }
  EXPECT_EQ(buffers.size(), 2u) << "two buffers in turn: each step's sum in the step before last's";
}

TEST(StepAggregatorBufferTest, BuffersBecomeTheSampleWeightedMeanOfThePushedValues) {
  // A model with a trained weight and a BatchNorm-like running mean: the weight is stepped by
  // SGD with the mean gradient; the buffer takes the mean of the workers' values after their
  // steps, weighted by their samples, and is not trained.
  ParameterStore store(std::make_unique<SgdOptimizer>(SgdConfig{1.0, 0.9, 0.1, false}));
  const ModelLayout layout = {{"w", {1}}, {"bn.running_mean", {2}, /*buffer=*/true}};
  ASSERT_THAT(store.Register(layout, std::vector<float>{0.0f, 5.0f, 5.0f}), IsOk());
  StepAggregator agg(&store);
  agg.BeginEpoch(0, {{{0, 1}, {1, 3}}});
  const std::vector<float> g0 = {4.0f, 4.0f, 0.0f}, g1 = {0.0f, 0.0f, 8.0f};
  Outcome a, b;
  agg.Push({0, 0, 0, 1, 0.0, g0}, a.callback());
  agg.Push({1, 0, 0, 3, 0.0, g1}, b.callback());
  ASSERT_TRUE(b.result.has_value() && b.result->ok());
  // w: g = (1*4 + 3*0) / 4 = 1, SGD lr 1 -> -1. Buffer: (1*[4, 0] + 3*[0, 8]) / 4 = [1, 6].
  EXPECT_THAT(*store.Snapshot()->values,
              ElementsAre(FloatNear(-1.0f, 1e-6), FloatNear(1.0f, 1e-6), FloatNear(6.0f, 1e-6)));
}

TEST_F(StepAggregatorTest, AbortReleasesPendingPushes) {
  grads_.reserve(16);
  Outcome a, later;
  agg_->Push(Push(0, 0, 1, {1.0f, 1.0f}), a.callback());
  agg_->Abort(absl::AbortedError("stop"));
  ASSERT_TRUE(a.result.has_value());
  EXPECT_THAT(a.result->status(), StatusCodeIs(absl::StatusCode::kAborted));
  agg_->Push(Push(1, 0, 3, {1.0f, 1.0f}), later.callback());
  EXPECT_THAT(later.result->status(), StatusCodeIs(absl::StatusCode::kAborted));
  EXPECT_EQ(store_->Snapshot()->version, 0);
}

}  // namespace
}  // namespace dbs

namespace dbs {
namespace {

TEST_F(StepAggregatorTest, PushForAnOlderStepIsStale) {
  grads_.reserve(16);
  Outcome a, b, c, d, stale;
  agg_->Push(Push(0, 0, 1, {1.0f, 1.0f}), a.callback());
  agg_->Push(Push(1, 0, 3, {1.0f, 1.0f}), b.callback());
  agg_->Push(Push(0, 1, 1, {1.0f, 1.0f}), c.callback());
  agg_->Push(Push(1, 1, 0, {}), d.callback());
  ASSERT_TRUE(d.result->ok());
  // Step 0 is two steps old: not a retry of the latest step, so it is refused.
  agg_->Push(Push(0, 0, 1, {1.0f, 1.0f}), stale.callback());
  EXPECT_THAT(stale.result->status(), StatusCodeIs(absl::StatusCode::kFailedPrecondition));
  EXPECT_EQ(store_->Snapshot()->version, 2);
}

}  // namespace
}  // namespace dbs

namespace dbs {
namespace {

TEST(StepAggregatorEvictionTest, StepCompletesWithoutTheDeadWorkerAndCarriesTheRevision) {
  ParameterStore store(std::make_unique<SgdOptimizer>(SgdConfig{1.0, 0.0, 0.0, false}));
  ASSERT_THAT(store.Register({{"w", {1}}}, std::vector<float>{0.0f}), IsOk());
  StepAggregator agg(&store);
  // Three workers, two steps of 1 + 1 + 2 samples.
  agg.BeginEpoch(0, {{{0, 1}, {1, 1}, {2, 2}}, {{0, 1}, {1, 1}, {2, 2}}});
  std::vector<float> g0 = {2.0f}, g1 = {4.0f}, g2 = {100.0f};
  std::optional<absl::StatusOr<StepResult>> r0, r1, late;
  agg.Push({0, 0, 0, 1, 0.0, g0}, [&](const absl::StatusOr<StepResult>& r) { r0 = r; });
  agg.Push({1, 0, 0, 1, 0.0, g1}, [&](const absl::StatusOr<StepResult>& r) { r1 = r; });
  EXPECT_FALSE(agg.Evict(0, 0, {1})) << "worker 1 has pushed: it is not dead";
  EXPECT_FALSE(agg.Evict(0, 1, {2})) << "not the current step";
  ASSERT_TRUE(agg.Evict(0, 0, {2}));
  agg.Push({2, 0, 0, 2, 0.0, g2}, [&](const absl::StatusOr<StepResult>& r) { late = r; });
  ASSERT_TRUE(late.has_value());
  EXPECT_THAT(late->status(), StatusCodeIs(absl::StatusCode::kNotFound));
  EXPECT_FALSE(r0.has_value());

  PlanRevision rev;
  rev.epoch = 0;
  rev.from_step = 1;
  rev.num_steps = 2;
  agg.CompleteEviction({{{{0, 2}, {1, 2}}}, {{0, rev}, {1, rev}}});
  ASSERT_TRUE(r0.has_value() && r0->ok() && r1.has_value() && r1->ok());
  // The mean over the samples actually pushed: (2 + 4) / 2 = 3, not diluted by the dead worker.
  EXPECT_FLOAT_EQ((*store.Snapshot()->values)[0], -3.0f);
  EXPECT_EQ((*r0)->global_samples, 2);
  ASSERT_NE((*r0)->revisions, nullptr);
  EXPECT_EQ((*r0)->revisions->at(0).from_step, 1);
  // The next step follows the new quotas: 2 samples each from the survivors.
  std::optional<absl::StatusOr<StepResult>> a, b;
  agg.Push({0, 0, 1, 1, 0.0, g0}, [&](const absl::StatusOr<StepResult>& r) { a = r; });
  EXPECT_EQ(a->status().code(), absl::StatusCode::kInvalidArgument) << "old batch size";
  a.reset();
  agg.Push({0, 0, 1, 2, 0.0, g0}, [&](const absl::StatusOr<StepResult>& r) { a = r; });
  agg.Push({1, 0, 1, 2, 0.0, g1}, [&](const absl::StatusOr<StepResult>& r) { b = r; });
  ASSERT_TRUE(b.has_value() && b->ok());
  EXPECT_EQ((*b)->global_samples, 4);
  EXPECT_EQ(agg.AcceptedPushes(0), (std::set<std::pair<int, int>>{{0, 0}, {1, 0}, {0, 1}, {1, 1}}));
}

TEST(StepAggregatorTimingTest, TimesEachWorkersStepFromTheAnswersToItsPush) {
  FakeClock clock;
  ParameterStore store(std::make_unique<SgdOptimizer>(SgdConfig{1.0, 0.0, 0.0, false}));
  ASSERT_THAT(store.Register({{"w", {1}}}, std::vector<float>{0.0f}), IsOk());
  StepAggregator agg(&store, &clock);
  std::vector<StepStats> seen;
  agg.SetStepHook([&](const StepStats& s) {
    seen.push_back(s);
    clock.Advance(absl::Milliseconds(50));  // the server's own time (a checkpoint): not theirs
    return std::nullopt;
  });
  const std::vector<float> g = {1.0f};
  std::deque<Outcome> outcomes;  // each answer lands in its own place, kept to the end
  auto push = [&](int worker, int epoch, int step, double compute) {
    GradientPush p;
    p.worker_id = worker;
    p.epoch = epoch;
    p.step = step;
    p.num_samples = 1;
    p.gradient = g;
    p.compute_seconds = compute;
    outcomes.emplace_back();
    agg.Push(p, outcomes.back().callback());
  };
  // The first step of an epoch is timed from its beginning (the plans going out).
  agg.BeginEpoch(0, {{{0, 1}, {1, 1}}, {{0, 1}, {1, 1}}});
  clock.Advance(absl::Milliseconds(12));
  push(0, 0, 0, 0.010);
  clock.Advance(absl::Milliseconds(20));
  push(1, 0, 0, 0.030);
  ASSERT_EQ(seen.size(), 1u);
  EXPECT_NEAR(seen[0].cycle.at(0), 0.012, 1e-9);
  EXPECT_NEAR(seen[0].cycle.at(1), 0.032, 1e-9);
  // Step 1: the answers went out after the hook. Worker 0 says it computed 6 ms and arrives
  // 10 ms later; worker 1 says it computed nothing and arrives at 33 ms.
  clock.Advance(absl::Milliseconds(10));
  push(0, 0, 1, 0.006);
  clock.Advance(absl::Milliseconds(23));
  push(1, 0, 1, 0.0);
  ASSERT_EQ(seen.size(), 2u);
  EXPECT_NEAR(seen[1].cycle.at(0), 0.010, 1e-9);
  EXPECT_NEAR(seen[1].cycle.at(1), 0.033, 1e-9) << "what the worker says it computed is not it";
  EXPECT_EQ(seen[1].workers.at(0).second, 0.006) << "compute stays as the worker timed it";
  agg.BeginEpoch(1, {{{0, 1}, {1, 1}}});
  clock.Advance(absl::Seconds(1));
  push(0, 1, 0, 0.006);
  push(1, 1, 0, 0.030);
  ASSERT_EQ(seen.size(), 3u);
  EXPECT_NEAR(seen[2].cycle.at(0), 1.0, 1e-9);
  EXPECT_NEAR(seen[2].cycle.at(1), 1.0, 1e-9);
}

TEST(StepAggregatorTimingTest, NoClockNoOverhead) {
  ParameterStore store(std::make_unique<SgdOptimizer>(SgdConfig{1.0, 0.0, 0.0, false}));
  ASSERT_THAT(store.Register({{"w", {1}}}, std::vector<float>{0.0f}), IsOk());
  StepAggregator agg(&store);
  std::vector<StepStats> seen;
  agg.SetStepHook([&](const StepStats& s) {
    seen.push_back(s);
    return std::nullopt;
  });
  const std::vector<float> g = {1.0f};
  agg.BeginEpoch(0, {{{0, 1}}, {{0, 1}}});
  for (int step = 0; step < 2; ++step) {
    GradientPush p;
    p.worker_id = 0;
    p.step = step;
    p.num_samples = 1;
    p.gradient = g;
    Outcome o;  // a lone worker's push completes its step at once
    agg.Push(p, o.callback());
    EXPECT_TRUE(o.result.has_value());
  }
  ASSERT_EQ(seen.size(), 2u);
  EXPECT_TRUE(seen[1].cycle.empty());
}

}  // namespace
}  // namespace dbs

namespace dbs {
namespace {

// Worker `w`'s gradient: large and small magnitudes mixed, so that rounding makes the fp32 sum
// of several depend on the order of addition.
std::vector<float> OrderSensitiveGradient(int w, size_t model) {
  std::vector<float> g(model);
  for (size_t i = 0; i < model; ++i) {
    g[i] = (w % 2 == 0 ? 1e7f : 1.0f) * (1.0f + 0.1f * static_cast<float>((w * 7 + i) % 11)) *
           (((w + i) % 3 == 0) ? -1.0f : 1.0f);
  }
  return g;
}

// A 64-value model under plain SGD with lr 1, and an epoch of one step in which worker w of
// `workers` has batch 1 + w % 3.
struct OneStepJob {
  static constexpr size_t kModel = 64;
  ParameterStore store{std::make_unique<SgdOptimizer>(SgdConfig{1.0, 0.0, 0.0, false})};
  std::unique_ptr<StepAggregator> agg;
  std::map<int, int> quota;

  OneStepJob(int workers, bool deterministic) {
    EXPECT_THAT(
        store.Register({{"w", {static_cast<int64_t>(kModel)}}}, std::vector<float>(kModel, 0.0f)),
        IsOk());
    agg = std::make_unique<StepAggregator>(&store, nullptr, AggregatorOptions{deterministic});
    for (int w = 0; w < workers; ++w) quota[w] = 1 + w % 3;
    agg->BeginEpoch(0, {quota});
  }
};

// One step of `workers` pushes in `order`, with gradients whose fp32 sum depends on the order
// of addition; returns the parameters after the step.
std::vector<float> StepInOrder(const std::vector<int>& order, bool deterministic) {
  const int workers = static_cast<int>(order.size());
  OneStepJob job(workers, deterministic);
  StepAggregator& agg = *job.agg;
  std::map<int, int>& quota = job.quota;
  int answered = 0;
  for (int w : order) {
    const std::vector<float> g = OrderSensitiveGradient(w, OneStepJob::kModel);
    agg.Push({w, 0, 0, quota[w], 0.0, g}, [&](const absl::StatusOr<StepResult>& r) {
      EXPECT_THAT(r, IsOk());
      ++answered;
    });
  }
  EXPECT_EQ(answered, workers);
  return *job.store.Snapshot()->values;
}

TEST(DeterministicAggregationTest, AnyArrivalOrderGivesBitIdenticalParameters) {
  const std::vector<int> in_order = {0, 1, 2, 3, 4, 5};
  const std::vector<float> reference = StepInOrder(in_order, true);
  std::vector<int> order = in_order;
  int orders = 0;
  do {
    ASSERT_EQ(StepInOrder(order, true), reference) << "order #" << orders;
    ++orders;
  } while (std::next_permutation(order.begin(), order.end()) && orders < 120);
}

TEST(DeterministicAggregationTest, SummedOnArrivalTheResultDependsOnTheOrder) {
  // What the deterministic mode is for: without it the same pushes give other parameters.
  const std::vector<float> in_order = StepInOrder({0, 1, 2, 3, 4, 5}, false);
  EXPECT_EQ(StepInOrder({0, 1, 2, 3, 4, 5}, true), in_order) << "worker order is the reference";
  EXPECT_NE(StepInOrder({5, 3, 1, 4, 2, 0}, false), in_order);
}

TEST(DeterministicAggregationTest, AnEvictedWorkerDoesNotHoldUpTheSumOfTheOthers) {
  ParameterStore store(std::make_unique<SgdOptimizer>(SgdConfig{1.0, 0.0, 0.0, false}));
  ASSERT_THAT(store.Register({{"w", {1}}}, std::vector<float>{0.0f}), IsOk());
  StepAggregator agg(&store);
  agg.BeginEpoch(0, {{{0, 1}, {1, 1}, {2, 2}}, {{0, 1}, {1, 1}, {2, 2}}});
  std::optional<absl::StatusOr<StepResult>> r1, r2;
  // Workers 1 and 2 wait for worker 0's turn in the sum; worker 0 never pushes.
  agg.Push({1, 0, 0, 1, 0.0, std::vector<float>{4.0f}},
           [&](const absl::StatusOr<StepResult>& r) { r1 = r; });
  agg.Push({2, 0, 0, 2, 0.0, std::vector<float>{1.0f}},
           [&](const absl::StatusOr<StepResult>& r) { r2 = r; });
  ASSERT_TRUE(agg.Evict(0, 0, {0}));
  agg.CompleteEviction({{{{1, 2}, {2, 2}}}, {}});
  ASSERT_TRUE(r1.has_value() && r1->ok() && r2.has_value() && r2->ok());
  // (1 * 4 + 2 * 1) / 3 = 2.
  EXPECT_FLOAT_EQ((*store.Snapshot()->values)[0], -2.0f);
}

// A model of several reduction windows (ReduceReadyLocked sums window by window): 4 workers
// pushing in `order`, with momentum SGD over two steps, must give the bits of the pushes summed
// in worker order, however they arrive.
std::vector<float> TwoStepsOfAWideModel(const std::vector<int>& order) {
  const size_t model = 40000;
  ParameterStore store(std::make_unique<SgdOptimizer>(SgdConfig{0.1, 0.9, 0.0, false}));
  EXPECT_THAT(store.Register({{"w", {static_cast<int64_t>(model)}}}, std::vector<float>(model)),
              IsOk());
  StepAggregator agg(&store, nullptr, AggregatorOptions{true});
  const std::map<int, int> quota = {{0, 3}, {1, 1}, {2, 2}, {3, 5}};
  agg.BeginEpoch(0, {quota, quota});
  int answered = 0;
  for (int step = 0; step < 2; ++step) {
    for (int w : order) {
      agg.Push({w, 0, step, quota.at(w), 0.0, OrderSensitiveGradient(w + step, model)},
               [&](const absl::StatusOr<StepResult>& r) { answered += r.ok(); });
    }
  }
  EXPECT_EQ(answered, 8);
  EXPECT_EQ(store.Snapshot()->version, 2);
  return *store.Snapshot()->values;
}

TEST(DeterministicAggregationTest, PushesAcrossSeveralWindowsSumInWorkerOrderWhateverTheArrival) {
  const std::vector<float> reference = TwoStepsOfAWideModel({0, 1, 2, 3});
  std::vector<int> order = {0, 1, 2, 3};
  while (std::next_permutation(order.begin(), order.end())) {
    ASSERT_EQ(TwoStepsOfAWideModel(order), reference)
        << "order " << order[0] << order[1] << order[2] << order[3];
  }
}

class LargeGradientTest : public ::testing::Test {
 protected:
  static constexpr size_t kModel = 3 * kSumBlock + 5;
  void SetUp() override {
    store_ = std::make_unique<ParameterStore>(
        std::make_unique<SgdOptimizer>(SgdConfig{1.0, 0.0, 0.0, false}));
    ASSERT_THAT(
        store_->Register({{"w", {static_cast<int64_t>(kModel)}}}, std::vector<float>(kModel, 0.0f)),
        IsOk());
    agg_ = std::make_unique<StepAggregator>(store_.get());
    agg_->BeginEpoch(0, {{{0, 1}, {1, 1}}});
  }
  void Reset() {  // a fresh store and aggregator, as SetUp makes them
    agg_.reset();
    SetUp();
  }
  // Worker `w`'s push of step 0 with `gradient`.
  static GradientPush Push(int w, std::shared_ptr<const WirePayload> gradient) {
    return GradientPush{w, 0, 0, 1, 0.0, PushedGradient(std::move(gradient))};
  }
  std::unique_ptr<ParameterStore> store_;
  std::unique_ptr<StepAggregator> agg_;
};

// A gradient in a 16-bit wire dtype, its bytes cut into segments of `cut` bytes (odd sizes put
// values across segments and every run off its alignment), kept alive by the payload.
std::shared_ptr<const WirePayload> HalfGradient(const std::vector<float>& values, WireDtype dtype,
                                                size_t cut) {
  auto bytes = std::make_shared<std::vector<uint8_t>>(1 + 2 * values.size());
  EncodeValues(values, dtype, bytes->data() + 1);  // one byte in front: unaligned
  auto p = std::make_shared<WirePayload>();
  p->dtype = dtype;
  for (size_t at = 0; at < 2 * values.size(); at += cut) {
    p->segments.emplace_back(bytes->data() + 1 + at, std::min(cut, 2 * values.size() - at));
  }
  p->bytes = 2 * values.size();
  p->keepalive = bytes;
  return p;
}

TEST_F(LargeGradientTest, HalfPrecisionGradientsSumBitForBitLikeTheirDecodedValues) {
  // bf16 is checked and summed where it lies, fp16 decoded block by block first: either way
  // the parameters are those of the same values pushed as fp32.
  for (WireDtype dtype : {WireDtype::kBf16, WireDtype::kFp16}) {
    for (size_t cut : {size_t{3}, size_t{4096}, size_t{1} << 20}) {
      std::vector<std::vector<float>> grads(2, std::vector<float>(kModel));
      std::mt19937 rng(7);
      std::normal_distribution<float> normal(0.0f, 3.0f);
      for (auto& g : grads) {
        for (float& x : g) x = normal(rng);
      }
      std::vector<float> params[2];
      for (int as_fp32 = 0; as_fp32 < 2; ++as_fp32) {
        Reset();
        Outcome a, b;
        for (int w = 0; w < 2; ++w) {
          std::vector<float> decoded(kModel);
          std::shared_ptr<const WirePayload> half = HalfGradient(grads[w], dtype, cut);
          ASSERT_THAT(DecodePayload(*half, absl::MakeSpan(decoded)), IsOk());
          agg_->Push(Push(w, as_fp32 ? WirePayload::FromFloats(decoded) : half),
                     (w == 0 ? a : b).callback());
        }
        ASSERT_TRUE(b.result.has_value());
        ASSERT_THAT(*b.result, IsOk());
        params[as_fp32] = *store_->Snapshot()->values;
      }
      for (size_t i = 0; i < kModel; ++i) {
        ASSERT_EQ(params[0][i], params[1][i])
            << WireDtypeName(dtype) << " in segments of " << cut << " bytes, value " << i;
      }
    }
  }
}

TEST_F(LargeGradientTest, HalfPrecisionValuesBeyondTheLimitAreRefusedByName) {
  // The largest bf16 value at most kMaxAbsGradient passes, the next one up does not, and
  // neither do infinities and NaNs of either sign; fp16 has only infinities and NaNs to refuse.
  uint32_t limit_bits;
  std::memcpy(&limit_bits, &kMaxAbsGradient, sizeof limit_bits);
  const float largest_bf16 = Bf16ToFloat(static_cast<uint16_t>(limit_bits >> 16));  // cut: down
  ASSERT_LE(largest_bf16, kMaxAbsGradient);
  ASSERT_GT(Bf16ToFloat(FloatToBf16(largest_bf16) + 1), kMaxAbsGradient);
  const float inf = std::numeric_limits<float>::infinity();
  const float nan = std::numeric_limits<float>::quiet_NaN();
  struct Case {
    WireDtype dtype;
    float value;
    bool refused;
  };
  const Case cases[] = {
      {WireDtype::kBf16, largest_bf16, false},
      {WireDtype::kBf16, -largest_bf16, false},
      {WireDtype::kBf16, Bf16ToFloat(FloatToBf16(largest_bf16) + 1), true},
      {WireDtype::kBf16, -inf, true},
      {WireDtype::kBf16, nan, true},
      {WireDtype::kBf16, -nan, true},
      {WireDtype::kFp16, 65504.0f, false},
      {WireDtype::kFp16, inf, true},
      {WireDtype::kFp16, -nan, true},
  };
  for (const Case& c : cases) {
    Reset();
    const size_t bad = kSumBlock + 9;
    std::vector<float> g(kModel, 1.0f);
    g[bad] = c.value;
    Outcome a;
    agg_->Push(Push(0, HalfGradient(g, c.dtype, 1001)), a.callback());
    if (c.refused) {
      ASSERT_TRUE(a.result.has_value()) << "refused at once";
      EXPECT_THAT(a.result->status(),
                  StatusIs(absl::StatusCode::kInvalidArgument,
                           HasSubstr(absl::StrCat("worker 0's element ", bad, " is "))))
          << WireDtypeName(c.dtype) << " " << c.value;
    } else {
      EXPECT_FALSE(a.result.has_value())
          << WireDtypeName(c.dtype) << " " << c.value << ": accepted, it waits for worker 1";
    }
  }
}

// fp32 values either side of the limit, and of where a value's square overflows a float (the
// check spares values whose block's sum of squares is finite), among the vectorized lanes and
// in a block's tail.
TEST_F(LargeGradientTest, Fp32ValuesAreRefusedOnlyBeyondTheLimit) {
  const float inf = std::numeric_limits<float>::infinity();
  const float beyond = std::nextafter(kMaxAbsGradient, inf);
  for (size_t bad : {kSumBlock + 9, kModel - 1}) {
    for (float value : {1e19f, -1e20f, kMaxAbsGradient, -kMaxAbsGradient, beyond, -inf, 3e38f}) {
      Reset();
      std::vector<float> g(kModel, 1.0f);
      g[bad] = value;
      Outcome a;
      agg_->Push(Push(0, WirePayload::FromFloats(g)), a.callback());
      if (std::fabs(value) > kMaxAbsGradient) {
        ASSERT_TRUE(a.result.has_value()) << value << " at " << bad << ": refused at once";
        EXPECT_THAT(a.result->status(),
                    StatusIs(absl::StatusCode::kInvalidArgument,
                             HasSubstr(absl::StrCat("worker 0's element ", bad, " is "))));
      } else {
        EXPECT_FALSE(a.result.has_value()) << value << " at " << bad << ": accepted, it waits";
      }
    }
  }
}

}  // namespace
}  // namespace dbs
