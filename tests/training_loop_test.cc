// The worker's training loop without any process or network: a FakeLearner (a quadratic model
// whose gradient is w - target, costing simulated time per sample) against FakePsClient, with a
// FakeClock so every time the loop reports is exact.
#include "worker/training_loop.h"

#include <cmath>
#include <cstdio>
#include <fstream>
#include <functional>
#include <optional>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tests/fake_ps_client.h"
#include "tests/status_matchers.h"
#include "worker/emulation.h"

namespace dbs {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::Not;

constexpr int kTrain = 22;
constexpr int kTest = 10;
constexpr int kParams = 3;
constexpr double kSecondsPerSample = 0.001;

// Quadratic loss 0.5 |w - target|^2 per sample; the gradient of any batch is w - target.
class FakeLearner : public Learner {
 public:
  explicit FakeLearner(FakeClock* clock) : clock_(clock), w_(kParams, 0.0f) {}

  int64_t train_size() const override { return kTrain; }
  int64_t test_size() const override { return kTest; }
  std::string device() const override { return "fake"; }
  const ModelLayout& layout() const override { return layout_; }
  void GetParameters(absl::Span<float> out) override {
    std::copy(w_.begin(), w_.end(), out.begin());
  }
  void SetParameters(absl::Span<const float> v) override { w_.assign(v.begin(), v.end()); }

  absl::StatusOr<double> ComputeGradient(absl::Span<const int64_t> indices,
                                         absl::Span<float> grad) override {
    if (!fail_with.ok() && seen_.size() == 2) return fail_with;  // the third gradient fails
    clock_->Advance(absl::Seconds(kSecondsPerSample * static_cast<double>(indices.size())));
    clock_->SleepFor(waiting_for_a_core);
    if (on_gradient) on_gradient();
    seen_.emplace_back(indices.begin(), indices.end());
    trained_from_.push_back(w_);
    double loss = 0.0;
    for (int i = 0; i < kParams; ++i) {
      grad[i] = w_[i] - Target(i);
      loss += 0.5 * grad[i] * grad[i];
    }
    return loss * static_cast<double>(indices.size());
  }

  // Wall time each gradient spends waiting for a core (contention), using no CPU.
  absl::Duration waiting_for_a_core;

  EvalResult Evaluate(int64_t begin, int64_t end) override {
    evaluated_.push_back({begin, end});
    return {end - begin, (end - begin) / 2, 0.0};
  }

  absl::Status Export(const std::string& path) override {
    exports_.push_back({path, w_});
    return absl::OkStatus();
  }
  // Each export: where, and the parameters it wrote.
  std::vector<std::pair<std::string, std::vector<float>>> exports_;

  static float Target(int i) { return 1.0f + static_cast<float>(i); }
  std::function<void()> on_gradient;  // runs at every gradient
  absl::Status fail_with;             // when set, what the third gradient returns
  double Distance() const {
    double d = 0.0;
    for (int i = 0; i < kParams; ++i) d += std::abs(w_[i] - Target(i));
    return d;
  }
  // The batches trained, in order.
  const std::vector<std::vector<int64_t>>& seen() const { return seen_; }
  const std::vector<SampleRange>& evaluated() const { return evaluated_; }
  // The parameters each gradient was computed at, in order.
  const std::vector<std::vector<float>>& trained_from() const { return trained_from_; }

 private:
  FakeClock* clock_;
  ModelLayout layout_ = {{"w", {kParams}}};
  std::vector<float> w_;
  std::vector<std::vector<int64_t>> seen_;
  std::vector<SampleRange> evaluated_;
  std::vector<std::vector<float>> trained_from_;
};

class TrainingLoopTest : public ::testing::Test {
 protected:
  TrainingLoopTest() : learner_(&clock_), log_(std::tmpfile()) {
    loop_config_.name = "w0";
    loop_config_.model = "quadratic";
    loop_config_.log_every = absl::Seconds(1000);  // lines at each epoch's last step only
    loop_config_.out = log_;
    job_.epochs = 2;
    job_.global_batch = 4;  // 22 samples: 6 steps, the last of 2
    job_.push_time = absl::Milliseconds(5);
  }
  ~TrainingLoopTest() override { std::fclose(log_); }

  // The first push's compute time with a slowdown of 3 in the sense of `of`, each step
  // computing 4 ms (4 samples) and waiting `wait` for a core that a neighbour holds.
  double SlowedStepSeconds(SlowdownOf of, absl::Duration wait) {
    Slow(3.0, "", of);
    learner_.waiting_for_a_core = wait;
    FakePsClient client(job_, &clock_);
    EXPECT_THAT(Run(&client), IsOk());
    return client.pushes().empty() ? -1.0 : client.pushes()[0].compute_seconds;
  }

  // The worker is emulated slower (as dbs_worker --slowdown, --slow_windows, --slowdown_of do).
  void Slow(double base, const std::string& windows, SlowdownOf of = SlowdownOf::kCpu) {
    absl::StatusOr<SlowdownSchedule> schedule = SlowdownSchedule::Create(base, windows);
    ASSERT_THAT(schedule, IsOk());
    slowed_.emplace(&learner_, *schedule, of, &clock_);
    loop_config_.before_step = [this](int epoch, int64_t step) { slowed_->At(epoch, step); };
  }

  absl::Status Run(FakePsClient* client) {
    Learner* learner = slowed_.has_value() ? static_cast<Learner*>(&*slowed_) : &learner_;
    TrainingLoop loop(loop_config_, learner, client, &clock_);
    absl::Status s = loop.Run();
    epochs_ = loop.epochs();
    return s;
  }

  std::string Log() const {
    std::fflush(log_);
    std::rewind(log_);
    std::string out;
    char buf[4096];
    size_t n;
    while ((n = std::fread(buf, 1, sizeof(buf), log_)) > 0) out.append(buf, n);
    return out;
  }

  static std::vector<int> StepsOf(const FakePsClient& client, int epoch) {
    std::vector<int> steps;
    for (const FakePsClient::Push& p : client.pushes()) {
      if (p.epoch == epoch) steps.push_back(p.step);
    }
    return steps;
  }

  FakeClock clock_;
  FakeLearner learner_;
  std::optional<SlowedLearner> slowed_;
  std::FILE* log_;
  LoopConfig loop_config_;
  FakeJobConfig job_;
  std::vector<EpochLog> epochs_;
};

TEST_F(TrainingLoopTest, AStopRequestLeavesTheJobAndEndsCancelled) {
  FakePsClient client(job_, &clock_);
  TrainingLoop loop(loop_config_, &learner_, &client, &clock_);
  int gradients = 0;
  learner_.on_gradient = [&] {
    if (++gradients == 3) loop.RequestStop();  // SIGTERM during the third step
  };
  EXPECT_THAT(loop.Run(), StatusIs(absl::StatusCode::kCancelled, HasSubstr("signal")));
  EXPECT_TRUE(client.left()) << "it leaves, so the job re-splits its samples at once";
  EXPECT_THAT(StepsOf(client, 0), ElementsAre(0, 1, 2)) << "no step after the request";
  EXPECT_THAT(Log(), HasSubstr("left the job"));
}

TEST_F(TrainingLoopTest, AModelThatCannotTrainOnItsBatchEndsTheLoopAndLeavesTheJob) {
  FakePsClient client(job_, &clock_);
  learner_.fail_with = absl::FailedPreconditionError("the model failed on a batch of 1");
  EXPECT_THAT(Run(&client),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("failed on a batch of 1")));
  EXPECT_TRUE(client.left()) << "the job re-splits its samples at once";
  EXPECT_THAT(StepsOf(client, 0), ElementsAre(0, 1)) << "nothing pushed for the failed step";
  EXPECT_THAT(Log(), HasSubstr("cannot train: the model failed on a batch of 1; left the job"));
}

TEST_F(TrainingLoopTest, ExportsEveryNEpochsAndTheFinalParametersAtTheEnd) {
  job_.epochs = 4;
  loop_config_.export_path = "/tmp/model.pt";
  loop_config_.export_every_epochs = 2;
  FakePsClient client(job_, &clock_);
  ASSERT_THAT(Run(&client), IsOk());
  // After epochs 2 and 4, and at the end of the job.
  ASSERT_EQ(learner_.exports_.size(), 3u);
  for (const auto& [path, values] : learner_.exports_) EXPECT_EQ(path, "/tmp/model.pt");
  EXPECT_EQ(learner_.exports_.back().second, client.parameters())
      << "the export holds the job's final parameters";
  EXPECT_THAT(Log(), HasSubstr("model exported to /tmp/model.pt (end of the job)"));
}

// A batch over --max_batch is computed in micro-batches (their mean pushed, as one push of the
// whole batch's samples); the server is not told of the limit.
TEST_F(TrainingLoopTest, ABatchOverMaxBatchIsComputedInMicroBatches) {
  loop_config_.max_batch = 3;
  FakePsClient client(job_, &clock_);
  ASSERT_THAT(Run(&client), IsOk());
  // Each epoch: 5 steps of 4 samples as 2 + 2, and a last step of 2 in one piece.
  ASSERT_EQ(learner_.seen().size(), 2u * (5 * 2 + 1));
  EXPECT_EQ(learner_.seen()[0].size(), 2u);
  EXPECT_EQ(learner_.seen()[1].size(), 2u);
  EXPECT_EQ(learner_.seen()[10].size(), 2u);
  ASSERT_EQ(client.pushes().size(), 12u) << "one push a step";
  EXPECT_EQ(client.pushes()[0].num_samples, 4);
  EXPECT_THAT(Log(), HasSubstr("batch 4 is over --max_batch=3: computed as 2 micro-batches"));
  // It trains as without the limit: the same parameters (this gradient is every batch's mean).
  FakeLearner unlimited(&clock_);
  FakePsClient reference(job_, &clock_);
  LoopConfig plain = loop_config_;
  plain.max_batch = 0;
  ASSERT_THAT(TrainingLoop(plain, &unlimited, &reference, &clock_).Run(), IsOk());
  EXPECT_EQ(client.parameters(), reference.parameters());
}

TEST_F(TrainingLoopTest, TrainsEverySampleOncePerEpochAndLeaves) {
  FakePsClient client(job_, &clock_);
  ASSERT_THAT(Run(&client), IsOk());
  EXPECT_THAT(StepsOf(client, 0), ElementsAre(0, 1, 2, 3, 4, 5));
  EXPECT_THAT(StepsOf(client, 1), ElementsAre(0, 1, 2, 3, 4, 5));
  ASSERT_EQ(learner_.seen().size(), 12u);
  for (int epoch = 0; epoch < 2; ++epoch) {
    std::multiset<int64_t> samples;
    for (int s = 0; s < 6; ++s) {
      const auto& batch = learner_.seen()[epoch * 6 + s];
      EXPECT_EQ(batch.size(), s < 5 ? 4u : 2u);
      samples.insert(batch.begin(), batch.end());
    }
    std::multiset<int64_t> all;
    for (int i = 0; i < kTrain; ++i) all.insert(i);
    EXPECT_EQ(samples, all) << "epoch " << epoch;
  }
  // The permutation differs between epochs.
  EXPECT_NE(learner_.seen()[0], learner_.seen()[6]);
  ASSERT_EQ(client.reports().size(), 2u);
  EXPECT_EQ(client.reports()[1].samples, kTrain);
  EXPECT_EQ(client.reports()[1].test_samples, kTest);
  EXPECT_TRUE(client.left());
  // Each of the 12 pushes halved the distance to the target (SGD with rate 0.5 on the server),
  // and the learner holds the server's final values.
  for (int i = 0; i < kParams; ++i) {
    EXPECT_FLOAT_EQ(client.parameters()[i], FakeLearner::Target(i) * (1 - std::pow(0.5, 12)));
  }
  EXPECT_NEAR(learner_.Distance(), 6 * std::pow(0.5, 12), 1e-6);
}

TEST_F(TrainingLoopTest, ReportsComputeOnlyTimeSlowedByTheSchedule) {
  Slow(3.0, "e1:2:2");
  FakePsClient client(job_, &clock_);
  ASSERT_THAT(Run(&client), IsOk());
  ASSERT_EQ(client.reports().size(), 2u);
  // Epoch 0 three times, epoch 1 six times as slow; waiting is the push time of every step.
  EXPECT_NEAR(client.reports()[0].compute_seconds, 3 * kTrain * kSecondsPerSample, 1e-9);
  EXPECT_NEAR(client.reports()[1].compute_seconds, 6 * kTrain * kSecondsPerSample, 1e-9);
  EXPECT_NEAR(client.reports()[0].wait_seconds, 6 * 0.005, 1e-9);
  EXPECT_NEAR(client.pushes()[0].compute_seconds, 3 * 4 * kSecondsPerSample, 1e-9);
}

// As on a core of its own 3x slower: the 6 ms it waited for a core that a neighbour held fall
// inside the 12 ms that 4 ms of work take at a third of the speed.
TEST_F(TrainingLoopTest, SlowdownHidesTheTimeSpentWaitingForACoreInsideTheSlowerCore) {
  EXPECT_NEAR(SlowedStepSeconds(SlowdownOf::kCpu, absl::Milliseconds(6)), 0.012, 1e-9);
}

// A wait longer than the slower core's extra time shows: 4 ms of work and 10 ms of waiting take
// 14 ms, not 12.
TEST_F(TrainingLoopTest, SlowdownShowsAWaitLongerThanTheSlowerCoresShare) {
  EXPECT_NEAR(SlowedStepSeconds(SlowdownOf::kCpu, absl::Milliseconds(10)), 0.014, 1e-9);
}

TEST(SlowdownOfTest, ParsesTheFlagsNamesAndRefusesOthers) {
  EXPECT_EQ(ParseSlowdownOf("cpu").value(), SlowdownOf::kCpu);
  EXPECT_EQ(ParseSlowdownOf("wall").value(), SlowdownOf::kWall);
  EXPECT_THAT(ParseSlowdownOf("elapsed"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("'cpu' or 'wall'")));
}

// A worker held to a CPU quota: its time off the CPU is its own throttling, so the slowdown
// multiplies all of it (slowing only its CPU time would let the quota refill while it sleeps).
TEST_F(TrainingLoopTest, SlowdownOfWallScalesTheWholeComputation) {
  EXPECT_NEAR(SlowedStepSeconds(SlowdownOf::kWall, absl::Milliseconds(6)), 0.030,
              1e-9);  // (4 + 6) * 3 ms
}

// Under a CPU limit of f cores a step that needs c CPU-seconds costs at least c / f, however fast
// it ran while the quota lasted: that is what each push says, while the epoch's report keeps the
// computation's own time (the paper's rule reads that).
TEST_F(TrainingLoopTest, UnderACpuLimitAStepCostsItsWholeCpuTimeOverTheLimit) {
  loop_config_.cpu_limit_cores = 0.25;
  FakePsClient client(job_, &clock_);  // every push takes 5 ms of the worker's CPU
  ASSERT_THAT(Run(&client), IsOk());
  ASSERT_EQ(client.pushes().size(), 12u);
  // The first step has no step before it: its computation (4 ms) plus no known communication.
  EXPECT_NEAR(client.pushes()[0].compute_seconds, 0.004 / 0.25, 1e-9);
  // Then each step's CPU since the previous push: that push (5 ms) and this computation.
  EXPECT_NEAR(client.pushes()[1].compute_seconds, (0.005 + 0.004) / 0.25, 1e-9);
  EXPECT_NEAR(client.pushes()[5].compute_seconds, (0.005 + 0.002) / 0.25, 1e-9);  // 2 samples
  // A new epoch's first step: its computation plus the communication the last whole step had.
  EXPECT_NEAR(client.pushes()[6].compute_seconds, (0.004 + 0.005) / 0.25, 1e-9);
  EXPECT_NEAR(client.reports()[0].compute_seconds, kTrain * kSecondsPerSample, 1e-9);
  EXPECT_THAT(Log(), HasSubstr("CPU limit of 0.25 cores"));
}

// What communication costs the worker's CPU, with or without a limit: each whole step's CPU
// outside its computation (here the fake push's 5 ms), in the epoch log and its line.
TEST_F(TrainingLoopTest, EachEpochRecordsTheCpuItsStepsSpentOutsideTheComputation) {
  FakePsClient client(job_, &clock_);
  ASSERT_THAT(Run(&client), IsOk());
  ASSERT_EQ(epochs_.size(), 2u);
  for (const EpochLog& e : epochs_) {
    // 6 steps an epoch; the first has no push before it in the epoch.
    EXPECT_EQ(e.outside_cpu_steps, 5);
    EXPECT_NEAR(e.outside_cpu_seconds, 5 * 0.005, 1e-9);
  }
  EXPECT_THAT(Log(), HasSubstr("CPU outside compute 5.000 ms/step"));
}

TEST_F(TrainingLoopTest, UnderACpuLimitAStepThatTookLongerCostsItsTime) {
  loop_config_.cpu_limit_cores = 0.25;
  learner_.waiting_for_a_core = absl::Milliseconds(40);  // throttled: wall time, no CPU
  FakePsClient client(job_, &clock_);
  ASSERT_THAT(Run(&client), IsOk());
  EXPECT_NEAR(client.pushes()[1].compute_seconds, 0.044, 1e-9);  // 44 ms > 9 ms / 0.25
}

TEST_F(TrainingLoopTest, ServerRestartMidEpochResumesFromItsCheckpoint) {
  FakePsClient reference(job_, &clock_);
  ASSERT_THAT(Run(&reference), IsOk());
  const std::vector<float> uninterrupted = reference.parameters();

  FakeLearner learner(&clock_);
  FakePsClient client(job_, &clock_);
  // The push of epoch 1 step 4 reaches a server restarted from its checkpoint at step 2.
  client.RestartAt(1, 4, 2);
  TrainingLoop loop(loop_config_, &learner, &client, &clock_);
  ASSERT_THAT(loop.Run(), IsOk());
  EXPECT_EQ(client.restarts(), 1);
  EXPECT_THAT(StepsOf(client, 1), ElementsAre(0, 1, 2, 3, 2, 3, 4, 5));
  ASSERT_EQ(client.reports().size(), 2u);
  EXPECT_EQ(client.reports()[1].samples, kTrain);
  // Steps 2-5 were timed here; scaled to the whole epoch, the speed estimate is unchanged.
  EXPECT_NEAR(client.reports()[1].compute_seconds, kTrain * kSecondsPerSample, 1e-9);
  // Replaying steps 2 and 3 from the checkpointed parameters ends where an uninterrupted run does.
  for (int i = 0; i < kParams; ++i) EXPECT_FLOAT_EQ(client.parameters()[i], uninterrupted[i]);
  EXPECT_THAT(Log(), HasSubstr("resuming at epoch 2 step 3 from the server's state"));
}

TEST_F(TrainingLoopTest, ServerRestartBeforeTheReportRetrainsTheLostSteps) {
  FakePsClient client(job_, &clock_);
  client.RestartAt(0, 6, 5);  // the report of epoch 0 finds a server back at step 5
  ASSERT_THAT(Run(&client), IsOk());
  EXPECT_THAT(StepsOf(client, 0), ElementsAre(0, 1, 2, 3, 4, 5, 5));
  ASSERT_EQ(client.reports().size(), 2u);
  EXPECT_EQ(client.reports()[0].samples, kTrain);
  // Only the last step (2 samples) was timed after the resume; scaled to 22 samples.
  EXPECT_NEAR(client.reports()[0].compute_seconds, kTrain * kSecondsPerSample, 1e-9);
}

// The server restarted after the worker's report reached it, from a checkpoint without it: the
// worker reports the epoch again, and its record counts the epoch once.
TEST_F(TrainingLoopTest, AReportTheRestartedServerLostIsSentAgainAndRecordedOnce) {
  FakePsClient client(job_, &clock_);
  client.LoseReportOf(0);
  ASSERT_THAT(Run(&client), IsOk());
  EXPECT_EQ(client.restarts(), 1);
  EXPECT_THAT(StepsOf(client, 0), ElementsAre(0, 1, 2, 3, 4, 5)) << "no step redone";
  ASSERT_EQ(client.reports().size(), 2u);
  EXPECT_EQ(client.reports()[0].samples, kTrain);
  ASSERT_EQ(epochs_.size(), 2u);
  EXPECT_EQ(epochs_[0].timing.epoch, 0);
  EXPECT_EQ(epochs_[1].timing.epoch, 1);
  EXPECT_THAT(Log(), HasSubstr("resuming at epoch 1 step 7"));
}

TEST_F(TrainingLoopTest, AResumeThatFailsEndsTheLoopSayingWhy) {
  FakePsClient client(job_, &clock_);
  client.RestartAt(1, 4, 2);
  client.FailResumeWith(absl::UnavailableError("the leader is still restoring"));
  EXPECT_THAT(Run(&client), StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("step")));
  EXPECT_THAT(Log(), HasSubstr("cannot resume after"));
  EXPECT_THAT(Log(), HasSubstr("the leader is still restoring"));
}

// The server restarted behind the worker and declared it dead before it asked where to
// resume (it was cut off longer than the worker timeout): it registers again instead of ending.
TEST_F(TrainingLoopTest, AWorkerDeclaredDeadBeforeItResumesRejoins) {
  job_.epochs = 3;
  FakePsClient client(job_, &clock_);
  client.RestartAt(1, 4, 2);
  client.EvictBeforeResume();
  ASSERT_THAT(Run(&client), IsOk());
  EXPECT_EQ(client.restarts(), 1);
  EXPECT_EQ(client.rejoins(), 1);
  EXPECT_THAT(StepsOf(client, 1), ElementsAre(0, 1, 2, 3));
  EXPECT_THAT(StepsOf(client, 2), ElementsAre(0, 1, 2, 3, 4, 5));
  ASSERT_EQ(client.reports().size(), 2u) << "epochs 0 and 2";
  EXPECT_EQ(client.reports()[1].worker_id, 1) << "under its new id";
  EXPECT_THAT(Log(), HasSubstr("joined again as worker 1 from epoch 3"));
}

// Epoch 0 re-planned after its step 1 (8 samples done): the rest in 2 steps of 7, and the test
// slice [2, 7).
PlanRevision RestInTwoStepsOfSeven() {
  PlanRevision rev;
  rev.epoch = 0;
  rev.from_step = 2;
  rev.num_steps = 4;
  rev.steps = {{{8, 15}}, {{15, 22}}};
  rev.test_range = {2, 7};
  return rev;
}

TEST_F(TrainingLoopTest, FollowsAPlanRevision) {
  FakePsClient client(job_, &clock_);
  // After step 1 of epoch 0 (8 samples done), the rest is re-planned into 2 steps of 7, and the
  // test slice changes.
  client.ReviseAfter(0, 1, RestInTwoStepsOfSeven());
  ASSERT_THAT(Run(&client), IsOk());
  EXPECT_THAT(StepsOf(client, 0), ElementsAre(0, 1, 2, 3));
  EXPECT_EQ(learner_.seen()[2].size(), 7u);
  EXPECT_EQ(learner_.seen()[3].size(), 7u);
  ASSERT_EQ(client.reports().size(), 2u);
  EXPECT_EQ(client.reports()[0].samples, kTrain);
  EXPECT_EQ(client.reports()[0].test_samples, 5);
  EXPECT_EQ(learner_.evaluated()[0], (SampleRange{2, 7}));
  // Epoch 1 has the regular plan again.
  EXPECT_THAT(StepsOf(client, 1), ElementsAre(0, 1, 2, 3, 4, 5));
  EXPECT_THAT(Log(), HasSubstr("epoch 1 re-planned at step 2 (revision 1): 4 steps, my next "
                               "batch 7"));
}

// A server restarted from a checkpoint written just before a revision it had sent expects the
// old plan at the very step the worker is at: the push is refused as not matching the plan, and
// the worker, knowing the server came back, resumes from the server's plan instead of ending.
TEST_F(TrainingLoopTest, AfterARestartAPushThatDoesNotMatchThePlanResumes) {
  FakePsClient client(job_, &clock_);
  client.ReviseAfter(0, 1, RestInTwoStepsOfSeven());
  client.ForgetRevisionAt(0, 2);
  ASSERT_THAT(Run(&client), IsOk());
  EXPECT_EQ(client.restarts(), 1);
  EXPECT_THAT(StepsOf(client, 0), ElementsAre(0, 1, 2, 3, 4, 5)) << "the server's plan";
  EXPECT_EQ(learner_.seen()[2].size(), 7u) << "the refused step, as revised";
  EXPECT_EQ(learner_.seen()[3].size(), 4u) << "step 2 again, as the restored server has it";
  ASSERT_EQ(client.reports().size(), 2u);
  EXPECT_EQ(client.reports()[0].samples, kTrain);
  EXPECT_THAT(Log(), HasSubstr("resuming at epoch 1 step 3"));
}

TEST_F(TrainingLoopTest, RefusesAnInconsistentRevision) {
  FakePsClient client(job_, &clock_);
  PlanRevision rev;
  rev.epoch = 0;
  rev.from_step = 3;  // the reply of step 1 must revise from step 2
  rev.num_steps = 4;
  rev.steps = {{{8, 22}}};
  client.ReviseAfter(0, 1, rev);
  EXPECT_THAT(Run(&client), StatusIs(absl::StatusCode::kInvalidArgument,
                                     HasSubstr("inconsistent plan revision")));
  EXPECT_EQ(client.pushes().size(), 2u);
}

TEST_F(TrainingLoopTest, RefusesSamplesOutsideTheDataSet) {
  FakePsClient client(job_, &clock_);
  PlanRevision rev;
  rev.epoch = 0;
  rev.from_step = 2;
  rev.num_steps = 3;
  rev.steps = {{{8, 40}}};
  client.ReviseAfter(0, 1, rev);
  EXPECT_THAT(Run(&client),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("outside the data set")));
  EXPECT_EQ(learner_.seen().size(), 2u);  // nothing was computed on the bad range
}

// An evicted worker registers again and rejoins at the next epoch.
TEST_F(TrainingLoopTest, AnEvictedWorkerRejoinsAtTheNextEpoch) {
  FakePsClient client(job_, &clock_);
  client.EvictAt(0, 3);
  ASSERT_THAT(Run(&client), IsOk());
  EXPECT_EQ(client.rejoins(), 1);
  EXPECT_THAT(StepsOf(client, 0), ElementsAre(0, 1, 2));
  EXPECT_THAT(StepsOf(client, 1), ElementsAre(0, 1, 2, 3, 4, 5));
  ASSERT_EQ(client.reports().size(), 1u);
  EXPECT_EQ(client.reports()[0].epoch, 1);
  EXPECT_EQ(client.reports()[0].worker_id, 1) << "under its new id";
  EXPECT_TRUE(client.left());
  EXPECT_THAT(Log(), HasSubstr("declared dead"));
  EXPECT_THAT(Log(), HasSubstr("joined again as worker 1 from epoch 2"));
}

// Evicted during the last epoch: the job has nothing left to join, and the worker says so
// instead of "joined again from epoch 3" of a 2-epoch job.
TEST_F(TrainingLoopTest, AWorkerEvictedInTheLastEpochFinishesWithNothingLeftToJoin) {
  FakePsClient client(job_, &clock_);
  client.EvictAt(1, 3);
  ASSERT_THAT(Run(&client), IsOk());
  EXPECT_EQ(client.rejoins(), 1);
  EXPECT_THAT(StepsOf(client, 1), ElementsAre(0, 1, 2));
  ASSERT_EQ(client.reports().size(), 1u) << "epoch 1 only";
  EXPECT_THAT(Log(), HasSubstr("nothing left to join"));
  EXPECT_THAT(Log(), Not(HasSubstr("from epoch 3")));
}

// Removed before its report reached the server (a restarted server that did not hear from it
// within the worker timeout): it rejoins instead of ending with the removal's error.
TEST_F(TrainingLoopTest, AWorkerRemovedBeforeItsReportRejoins) {
  job_.epochs = 3;
  FakePsClient client(job_, &clock_);
  client.EvictAt(0, 6);  // the report of epoch 0 (6 steps)
  ASSERT_THAT(Run(&client), IsOk());
  EXPECT_EQ(client.rejoins(), 1);
  EXPECT_THAT(StepsOf(client, 1), ElementsAre(0, 1, 2, 3, 4, 5));
  ASSERT_EQ(client.reports().size(), 2u) << "epochs 1 and 2, under its new id";
  EXPECT_EQ(client.reports()[0].epoch, 1);
  EXPECT_EQ(client.reports()[0].worker_id, 1);
  EXPECT_THAT(Log(), HasSubstr("joined again as worker 1 from epoch 2"));
}

// Removed while it waited for the next plan: it rejoins; in the last epoch there is nothing
// left, and it still exports the job's final parameters (pulled, not its own stale ones).
TEST_F(TrainingLoopTest, AWorkerRemovedWhileWaitingForThePlanRejoinsAndExportsTheFinalModel) {
  loop_config_.export_path = "/tmp/model.pt";
  FakePsClient client(job_, &clock_);
  client.EvictAt(0, 7);  // the plan request for epoch 1, after the report of epoch 0
  ASSERT_THAT(Run(&client), IsOk());
  EXPECT_EQ(client.rejoins(), 1);
  EXPECT_THAT(Log(), HasSubstr("nothing left to join"));
  ASSERT_EQ(learner_.exports_.size(), 1u);
  EXPECT_EQ(learner_.exports_.back().second, client.parameters());
}

// The job finished while the worker was cut off: registering again says so, and the worker
// ends successfully without exporting parameters that are not the job's.
TEST_F(TrainingLoopTest, AWorkerRemovedAfterWhichTheJobFinishedEndsSuccessfully) {
  job_.epochs = 3;
  loop_config_.export_path = "/tmp/model.pt";
  FakePsClient client(job_, &clock_);
  client.EvictAt(1, 6);
  client.FinishWhileEvicted();
  ASSERT_THAT(Run(&client), IsOk());
  EXPECT_THAT(Log(), HasSubstr("it has finished meanwhile"));
  EXPECT_THAT(Log(), HasSubstr("not exported to /tmp/model.pt"));
  EXPECT_TRUE(learner_.exports_.empty());
  EXPECT_FALSE(client.left()) << "its old id is gone; there is nothing to leave";
}

// Started (or restarted by an orchestrator) after the job ended: nothing to do, exit 0.
TEST_F(TrainingLoopTest, AWorkerStartedAfterTheJobFinishedEndsSuccessfully) {
  job_.finished = true;
  loop_config_.export_path = "/tmp/model.pt";
  FakePsClient client(job_, &clock_);
  ASSERT_THAT(Run(&client), IsOk());
  EXPECT_TRUE(client.pushes().empty());
  EXPECT_TRUE(learner_.exports_.empty());
  EXPECT_THAT(Log(), HasSubstr("the job has already finished (2 epochs): nothing to train"));
}

TEST_F(TrainingLoopTest, JoiningARunningJobStartsAtItsEpoch) {
  job_.epochs = 3;
  job_.start_epoch = 2;
  FakePsClient client(job_, &clock_);
  ASSERT_THAT(Run(&client), IsOk());
  EXPECT_TRUE(StepsOf(client, 0).empty());
  EXPECT_THAT(StepsOf(client, 2), ElementsAre(0, 1, 2, 3, 4, 5));
  ASSERT_EQ(epochs_.size(), 1u);
  EXPECT_EQ(epochs_[0].timing.epoch, 2);
  EXPECT_THAT(Log(), HasSubstr("joining a running job: training from epoch 3 on"));
}

// A worker joining a running job trains its first step on the current parameters, not on those
// of its registration, which the others have moved on from meanwhile.
TEST_F(TrainingLoopTest, AWorkerJoiningLateTrainsFromTheCurrentParameters) {
  job_.epochs = 3;
  job_.start_epoch = 2;
  FakePsClient client(job_, &clock_);
  client.MoveParametersAfterRegistration({0.5f, 0.25f, 0.125f});
  ASSERT_THAT(Run(&client), IsOk());
  ASSERT_FALSE(learner_.trained_from().empty());
  EXPECT_THAT(learner_.trained_from()[0], ElementsAre(0.5f, 0.25f, 0.125f));
}

TEST_F(TrainingLoopTest, ShowsProgressAndWritesItsRecord) {
  const std::string record = ::testing::TempDir() + "/loop_record.json";
  loop_config_.record_path = record;
  FakePsClient client(job_, &clock_);
  ASSERT_THAT(Run(&client), IsOk());
  const std::string log = Log();
  EXPECT_THAT(log, HasSubstr("joined as worker 0 on fake: 22 train / 10 test samples, model "
                             "quadratic (3 parameters), policy fake, 2 epochs, global batch 4"));
  EXPECT_THAT(log, HasSubstr("epoch 2/2 step 6/6 | loss"));
  EXPECT_THAT(log, HasSubstr("| job ETA 0:00"));
  EXPECT_THAT(log, HasSubstr("epoch 1/2 done: 22 samples, batch 4 (share 1.000)"));
  EXPECT_THAT(log, HasSubstr("finished: 2 epochs"));
  std::ifstream in(record);
  ASSERT_TRUE(in.good());
  const nlohmann::json j = nlohmann::json::parse(in);
  EXPECT_EQ(j.at("name"), "w0");
  ASSERT_EQ(j.at("epochs").size(), 2u);
  EXPECT_EQ(j.at("epochs")[1].at("samples"), kTrain);
  EXPECT_NEAR(j.at("epochs")[0].at("compute_seconds").get<double>(), kTrain * kSecondsPerSample,
              1e-9);
}

TEST_F(TrainingLoopTest, AnUnwritableRecordIsAnError) {
  loop_config_.record_path = "/nonexistent-dir/record.json";
  FakePsClient client(job_, &clock_);
  EXPECT_THAT(Run(&client), StatusIs(absl::StatusCode::kUnavailable, HasSubstr("cannot write")));
  EXPECT_EQ(client.reports().size(), 2u);  // training itself completed
}

TEST(MeasureSpeedTest, CountsSlowedComputeOnly) {
  FakeClock clock;
  FakeLearner learner(&clock);
  absl::StatusOr<SlowdownSchedule> twice = SlowdownSchedule::Create(2.0, "");
  ASSERT_THAT(twice, IsOk());
  SlowedLearner slowed(&learner, *twice, SlowdownOf::kCpu, &clock);
  absl::StatusOr<double> speed = MeasureSpeed(&slowed, &clock, 100, 8);
  ASSERT_THAT(speed, IsOk());
  // 2 ms per sample, whatever the batches; batches wrap at the end of the 22 samples
  // (8, 8, 6, 8, ...): a warm-up batch, then 14 timed ones for 104 samples.
  EXPECT_NEAR(*speed, 500.0, 1e-6);
  EXPECT_EQ(learner.seen().size(), 15u);
  EXPECT_THAT(MeasureSpeed(&learner, &clock, 0, 8),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("must be >= 1")));
}

}  // namespace
}  // namespace dbs
