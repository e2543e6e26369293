// Call sequences a hostile or unlucky peer can produce (issue 8): none may crash the server, end
// the job early, or let a wrong run end as ok. Each test but the race of item 3 failed on the
// code before its fix.
#include <cmath>
#include <list>
#include <optional>
#include <set>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/tensor.h"
#include "common/tensor_codec.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/training_job.h"
#include "tests/push_outcome.h"
#include "tests/status_matchers.h"

namespace dbs {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

// A bare scheduler with the fixed split (no TrainingJob around it).
std::unique_ptr<Scheduler> FixedScheduler(int workers, int epochs, int global_batch,
                                          const Clock* clock, int per_source = 0,
                                          absl::Duration idle = absl::ZeroDuration()) {
  SchedulerConfig sc;
  sc.max_workers_per_source = per_source;
  sc.registration_idle = idle;
  sc.expected_workers = workers;
  sc.epochs = epochs;
  sc.global_batch = global_batch;
  return std::make_unique<Scheduler>(sc, *MakeSharePolicy({PolicyKind::kFixed, global_batch}),
                                     clock, nullptr);
}

// Three workers on 12 samples, global batch 6: 2 steps of 2 + 2 + 2 samples, 1 test sample
// each.
class HardeningTest : public ::testing::Test {
 protected:
  void SetUp() override {
    JobConfig config;
    config.scheduler.expected_workers = 3;
    config.scheduler.epochs = 2;
    config.scheduler.global_batch = 6;
    config.policy = PolicyKind::kFixed;
    config.worker_timeout = absl::Seconds(10);
    job_ = *TrainingJob::Create(config, &clock_);
    for (const char* name : {"a", "b", "c"}) {
      ASSERT_THAT(job_->scheduler()->Register({name, 12, 3, "cpu"}), IsOk());
    }
    ASSERT_THAT(job_->store()->Register({{"w", {1}}}, std::vector<float>{0.0f}), IsOk());
  }

  // Pushes (epoch, step) for `worker`; returns the outcome once the step completes (or at once
  // when refused), or nullopt while it waits.
  std::optional<absl::StatusOr<StepResult>>* Push(int worker, int epoch, int step, int samples) {
    auto* out = &outcomes_.emplace_back();
    job_->aggregator()->Push({worker, epoch, step, samples, 1.0, grad_},
                             [out](const absl::StatusOr<StepResult>& r) { *out = r; });
    return out;
  }

  // The report a worker that trained its whole plan would send.
  EpochTiming ReportOf(int worker, int epoch) {
    std::optional<absl::StatusOr<WorkerPlan>> plan;
    job_->scheduler()->AwaitPlan(worker, epoch,
                                 [&plan](const absl::StatusOr<WorkerPlan>& p) { plan = p; });
    EXPECT_TRUE(plan.has_value() && plan->ok());
    EpochTiming t;
    t.worker_id = worker;
    t.epoch = epoch;
    t.samples = CountSamples((*plan)->train_ranges);
    t.compute_seconds = 1.0;
    t.test_samples = (*plan)->test_range.size();
    return t;
  }

  FakeClock clock_;
  std::unique_ptr<TrainingJob> job_;
  std::vector<float> grad_ = {1.0f};
  std::list<std::optional<absl::StatusOr<StepResult>>> outcomes_;
};

// Reports for every worker while a push waits must not complete the epoch (planning the next
// one would then find a push pending: CHECK(pending_.empty()) in BeginEpoch).
TEST_F(HardeningTest, ReportsWhileAPushWaitsAreRefusedAndNothingCrashes) {
  auto* pending = Push(0, 0, 0, 2);
  for (int w = 0; w < 3; ++w) {
    EXPECT_THAT(
        job_->scheduler()->Report(ReportOf(w, 0)),
        StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("before its steps were done")));
  }
  EXPECT_FALSE(pending->has_value()) << "the push still waits for its step";
  EXPECT_FALSE(job_->WaitFor(absl::ZeroDuration()));
  // The job goes on normally.
  Push(1, 0, 0, 2);
  Push(2, 0, 0, 2);
  ASSERT_TRUE(pending->has_value());
  EXPECT_THAT(**pending, IsOk());
}

// Reports sent between two steps must not cut the epoch short (samples never trained on, yet
// status ok).
TEST_F(HardeningTest, ReportsBetweenStepsCannotCutTheEpochShort) {
  for (int w = 0; w < 3; ++w) Push(w, 0, 0, 2);
  for (int w = 0; w < 3; ++w) {
    EXPECT_THAT(job_->scheduler()->Report(ReportOf(w, 0)),
                StatusCodeIs(absl::StatusCode::kFailedPrecondition));
  }
  EXPECT_EQ(job_->aggregator()->Progress().epoch, 0);
  EXPECT_EQ(job_->aggregator()->Progress().step, 1);
  for (int w = 0; w < 3; ++w) Push(w, 0, 1, 2);
  for (int w = 0; w < 3; ++w) EXPECT_THAT(job_->scheduler()->Report(ReportOf(w, 0)), IsOk());
  EXPECT_EQ(job_->aggregator()->Progress().epoch, 1);
  EXPECT_TRUE(job_->Run().audits.at(0).ok());
}

// A run whose audit failed never ends as `status: ok`.
TEST_F(HardeningTest, AFailedAuditNeverEndsAsOk) {
  // Epoch 0 is reported complete without a single accepted push: every sample is missing.
  EpochRecord record = job_->scheduler()->History().at(0);
  job_->OnEpochCompleted(record);
  job_->OnJobFinished(absl::OkStatus());
  EXPECT_THAT(job_->Wait(), StatusIs(absl::StatusCode::kDataLoss,
                                     HasSubstr("sample audit of epoch 1 failed: 12 samples")));
  EXPECT_NE(job_->Run().status, "ok");
}

// A worker that reported and was then removed counts once towards completion.
TEST(SchedulerCountTest, AReportedThenRemovedWorkerCountsOnce) {
  FakeClock clock;
  std::unique_ptr<Scheduler> scheduler = FixedScheduler(3, 2, 6, &clock);
  Scheduler& s = *scheduler;
  for (const char* name : {"a", "b", "c"}) ASSERT_THAT(s.Register({name, 12, 3, "cpu"}), IsOk());
  auto report = [&](int w) {
    EpochTiming t;
    t.worker_id = w;
    t.epoch = 0;
    const EpochRecord rec = s.History().at(0);
    t.samples = rec.SamplesOf(w);
    t.compute_seconds = 1.0;
    t.test_samples = rec.plans.at(w).test_range.size();
    return s.Report(t);
  };
  ASSERT_THAT(report(0), IsOk());
  ASSERT_THAT(s.RemoveWorkers({0}, 0, 1), IsOk());
  ASSERT_THAT(report(1), IsOk());
  EXPECT_FALSE(s.History().at(0).complete) << "worker 2 has not reported";
  int reported = 0;
  EXPECT_THAT(s.Unreported(0, &reported), ElementsAre(2));
}

// Two endings at once (a Leave-abort and a signal, say) notify once: Abseil aborts on a second
// Notify().
TEST_F(HardeningTest, TwoEndingsAtOnceNotifyOnce) {
  // The old window (between the check under the lock and Notify() outside it) is a few
  // instructions wide, and this stress did not hit it on the 2-core VM in 2,000 rounds; the fix
  // claims the ending under the lock, so it holds by construction. This test keeps it so.
  for (int round = 0; round < 2000; ++round) {
    JobConfig config;
    config.scheduler.expected_workers = 1;
    auto job = *TrainingJob::Create(config, &clock_);
    std::vector<std::thread> threads;
    for (int i = 0; i < 4; ++i) {
      threads.emplace_back([&job, i] {
        if (i % 2 == 0) {
          job->Abort(absl::CancelledError(absl::StrCat("signal ", i)));
        } else {
          job->OnJobFinished(absl::AbortedError(absl::StrCat("left ", i)));
        }
      });
    }
    for (std::thread& t : threads) t.join();
    ASSERT_FALSE(job->Wait().ok());
  }
}

// Leave removes that worker; the job goes on.
TEST_F(HardeningTest, ALeavingWorkerIsRemovedAndTheJobGoesOn) {
  std::vector<std::set<int>> told;  // what the server is told to let go of (shared memory)
  job_->SetRemovedHook([&told](const std::set<int>& removed) { told.push_back(removed); });
  Push(0, 0, 0, 2);
  Push(1, 0, 0, 2);
  ASSERT_THAT(job_->scheduler()->Leave(2), IsOk());
  EXPECT_FALSE(job_->WaitFor(absl::ZeroDuration())) << "the job was not aborted";
  // Removed at once, without waiting for the worker timeout.
  EXPECT_THAT(job_->CheckDeadWorkers(), ElementsAre(2));
  EXPECT_THAT(told, ElementsAre(std::set<int>{2}));
  EXPECT_TRUE(job_->CheckDeadWorkers().empty());
  EXPECT_EQ(told.size(), 1u);
  // Its part of step 0 becomes an extra step; the others finish the epoch and report.
  const int num_steps = job_->aggregator()->Progress().num_steps;
  EXPECT_EQ(num_steps, 3);
  const EpochRecord revised = job_->scheduler()->History().at(0);
  for (int step = 1; step < num_steps; ++step) {
    for (int w = 0; w < 2; ++w) {
      Push(w, 0, step, static_cast<int>(CountSamples(revised.layout.at(w).at(step))));
    }
  }
  for (int w = 0; w < 2; ++w) {
    EpochTiming t = ReportOf(w, 0);
    t.samples = revised.SamplesOf(w);
    t.test_samples = revised.reports.count(w) ? 0 : t.test_samples;
    EXPECT_THAT(job_->scheduler()->Report(t), IsOk());
  }
  ASSERT_EQ(job_->aggregator()->Progress().epoch, 1) << "epoch 0 completed without worker 2";
  EXPECT_TRUE(job_->Run().audits.at(0).ok()) << "every sample trained on exactly once";
  EXPECT_THAT(job_->aggregator()->Progress().waiting_for, ElementsAre(0, 1));
}

// A worker that dies between its last push and its report is removed after the worker timeout,
// rather than the job waiting for its report until the stall timeout ends it.
TEST_F(HardeningTest, AWorkerThatNeverReportsIsRemovedAfterTheWorkerTimeout) {
  std::vector<std::set<int>> told;
  job_->SetRemovedHook([&told](const std::set<int>& removed) { told.push_back(removed); });
  for (int step = 0; step < 2; ++step) {
    for (int w = 0; w < 3; ++w) Push(w, 0, step, 2);
  }
  ASSERT_THAT(job_->scheduler()->Report(ReportOf(0, 0)), IsOk());
  ASSERT_THAT(job_->scheduler()->Report(ReportOf(1, 0)), IsOk());
  EXPECT_TRUE(job_->CheckDeadWorkers().empty());
  clock_.Advance(absl::Seconds(9));
  EXPECT_TRUE(job_->CheckDeadWorkers().empty());
  EXPECT_TRUE(told.empty());
  clock_.Advance(absl::Seconds(1));
  EXPECT_THAT(job_->CheckDeadWorkers(), ElementsAre(2));
  EXPECT_THAT(told, ElementsAre(std::set<int>{2}));
  EXPECT_EQ(job_->aggregator()->Progress().epoch, 1) << "epoch 0 completed with two reports";
  EXPECT_THAT(job_->aggregator()->Progress().waiting_for, ElementsAre(0, 1));
  EXPECT_FALSE(job_->WaitFor(absl::ZeroDuration()));
}

}  // namespace
}  // namespace dbs

namespace dbs {
namespace {

using ::testing::HasSubstr;

// Shape products that overflow int64 ([2^31, 2^31, 2^31] would wrap to 0 elements, so a tensor
// with no data would pass the size check) are refused.
TEST(LimitsTest, OverflowingShapesAreRefused) {
  TensorList tensors;
  v1::Tensor* t = tensors.Add();
  t->set_name("w");
  for (int i = 0; i < 3; ++i) t->add_shape(int64_t{1} << 31);
  EXPECT_THAT(LayoutOf(tensors),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("invalid shape")));
  // Large but not overflowing shapes beyond the model limit are refused too.
  t->clear_shape();
  t->add_shape(int64_t{1} << 30);
  EXPECT_THAT(LayoutOf(tensors), StatusCodeIs(absl::StatusCode::kInvalidArgument));
  // A layout of many tensors whose total exceeds the limit.
  ModelLayout layout;
  for (int i = 0; i < 3; ++i) layout.push_back({absl::StrCat("t", i), {int64_t{1} << 28}});
  EXPECT_THAT(ValidateLayout(layout),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("more than")));
}

// Items 4 and 10: the first caller could declare any data set size (tens of GB of layouts under
// the scheduler's lock, or a negative step count), and any name length or number of workers.
TEST(LimitsTest, RegistrationsAreBounded) {
  FakeClock clock;
  // More workers expected than may register: nothing is planned.
  std::unique_ptr<Scheduler> scheduler = FixedScheduler(2000, 1, 6, &clock);
  Scheduler& s = *scheduler;
  EXPECT_THAT(s.Register({"huge", int64_t{1} << 40, 10, "cpu"}),
              StatusCodeIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(s.Register({"steps", int64_t{1} << 30, 10, "cpu"}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("steps per epoch")));
  EXPECT_THAT(s.Register({std::string(64 << 10, 'n'), 12, 3, "cpu"}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("at most 256 bytes")));
  EXPECT_THAT(s.Register({"a", 12, 3, std::string(1 << 20, 'd')}),
              StatusCodeIs(absl::StatusCode::kInvalidArgument));
  for (size_t i = 0; i < kMaxWorkers; ++i) {
    ASSERT_THAT(s.Register({absl::StrCat("w", i), 12, 3, "cpu"}), IsOk());
  }
  EXPECT_THAT(s.Register({"one-too-many", 12, 3, "cpu"}),
              StatusCodeIs(absl::StatusCode::kResourceExhausted));
  EXPECT_EQ(s.Workers().size(), kMaxWorkers);
}

WorkerRegistration From(const std::string& name, const std::string& source) {
  WorkerRegistration r{name, 12, 3, "cpu"};
  r.source = source;
  return r;
}

// A worker with the job's secret registered 1,024 names: a restarted honest worker could not
// rejoin. One host now has at most --max_workers_per_host places.
TEST(LimitsTest, OneHostCannotTakeMoreThanItsPlaces) {
  FakeClock clock;
  std::unique_ptr<Scheduler> scheduler = FixedScheduler(8, 1, 6, &clock, 2);
  Scheduler& s = *scheduler;
  ASSERT_THAT(s.Register(From("a", "10.0.0.1")), IsOk());
  ASSERT_THAT(s.Register(From("b", "10.0.0.1")), IsOk());
  EXPECT_THAT(
      s.Register(From("c", "10.0.0.1")),
      StatusIs(absl::StatusCode::kResourceExhausted,
               HasSubstr("2 workers from 10.0.0.1; at most 2 (dbs_ps --max_workers_per_host)")));
  EXPECT_THAT(s.Register(From("a", "10.0.0.1")), IsOk()) << "a member registers again";
  EXPECT_THAT(s.Register(From("d", "10.0.0.2")), IsOk()) << "another host";
  ASSERT_THAT(s.Leave(1), IsOk());
  EXPECT_THAT(s.Register(From("c", "10.0.0.1")), IsOk()) << "a place was freed";
}

// Slots held by registrations that never asked for a plan expire; a worker waiting for its plan,
// or calling, keeps its own.
TEST(LimitsTest, IdleRegistrationsExpireAndFreeTheirPlaces) {
  FakeClock clock;
  std::unique_ptr<Scheduler> scheduler = FixedScheduler(2000, 1, 6, &clock, 0, absl::Seconds(60));
  Scheduler& s = *scheduler;
  absl::StatusOr<RegistrationResult> waiting = s.Register(From("waiting", "10.0.0.1"));
  absl::StatusOr<RegistrationResult> calling = s.Register(From("calling", "10.0.0.1"));
  ASSERT_THAT(waiting, IsOk());
  ASSERT_THAT(calling, IsOk());
  std::optional<absl::StatusOr<WorkerPlan>> plan;
  s.AwaitPlan(waiting->worker_id, 0, [&](const absl::StatusOr<WorkerPlan>& p) { plan = p; });
  for (size_t i = 2; i < kMaxWorkers; ++i) {
    ASSERT_THAT(
        s.Register(From(absl::StrCat("flood", i), absl::StrCat("10.1.", i / 256, ".", i % 256))),
        IsOk());
  }
  EXPECT_THAT(s.Register(From("restarted", "10.0.0.9")),
              StatusCodeIs(absl::StatusCode::kResourceExhausted));
  clock.Advance(absl::Seconds(59));
  EXPECT_THAT(s.Authenticate(calling->worker_id, calling->token), IsOk());
  EXPECT_THAT(s.Register(From("restarted", "10.0.0.9")),
              StatusCodeIs(absl::StatusCode::kResourceExhausted))
      << "not idle for a minute yet";
  clock.Advance(absl::Seconds(2));
  absl::StatusOr<RegistrationResult> restarted = s.Register(From("restarted", "10.0.0.9"));
  ASSERT_THAT(restarted, IsOk());
  EXPECT_TRUE(s.IsRegistered(waiting->worker_id)) << "its plan request waits";
  EXPECT_TRUE(s.IsRegistered(calling->worker_id)) << "it called 2 s ago";
  EXPECT_FALSE(s.IsRegistered(2)) << "the flood's registrations expired";
  EXPECT_FALSE(plan.has_value());
  EXPECT_EQ(s.active_workers(), 3);
}

}  // namespace
}  // namespace dbs

namespace dbs {
namespace {

using ::testing::HasSubstr;

// Every accepted gradient is at most kMaxAbsGradient in magnitude, so no step's sum can overflow.
// A job's default (--faulty_gradients=evict): a push beyond the bound is not summed, its worker
// is quarantined (removed, its samples re-planned to the others) and the step completes with
// the other two.
TEST_F(HardeningTest, APushBeyondTheGradientBoundQuarantinesItsWorkerAndTheJobGoesOn) {
  auto* a = Push(0, 0, 0, 2);
  std::vector<float> huge = {3e38f};
  std::optional<absl::StatusOr<StepResult>> refused;
  job_->aggregator()->Push({1, 0, 0, 2, 1.0, huge},
                           [&refused](const absl::StatusOr<StepResult>& r) { refused = r; });
  ASSERT_TRUE(refused.has_value());
  EXPECT_THAT(*refused,
              StatusIs(absl::StatusCode::kAborted, HasSubstr("worker 1's element 0 is 3e+38")));
  EXPECT_THAT(refused->status().message(), HasSubstr("worker 1 is quarantined"));
  ASSERT_EQ(job_->Run().quarantined.size(), 1u);
  EXPECT_EQ(job_->Run().quarantined[0].worker_id, 1);
  EXPECT_EQ(job_->Run().quarantined[0].samples_reassigned, 4) << "its 2 steps of 2 samples";
  EXPECT_EQ(job_->Run().epochs[0].dead, std::set<int>{1});
  EXPECT_FALSE(a->has_value()) << "the step waits for worker 2";
  Push(2, 0, 0, 2);
  ASSERT_TRUE(a->has_value());
  ASSERT_THAT(**a, IsOk());
  EXPECT_EQ((**a)->global_samples, 4);
  for (float v : *(**a)->parameters.values) EXPECT_TRUE(std::isfinite(v));
}

// A worker on the server's host rewrites its shared gradient while its checked push waits for
// its turn: the push is refused as it is summed, the step completes with the others, and the
// worker is quarantined from the next step on, its samples there re-planned to the others.
TEST_F(HardeningTest, AWorkerWhoseSharedGradientChangesAfterItsCheckIsQuarantinedAtTheNextStep) {
  std::vector<float> region = {1.0f};
  std::optional<absl::StatusOr<StepResult>> refused;
  job_->aggregator()->Push({1, 0, 0, 2, 1.0, SharedRegion(&region)},
                           [&refused](const absl::StatusOr<StepResult>& r) { refused = r; });
  ASSERT_FALSE(refused.has_value()) << "held for worker 0's push";
  region[0] = 1e29f;
  auto* a = Push(0, 0, 0, 2);
  auto* c = Push(2, 0, 0, 2);
  ASSERT_TRUE(refused.has_value() && a->has_value() && c->has_value());
  ASSERT_THAT(**a, IsOk());
  EXPECT_THAT(*refused, StatusIs(absl::StatusCode::kAborted, HasSubstr("worker 1 is quarantined")));
  EXPECT_THAT(refused->status().message(), HasSubstr("changed after they were checked"));
  for (float v : *(**a)->parameters.values) EXPECT_NEAR(v, -0.05f * 4.0f / 6.0f, 1e-7);
  ASSERT_EQ(job_->Run().quarantined.size(), 1u);
  EXPECT_EQ(job_->Run().quarantined[0].worker_id, 1);
  EXPECT_EQ(job_->Run().quarantined[0].step, 0);
  EXPECT_EQ(job_->Run().quarantined[0].samples_reassigned, 2) << "its step 1 of 2 samples";
  EXPECT_EQ(job_->Run().epochs[0].dead, std::set<int>{1});
  EXPECT_THAT(job_->aggregator()->Progress().waiting_for, ElementsAre(0, 2));
  EXPECT_EQ(job_->aggregator()->Progress().num_steps, 3) << "its part of step 1: a step more";
  for (int step : {1, 2}) {
    auto* a1 = Push(0, 0, step, step == 1 ? 2 : 1);
    Push(2, 0, step, step == 1 ? 2 : 1);
    ASSERT_TRUE(a1->has_value());
    ASSERT_THAT(**a1, IsOk());
    EXPECT_EQ((**a1)->global_samples, step == 1 ? 4 : 2);
  }
}

TEST(PoisonTest, AnUpdateThatOverflowsKeepsTheParametersAndEndsTheJob) {
  FakeClock clock;
  JobConfig config;
  config.scheduler.expected_workers = 1;
  config.scheduler.epochs = 1;
  config.scheduler.global_batch = 2;
  config.optimizer.sgd = SgdConfig{1e30, 0.0, 0.0, false};
  auto job = *TrainingJob::Create(config, &clock);
  ASSERT_THAT(job->scheduler()->Register({"a", 4, 1, "cpu"}), IsOk());
  ASSERT_THAT(job->store()->Register({{"w", {1}}}, std::vector<float>{1.0f}), IsOk());
  std::optional<absl::StatusOr<StepResult>> r;
  job->aggregator()->Push({0, 0, 0, 2, 1.0, std::vector<float>{1e10f}},
                          [&r](const absl::StatusOr<StepResult>& x) { r = x; });
  ASSERT_TRUE(r.has_value());
  EXPECT_THAT(*r, StatusIs(absl::StatusCode::kDataLoss, HasSubstr("non-finite")));
  const absl::StatusOr<ParameterSnapshot> kept = job->store()->Snapshot();
  ASSERT_THAT(kept, IsOk());
  EXPECT_EQ(kept->version, 0);
  EXPECT_EQ((*kept->values)[0], 1.0f);
  ASSERT_TRUE(job->WaitFor(absl::ZeroDuration())) << "the job ended";
  EXPECT_THAT(job->Wait(), StatusCodeIs(absl::StatusCode::kDataLoss));
}

}  // namespace
}  // namespace dbs

namespace dbs {
namespace {

using ::testing::HasSubstr;

// A worker id alone is not a credential (a client pushing as another worker's id is refused),
// and a second process with the same name gets an id of its own, so its gradients are not
// dropped as retries.
TEST(IdentityTest, EveryCallNeedsTheWorkersOwnToken) {
  FakeClock clock;
  std::unique_ptr<Scheduler> scheduler = FixedScheduler(2, 1, 4, &clock);
  Scheduler& s = *scheduler;
  absl::StatusOr<RegistrationResult> a = s.Register({"a", 8, 2, "cpu", "inc-a"});
  absl::StatusOr<RegistrationResult> b = s.Register({"b", 8, 2, "cpu", "inc-b"});
  ASSERT_THAT(a, IsOk());
  ASSERT_THAT(b, IsOk());
  EXPECT_EQ(a->token.size(), 32u);
  EXPECT_NE(a->token, b->token);
  EXPECT_THAT(s.Authenticate(0, a->token), IsOk());
  EXPECT_THAT(s.Authenticate(0, b->token), StatusIs(absl::StatusCode::kPermissionDenied,
                                                    HasSubstr("does not belong to worker 0")));
  EXPECT_THAT(s.Authenticate(0, ""), StatusCodeIs(absl::StatusCode::kUnauthenticated));
  EXPECT_THAT(s.Authenticate(7, a->token), StatusCodeIs(absl::StatusCode::kNotFound));
  // A retried registration of the same process gets the same id and token back.
  absl::StatusOr<RegistrationResult> retry = s.Register({"a", 8, 2, "cpu", "inc-a"});
  ASSERT_THAT(retry, IsOk());
  EXPECT_EQ(retry->worker_id, 0);
  EXPECT_EQ(retry->token, a->token);
  // Another process with a live worker's name is refused.
  EXPECT_THAT(s.Register({"a", 8, 2, "cpu", "inc-other"}),
              StatusIs(absl::StatusCode::kAlreadyExists, HasSubstr("already in the job")));
  // Tokens survive a restart from a checkpoint.
  std::unique_ptr<Scheduler> restored = FixedScheduler(2, 1, 4, &clock);
  restored->LoadState(s.SaveState());
  EXPECT_THAT(restored->Authenticate(1, b->token), IsOk());
}

// GetEpochPlan waiters are capped per worker (uncapped, 5,000 waiting calls took the server
// from 92 to 170 MiB).
TEST(LimitsTest, PlanRequestsWaitingPerWorkerAreCapped) {
  FakeClock clock;
  std::unique_ptr<Scheduler> s = FixedScheduler(2, 1, 4, &clock);
  ASSERT_THAT(s->Register({"a", 8, 2, "cpu"}), IsOk());
  int answered = 0;
  std::optional<absl::Status> refused;
  for (int i = 0; i < kMaxWaitersPerWorker + 3; ++i) {
    s->AwaitPlan(0, 0, [&](const absl::StatusOr<WorkerPlan>& p) {
      if (p.ok()) {
        ++answered;
      } else {
        refused = p.status();
      }
    });
  }
  ASSERT_TRUE(refused.has_value());
  EXPECT_THAT(*refused,
              StatusIs(absl::StatusCode::kResourceExhausted, HasSubstr("plan requests waiting")));
  // The waiting ones are answered once the plan exists.
  ASSERT_THAT(s->Register({"b", 8, 2, "cpu"}), IsOk());
  EXPECT_EQ(answered, kMaxWaitersPerWorker);
}

TEST(LimitsTest, AWithdrawnPlanRequestFreesItsPlaceAndIsNeverAnswered) {
  FakeClock clock;
  std::unique_ptr<Scheduler> s = FixedScheduler(2, 1, 4, &clock);
  ASSERT_THAT(s->Register({"a", 8, 2, "cpu"}), IsOk());
  int answered = 0;
  auto count = [&](const absl::StatusOr<WorkerPlan>& p) { answered += p.ok() ? 1 : 100; };
  // A client that gives up on every call (deadline, dropped connection) many times over:
  // each call's wait is withdrawn, so the cap is never reached and nothing piles up.
  for (int i = 0; i < 10 * kMaxWaitersPerWorker; ++i) {
    const uint64_t wait = s->AwaitPlan(0, 0, count);
    ASSERT_NE(wait, 0u);
    ASSERT_TRUE(s->CancelAwait(wait));
    ASSERT_FALSE(s->CancelAwait(wait));
  }
  const uint64_t kept = s->AwaitPlan(0, 0, count);
  ASSERT_NE(kept, 0u);
  ASSERT_THAT(s->Register({"b", 8, 2, "cpu"}), IsOk());
  EXPECT_EQ(answered, 1) << "only the call still waiting is answered";
  EXPECT_FALSE(s->CancelAwait(kept)) << "too late: it was answered";
}

}  // namespace
}  // namespace dbs
