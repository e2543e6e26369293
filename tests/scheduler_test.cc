#include "server/scheduler.h"

#include <cmath>
#include <limits>
#include <optional>
#include <vector>

#include "common/secrets.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/status_matchers.h"

namespace dbs {
namespace {

using ::testing::HasSubstr;

class RecordingListener : public SchedulerListener {
 public:
  void OnEpochPlanned(int epoch, int num_steps, const std::map<int, WorkerPlan>&) override {
    planned.push_back(epoch);
    steps = num_steps;
  }
  void OnEpochCompleted(const EpochRecord& r) override { completed.push_back(r.epoch); }
  void OnJobFinished(const absl::Status& s) override { finished = s; }
  void OnWorkerLeft(int id) override { left.push_back(id); }

  std::vector<int> planned, completed, left;
  int steps = 0;
  std::optional<absl::Status> finished;
};

struct PlanBox {
  std::optional<absl::StatusOr<WorkerPlan>> plan;
  Scheduler::PlanCallback callback() {
    return [this](const absl::StatusOr<WorkerPlan>& p) { plan = p; };
  }
};

class SchedulerTest : public ::testing::Test {
 protected:
  std::unique_ptr<Scheduler> Make(const std::string& policy, int workers = 3, int epochs = 2) {
    SchedulerConfig c;
    c.expected_workers = workers;
    c.epochs = epochs;
    c.global_batch = 64;
    c.seed = 7;
    return std::make_unique<Scheduler>(c, Policy(policy), &clock_, &listener_);
  }
  static std::unique_ptr<SharePolicy> Policy(const std::string& name, int global_batch = 64) {
    PolicyConfig pc;
    pc.kind = *ParsePolicy(name);
    pc.global_batch = global_batch;
    return *MakeSharePolicy(pc);
  }
  static WorkerRegistration Reg(const std::string& name, int64_t train = 6400) {
    return WorkerRegistration{name, train, 1000, "cpu"};
  }
  // Reports `plan` with compute time = samples / speed.
  static EpochTiming Report(const WorkerPlan& plan, int id, double speed) {
    EpochTiming t;
    t.worker_id = id;
    t.epoch = plan.epoch;
    t.samples = CountSamples(plan.train_ranges);
    t.compute_seconds = t.samples / speed;
    t.test_samples = plan.test_range.size();
    t.test_correct = t.test_samples / 2;
    return t;
  }

  FakeClock clock_;
  RecordingListener listener_;
};

// With StartWithAcceptedModels (dbs_ps), a worker counts toward the start once its model is
// accepted: one refused for its model (which leaves) is not a member, and the job waits for
// another, not for the worker timeout.
TEST_F(SchedulerTest, TheJobStartsWithTheWorkersWhoseModelsWereAccepted) {
  auto s = Make("dbs", /*workers=*/2);
  s->StartWithAcceptedModels();
  const int a = s->Register(Reg("a"))->worker_id;
  const int b = s->Register(Reg("b"))->worker_id;
  EXPECT_TRUE(listener_.planned.empty()) << "registered, but no model accepted yet";
  ASSERT_THAT(s->ModelAccepted(a), IsOk());
  EXPECT_EQ(s->WorkersReady(), 1);
  ASSERT_THAT(s->Leave(b), IsOk());  // its model was refused
  EXPECT_TRUE(listener_.planned.empty());
  const int c = s->Register(Reg("c"))->worker_id;
  ASSERT_THAT(s->ModelAccepted(c), IsOk());
  ASSERT_EQ(listener_.planned, std::vector<int>{0});
  PlanBox pa, pb;
  s->AwaitPlan(a, 0, pa.callback());
  ASSERT_TRUE(pa.plan.has_value());
  ASSERT_THAT(*pa.plan, IsOk());
  EXPECT_EQ((*pa.plan)->batch_size, 32) << "the global batch split between a and c";
  s->AwaitPlan(b, 0, pb.callback());
  ASSERT_TRUE(pb.plan.has_value());
  EXPECT_FALSE(pb.plan->ok()) << "b left before the start and has no plan";
  EXPECT_THAT(s->ModelAccepted(99), StatusCodeIs(absl::StatusCode::kNotFound));
}

// Without it (the domain's own default), the expected registrations start the job; one that
// left before the start does not count.
TEST_F(SchedulerTest, AWorkerThatLeftBeforeTheStartIsNotCounted) {
  auto s = Make("dbs", /*workers=*/3);
  s->Register(Reg("a")).IgnoreError();
  const int x = s->Register(Reg("x"))->worker_id;
  ASSERT_THAT(s->Leave(x), IsOk());
  s->Register(Reg("b")).IgnoreError();
  EXPECT_TRUE(listener_.planned.empty()) << "three registered, but one of them left";
  s->Register(Reg("c")).IgnoreError();
  EXPECT_EQ(listener_.planned, std::vector<int>{0});
}

TEST_F(SchedulerTest, PlansWaitForAllWorkersThenSplitEqually) {
  auto s = Make("dbs");
  ASSERT_EQ(s->Register(Reg("a"))->worker_id, 0);
  PlanBox p0;
  s->AwaitPlan(0, 0, p0.callback());
  EXPECT_FALSE(p0.plan.has_value()) << "epoch 0 must wait for all three workers";
  ASSERT_EQ(s->Register(Reg("b"))->worker_id, 1);
  ASSERT_EQ(s->Register(Reg("c"))->worker_id, 2);
  ASSERT_TRUE(p0.plan.has_value() && p0.plan->ok());
  EXPECT_EQ((*p0.plan)->batch_size, 22);  // 64 / 3 -> 22, 21, 21
  EXPECT_EQ((*p0.plan)->num_steps, 100);
  EXPECT_EQ(listener_.planned, std::vector<int>{0});
}

TEST_F(SchedulerTest, KeepsEachWorkersCpuLimitForReports) {
  auto s = Make("dbs");
  WorkerRegistration limited = Reg("limited");
  limited.cpu_limit_cores = 0.25;
  ASSERT_THAT(s->Register(limited), IsOk());
  ASSERT_THAT(s->Register(Reg("free")), IsOk());
  EXPECT_EQ(s->Workers()[0].cpu_limit_cores, 0.25);
  EXPECT_EQ(s->Workers()[1].cpu_limit_cores, 0.0);
}

TEST_F(SchedulerTest, RegistrationIsIdempotentByNameAndChecksTheDataSet) {
  auto s = Make("dbs");
  EXPECT_EQ(s->Register(Reg("a"))->worker_id, 0);
  EXPECT_EQ(s->Register(Reg("a"))->worker_id, 0);
  EXPECT_THAT(s->Register(Reg("b", 999)), StatusCodeIs(absl::StatusCode::kFailedPrecondition));
  EXPECT_THAT(s->Register(Reg("")), StatusCodeIs(absl::StatusCode::kInvalidArgument));
  // A CPU limit a peer declares is a number of cores, or 0 for none.
  for (double bad : {-1.0, std::nan(""), std::numeric_limits<double>::infinity(), 1e9}) {
    WorkerRegistration r = Reg("limited");
    r.cpu_limit_cores = bad;
    EXPECT_THAT(s->Register(r), StatusCodeIs(absl::StatusCode::kInvalidArgument)) << bad;
  }
  EXPECT_EQ(s->Register(Reg("b"))->worker_id, 1);
  EXPECT_EQ(s->Register(Reg("c"))->worker_id, 2);
  // A fourth worker joins the running job from the next epoch.
  auto d = s->Register(Reg("d"));
  ASSERT_THAT(d, IsOk()) << d.status();
  EXPECT_EQ(d->worker_id, 3);
  EXPECT_EQ(d->start_epoch, 1);
  EXPECT_EQ(s->Register(Reg("b"))->start_epoch, 0);
}

TEST_F(SchedulerTest, WithATokenKeyEachWorkersTokenIsSignedForItsId) {
  auto s = Make("dbs", 3);
  const std::string key = TokenKeyFromSecret("the-job-secret");
  s->SetTokenKey(key);
  auto a = s->Register(Reg("a"));
  auto b = s->Register(Reg("b"));
  ASSERT_THAT(a, IsOk());
  ASSERT_THAT(b, IsOk());
  EXPECT_TRUE(IsIssuedWorkerToken(key, 0, a->token));
  EXPECT_TRUE(IsIssuedWorkerToken(key, 1, b->token));
  EXPECT_FALSE(IsIssuedWorkerToken(key, 1, a->token));
  EXPECT_THAT(s->Authenticate(0, a->token), IsOk());
  // Signed for its id is not enough: the call must carry the token issued to that worker.
  EXPECT_THAT(s->Authenticate(0, IssueWorkerToken(key, 0)),
              StatusCodeIs(absl::StatusCode::kPermissionDenied));
}

// Under mutual TLS the token is bound to the certificate the worker registered with: replayed
// over a connection with another certificate it is refused, and so is the name.
TEST_F(SchedulerTest, ATokenWorksOnlyWithTheCertificateItsWorkerRegisteredWith) {
  auto s = Make("dbs", 3);
  WorkerRegistration a = Reg("a");
  a.identity = "cert-a";
  absl::StatusOr<RegistrationResult> r = s->Register(a);
  ASSERT_THAT(r, IsOk());
  EXPECT_THAT(s->Authenticate(0, r->token, "cert-a"), IsOk());
  EXPECT_THAT(s->Authenticate(0, r->token, "cert-b"),
              StatusIs(absl::StatusCode::kPermissionDenied,
                       HasSubstr("issued to another client certificate")));
  EXPECT_THAT(s->Authenticate(0, r->token), StatusCodeIs(absl::StatusCode::kPermissionDenied));
  WorkerRegistration thief = a;
  thief.identity = "cert-b";
  EXPECT_THAT(s->Register(thief), StatusIs(absl::StatusCode::kPermissionDenied,
                                           HasSubstr("another client certificate")));
  absl::StatusOr<RegistrationResult> again = s->Register(a);
  ASSERT_THAT(again, IsOk());
  EXPECT_EQ(again->token, r->token) << "its own retry gets the same token";
  // Without mutual TLS nothing is bound.
  absl::StatusOr<RegistrationResult> b = s->Register(Reg("b"));
  ASSERT_THAT(b, IsOk());
  EXPECT_THAT(s->Authenticate(1, b->token, "cert-b"), IsOk());
}

// A late joiner that never asks for its plan (it died, or it was never going to train) is not
// planned: planned, it would hold the epoch's first step for the worker timeout.
TEST_F(SchedulerTest, AnIdleLateJoinerIsNotPlanned) {
  SchedulerConfig c;
  c.expected_workers = 1;
  c.epochs = 3;
  c.global_batch = 64;
  c.registration_idle = absl::Seconds(60);
  Scheduler s(c, Policy("fixed"), &clock_, &listener_);
  ASSERT_THAT(s.Register(Reg("a")), IsOk());
  ASSERT_THAT(s.Register(Reg("idle")), IsOk());
  ASSERT_THAT(s.Register(Reg("waiting")), IsOk());
  PlanBox waiting;
  s.AwaitPlan(2, 1, waiting.callback());
  clock_.Advance(absl::Seconds(61));
  ASSERT_THAT(s.Report(Report(s.History()[0].plans.at(0), 0, 1000)), IsOk());
  const EpochRecord next = s.History()[1];
  EXPECT_EQ(next.plans.count(0), 1u);
  EXPECT_EQ(next.plans.count(1), 0u) << "idle for a minute: dropped";
  EXPECT_EQ(next.plans.count(2), 1u) << "its plan request waited";
  EXPECT_FALSE(s.IsRegistered(1));
  ASSERT_TRUE(waiting.plan.has_value() && waiting.plan->ok());
}

TEST_F(SchedulerTest, AWorkerJoiningMidJobGetsAShareFromTheNextEpoch) {
  auto s = Make("dbs", 2, 3);
  ASSERT_THAT(s->Register(Reg("a")), IsOk());
  ASSERT_THAT(s->Register(Reg("b")), IsOk());
  auto late = s->Register(Reg("late"));
  ASSERT_THAT(late, IsOk());
  EXPECT_EQ(late->start_epoch, 1);
  PlanBox not_yet, plan;
  s->AwaitPlan(2, 0, not_yet.callback());
  EXPECT_THAT(not_yet.plan->status(), StatusCodeIs(absl::StatusCode::kNotFound));
  s->AwaitPlan(2, 1, plan.callback());
  EXPECT_FALSE(plan.plan.has_value()) << "waits for epoch 1 like everyone else";
  const auto h = s->History();
  // A report for the epoch it was not in is refused, saying why, and changes nothing.
  EpochTiming stray = Report(h[0].plans.at(0), 0, 100);
  stray.worker_id = 2;
  const absl::Status refused = s->Report(stray);
  EXPECT_THAT(refused, StatusCodeIs(absl::StatusCode::kFailedPrecondition));
  EXPECT_THAT(std::string(refused.message()), ::testing::HasSubstr("was not in epoch 0's plan"));
  EXPECT_TRUE(s->History()[0].reports.empty());
  ASSERT_THAT(s->Report(Report(h[0].plans.at(0), 0, 100)), IsOk());
  ASSERT_THAT(s->Report(Report(h[0].plans.at(1), 1, 300)), IsOk());
  ASSERT_TRUE(plan.plan.has_value() && plan.plan->ok());
  // Speeds 100 and 300, the newcomer unmeasured: it is given the mean (200): 100:300:200,
  // in whole samples of 64.
  EXPECT_NEAR((*plan.plan)->share, 200.0 / 600, 1.0 / 64);
  EXPECT_EQ(s->History()[1].plans.size(), 3u);
  int64_t total = 0;
  for (int id = 0; id < 3; ++id) total += s->History()[1].SamplesOf(id);
  EXPECT_EQ(total, 6400);
}

TEST_F(SchedulerTest, ProportionalRebalancesBySpeedAndFinishes) {
  auto s = Make("proportional");
  for (const char* n : {"a", "b", "c"}) ASSERT_THAT(s->Register(Reg(n)), IsOk());
  std::vector<WorkerPlan> e0;
  for (int id = 0; id < 3; ++id) {
    PlanBox b;
    s->AwaitPlan(id, 0, b.callback());
    e0.push_back(**b.plan);
  }
  // Worker 2 is three times slower.
  const double speeds[] = {300, 300, 100};
  PlanBox next;
  ASSERT_THAT(s->Report(Report(e0[0], 0, speeds[0])), IsOk());
  s->AwaitPlan(0, 1, next.callback());
  EXPECT_FALSE(next.plan.has_value());
  clock_.Advance(absl::Seconds(10));
  ASSERT_THAT(s->Report(Report(e0[1], 1, speeds[1])), IsOk());
  ASSERT_THAT(s->Report(Report(e0[2], 2, speeds[2])), IsOk());
  ASSERT_TRUE(next.plan.has_value() && next.plan->ok());
  EXPECT_EQ(listener_.completed, std::vector<int>{0});
  std::vector<WorkerPlan> e1;
  for (int id = 0; id < 3; ++id) {
    PlanBox b;
    s->AwaitPlan(id, 1, b.callback());
    e1.push_back(**b.plan);
  }
  // Shares 3:3:1 of 64 -> 27.43, 27.43, 9.14 -> 28, 27, 9 (largest remainder).
  EXPECT_EQ(e1[0].batch_size + e1[1].batch_size + e1[2].batch_size, 64);
  EXPECT_EQ(e1[2].batch_size, 9);
  EXPECT_NEAR(e1[2].share, 1.0 / 7, 1e-9);
  EXPECT_EQ(e1[0].train_ranges[0], (SampleRange{0, 28}));
  EXPECT_EQ(e1[2].train_ranges[0], (SampleRange{55, 64}));
  EXPECT_EQ(e1[2].train_ranges.back(), (SampleRange{6391, 6400}));
  EXPECT_EQ(CountSamples(e1[2].train_ranges), 900);
  EXPECT_NE(e1[0].permutation_seed, e0[0].permutation_seed);
  EXPECT_EQ(s->History()[0].end - s->History()[0].start, absl::Seconds(10));

  PlanBox done;
  for (int id = 0; id < 3; ++id) ASSERT_THAT(s->Report(Report(e1[id], id, speeds[id])), IsOk());
  s->AwaitPlan(1, 2, done.callback());
  ASSERT_TRUE(done.plan->ok());
  EXPECT_TRUE((*done.plan)->finished);
  ASSERT_TRUE(listener_.finished.has_value());
  EXPECT_TRUE(listener_.finished->ok());

  // A worker restarted after the end (its orchestrator saw it fail) learns the job is done and
  // joins nothing: no id, no token, nobody added.
  const int active = s->active_workers();
  absl::StatusOr<RegistrationResult> late = s->Register(Reg("restarted-after-the-end"));
  ASSERT_THAT(late, IsOk());
  EXPECT_TRUE(late->job_finished);
  EXPECT_EQ(late->worker_id, -1);
  EXPECT_TRUE(late->token.empty());
  EXPECT_EQ(late->start_epoch, 2);
  EXPECT_EQ(s->active_workers(), active);
  EXPECT_FALSE(s->IsRegistered(3));
}

TEST_F(SchedulerTest, FixedPolicyIgnoresSpeed) {
  auto s = Make("fixed", 2, 2);
  ASSERT_THAT(s->Register(Reg("a")), IsOk());
  ASSERT_THAT(s->Register(Reg("b")), IsOk());
  const auto h = s->History();
  ASSERT_THAT(s->Report(Report(h[0].plans.at(0), 0, 1000)), IsOk());
  ASSERT_THAT(s->Report(Report(h[0].plans.at(1), 1, 10)), IsOk());
  EXPECT_EQ(s->History()[1].plans.at(0).batch_size, 32);
  EXPECT_EQ(s->History()[1].plans.at(1).batch_size, 32);
}

TEST_F(SchedulerTest, AFixedSplitByNameHoldsFromTheFirstEpochAndRefusesStrangers) {
  SchedulerConfig c;
  c.expected_workers = 3;
  c.epochs = 2;
  c.global_batch = 64;
  PolicyConfig pc;
  pc.kind = PolicyKind::kFixed;
  pc.global_batch = 64;
  pc.fixed_split = {{"fast", 3}, {"slow", 1}, {"idle", 0}};
  Scheduler s(c, *MakeSharePolicy(pc), &clock_, &listener_);
  const absl::StatusOr<RegistrationResult> stranger = s.Register(Reg("stranger"));
  EXPECT_THAT(stranger, StatusCodeIs(absl::StatusCode::kFailedPrecondition));
  EXPECT_THAT(std::string(stranger.status().message()), ::testing::HasSubstr("--fixed_split"));
  EXPECT_TRUE(s.History().empty());
  // Registered in another order than the split names them: ids 0, 1, 2 are slow, idle, fast.
  for (const char* n : {"slow", "idle", "fast"}) ASSERT_THAT(s.Register(Reg(n)), IsOk());
  for (int epoch = 0; epoch < 2; ++epoch) {
    const auto h = s.History();
    ASSERT_EQ(h.size(), static_cast<size_t>(epoch + 1));
    EXPECT_EQ(h[epoch].plans.at(0).batch_size, 16);
    EXPECT_EQ(h[epoch].plans.at(1).batch_size, 0);
    EXPECT_EQ(h[epoch].plans.at(2).batch_size, 48);
    EXPECT_EQ(h[epoch].SamplesOf(0) + h[epoch].SamplesOf(2), 6400) << "every sample once";
    if (epoch == 1) break;
    // The slow worker reports itself 100 times faster: the split does not move.
    for (int id = 0; id < 3; ++id) {
      ASSERT_THAT(s.Report(Report(h[0].plans.at(id), id, id == 0 ? 1e5 : 1000)), IsOk());
    }
  }
}

TEST_F(SchedulerTest, BadReportsAreRefusedAndChangeNothing) {
  auto s = Make("dbs", 2, 2);
  ASSERT_THAT(s->Register(Reg("a")), IsOk());
  ASSERT_THAT(s->Register(Reg("b")), IsOk());
  const WorkerPlan p0 = s->History()[0].plans.at(0);
  EpochTiming t = Report(p0, 0, 100);
  EpochTiming unknown = t;
  unknown.worker_id = 9;
  EXPECT_THAT(s->Report(unknown), StatusCodeIs(absl::StatusCode::kNotFound));
  EpochTiming future = t;
  future.epoch = 1;
  EXPECT_THAT(s->Report(future), StatusCodeIs(absl::StatusCode::kFailedPrecondition));
  EpochTiming wrong_samples = t;
  wrong_samples.samples += 1;
  EXPECT_THAT(s->Report(wrong_samples), StatusCodeIs(absl::StatusCode::kInvalidArgument));
  EpochTiming negative = t;
  negative.compute_seconds = -1;
  EXPECT_THAT(s->Report(negative), StatusCodeIs(absl::StatusCode::kInvalidArgument));
  EXPECT_TRUE(s->History()[0].reports.empty());
  ASSERT_THAT(s->Report(t), IsOk());
  EXPECT_THAT(s->Report(t), IsOk()) << "an identical retry is accepted once";
  EpochTiming changed = t;
  changed.compute_seconds += 1;
  EXPECT_THAT(s->Report(changed), StatusCodeIs(absl::StatusCode::kAlreadyExists));
  EXPECT_EQ(s->History()[0].reports.size(), 1u);
}

TEST_F(SchedulerTest, PlanRequestsAreCheckedAndRepeatable) {
  auto s = Make("dbs", 1, 3);
  PlanBox unknown;
  s->AwaitPlan(4, 0, unknown.callback());
  EXPECT_THAT(unknown.plan->status(), StatusCodeIs(absl::StatusCode::kNotFound));
  ASSERT_THAT(s->Register(Reg("a")), IsOk());
  PlanBox first, again, too_far, unreported;
  s->AwaitPlan(0, 0, first.callback());
  s->AwaitPlan(0, 0, again.callback());
  EXPECT_EQ((*first.plan)->train_ranges, (*again.plan)->train_ranges);
  s->AwaitPlan(0, 2, too_far.callback());
  EXPECT_THAT(too_far.plan->status(), StatusCodeIs(absl::StatusCode::kFailedPrecondition));
  s->AwaitPlan(0, 1, unreported.callback());
  EXPECT_THAT(unreported.plan->status(), StatusCodeIs(absl::StatusCode::kFailedPrecondition));
}

TEST_F(SchedulerTest, LeavingMidJobTellsTheListenerAndIsNotPlannedAgain) {
  // (Until issue 8, leaving mid-job aborted the whole job.)
  auto s = Make("dbs", 2, 2);
  ASSERT_THAT(s->Register(Reg("a")), IsOk());
  ASSERT_THAT(s->Register(Reg("b")), IsOk());
  ASSERT_THAT(s->Report(Report(s->History()[0].plans.at(0), 0, 100)), IsOk());
  PlanBox waiting;
  s->AwaitPlan(0, 1, waiting.callback());
  EXPECT_FALSE(waiting.plan.has_value());
  ASSERT_THAT(s->Leave(1), IsOk());
  EXPECT_THAT(listener_.left, ::testing::ElementsAre(1));
  EXPECT_FALSE(listener_.finished.has_value()) << "the job goes on";
  // Worker 1 never reports epoch 0; once it is dropped, epoch 1 is planned for worker 0 alone.
  ASSERT_THAT(s->DropUnreported(0, {1}), IsOk());
  ASSERT_TRUE(waiting.plan.has_value());
  ASSERT_THAT(*waiting.plan, IsOk());
  EXPECT_EQ((*waiting.plan)->share, 1.0);
  EXPECT_EQ(s->History()[1].plans.count(1), 0u);
  EXPECT_THAT(s->Leave(5), StatusCodeIs(absl::StatusCode::kNotFound));
  EXPECT_EQ(s->removed_workers_not_back(), 0) << "a worker that left is not coming back";
}

// The server lingers after the end for workers removed while cut off (PsServer::Shutdown):
// each counts until its name registers again, before or after the end.
TEST_F(SchedulerTest, WorkersRemovedForSilenceCountUntilTheyCallAgain) {
  auto s = Make("dbs", 3, 1);
  for (const char* n : {"a", "b", "c"}) ASSERT_THAT(s->Register(Reg(n)), IsOk());
  ASSERT_THAT(s->Report(Report(s->History()[0].plans.at(0), 0, 100)), IsOk());
  ASSERT_THAT(s->DropUnreported(0, {1, 2}), IsOk());
  ASSERT_TRUE(listener_.finished.has_value()) << "the job ended with its only report";
  EXPECT_EQ(s->removed_workers_not_back(), 2);
  absl::StatusOr<RegistrationResult> b = s->Register(Reg("b"));
  ASSERT_THAT(b, IsOk());
  EXPECT_TRUE(b->job_finished);
  EXPECT_EQ(s->removed_workers_not_back(), 1) << "c has not called";
  ASSERT_THAT(s->Register(Reg("a stranger")), IsOk());
  EXPECT_EQ(s->removed_workers_not_back(), 1);
}

}  // namespace
}  // namespace dbs

#include "server/run_summary.h"

namespace dbs {
namespace {

TEST_F(SchedulerTest, RemovingADeadWorkerKeepsEverySampleExactlyOnce) {
  // 3 workers, 1000 samples, B = 64: 16 steps (15 full + 40).
  SchedulerConfig c;
  c.expected_workers = 3;
  c.epochs = 2;
  c.global_batch = 64;
  Scheduler s(c, Policy("dbs"), &clock_, &listener_);
  for (const char* n : {"a", "b", "c"}) ASSERT_THAT(s.Register({n, 1000, 100, "cpu"}), IsOk());
  // Worker 1 dies during step 5 (it pushed steps 0-4).
  auto removal = s.RemoveWorkers({1}, 0, 5);
  ASSERT_THAT(removal, IsOk()) << removal.status();
  const EpochRecord rec = s.History()[0];
  EXPECT_EQ(rec.num_steps, 17) << "one extra step for worker 1's part of step 5";
  EXPECT_EQ(rec.dead, std::set<int>{1});
  ASSERT_EQ(removal->revisions.size(), 2u);
  EXPECT_EQ(removal->revisions.at(0).from_step, 6);
  EXPECT_EQ(removal->revisions.at(0).num_steps, 17);
  EXPECT_EQ(removal->later_quotas.size(), 11u);  // steps 6 ... 16
  for (size_t k = 0; k + 1 < removal->later_quotas.size(); ++k) {
    const auto& q = removal->later_quotas[k];
    EXPECT_EQ(q.count(1), 0u);
    EXPECT_EQ(q.at(0) + q.at(2), k + 6 == 15 ? 40 : 64) << "step " << k + 6;
  }
  EXPECT_EQ(removal->later_quotas.back().at(0) + removal->later_quotas.back().at(2), 21)
      << "worker 1's 21 samples of step 5";
  // The pushes that will have been accepted: worker 1 for steps 0-4, the others for all steps.
  std::set<std::pair<int, int>> accepted;
  for (int step = 0; step < 17; ++step) {
    accepted.insert({0, step});
    accepted.insert({2, step});
    if (step < 5) accepted.insert({1, step});
  }
  const SampleAudit audit = AuditEpoch(rec, accepted, 1000);
  EXPECT_TRUE(audit.ok()) << audit.missing << " missing, " << audit.duplicated << " duplicated";
  // Without the extra step the audit would notice the hole.
  accepted.erase({0, 16});
  accepted.erase({2, 16});
  EXPECT_EQ(AuditEpoch(rec, accepted, 1000).missing, 21);
  // Test slices: the survivors now cover the whole test set.
  EXPECT_EQ(removal->revisions.at(0).test_range.begin, 0);
  EXPECT_EQ(removal->revisions.at(2).test_range.end, 100);
  // The dead worker is no longer a member; the survivors' reports complete the epoch.
  EXPECT_FALSE(s.IsRegistered(1));
  for (int id : {0, 2}) {
    EpochTiming t;
    t.worker_id = id;
    t.epoch = 0;
    t.samples = rec.SamplesOf(id);
    t.compute_seconds = 1.0;
    t.test_samples = removal->revisions.at(id).test_range.size();
    ASSERT_THAT(s.Report(t), IsOk());
  }
  ASSERT_EQ(s.History().size(), 2u);
  EXPECT_EQ(s.History()[1].plans.size(), 2u) << "epoch 1 is planned for the survivors only";
  EXPECT_THAT(s.RemoveWorkers({0, 2}, 1, 0), StatusCodeIs(absl::StatusCode::kFailedPrecondition));
}

}  // namespace
}  // namespace dbs

namespace dbs {
namespace {

// Records what the scheduler tells the policy, and answers with fixed shares.
class RecordingPolicy : public SharePolicy {
 public:
  PolicyKind kind() const override { return PolicyKind::kDbs; }
  std::vector<double> NextShares(absl::Span<const WorkerObservation> workers) const override {
    seen->assign(workers.begin(), workers.end());
    return *shares;
  }
  std::shared_ptr<std::vector<WorkerObservation>> seen =
      std::make_shared<std::vector<WorkerObservation>>();
  std::shared_ptr<std::vector<double>> shares =
      std::make_shared<std::vector<double>>(std::vector<double>{0.75, 0.25});
};

TEST_F(SchedulerTest, ThePolicySeesEachWorkersStepTimesByBatch) {
  SchedulerConfig c;
  c.expected_workers = 2;
  c.epochs = 3;
  c.global_batch = 64;
  auto policy = std::make_unique<RecordingPolicy>();
  auto seen = policy->seen;
  auto shares = policy->shares;
  Scheduler s(c, std::move(policy), &clock_, &listener_);
  ASSERT_THAT(s.Register(Reg("a", 640)), IsOk());
  ASSERT_THAT(s.Register(Reg("b", 640)), IsOk());
  // Epoch 0: 10 steps of 32 each; worker 1 takes 3 ms a step, worker 0 1 ms.
  for (int step = 0; step < 10; ++step) s.RecordStep(0, {{0, {32, 0.001}}, {1, {32, 0.003}}});
  s.RecordStep(0, {{7, {32, 1.0}}, {1, {0, 1.0}}, {0, {32, -1.0}}});  // unknown, empty, bad
  s.RecordStep(5, {{0, {32, 1.0}}});                                  // not running
  const auto h = s.History();
  ASSERT_THAT(s.Report(Report(h[0].plans.at(0), 0, 32000)), IsOk());
  // Worker 1 says it computed the epoch in 0.3 us: the server's timing of its steps stands.
  ASSERT_THAT(s.Report(Report(h[0].plans.at(1), 1, 1e9)), IsOk());
  ASSERT_EQ(seen->size(), 2u);
  const WorkerObservation& w1 = (*seen)[1];
  EXPECT_EQ(w1.current_batch, 32);
  EXPECT_DOUBLE_EQ(w1.previous_share, 0.5);
  ASSERT_EQ(w1.history.size(), 1u);
  EXPECT_EQ(w1.history[0].samples, 320);
  EXPECT_EQ(w1.history[0].steps, 10);
  ASSERT_EQ(w1.history[0].by_batch.size(), 1u);
  EXPECT_EQ(w1.history[0].by_batch.at(32).steps, 10);
  EXPECT_NEAR(w1.history[0].by_batch.at(32).seconds, 0.030, 1e-12);
  EXPECT_NEAR(w1.history[0].compute_seconds, 0.030, 1e-12) << "observed, not reported";
  EXPECT_EQ(s.History()[1].plans.at(0).batch_size, 48);

  // Mid-epoch: the window joins the history as the newest measurement, and the rest of the
  // epoch is re-split by the policy's answer.
  Measurement window;
  window.samples = 4 * 16;
  window.steps = 4;
  window.compute_seconds = 0.004;
  window.by_batch[16] = {4, 0.004};
  std::map<int, Measurement> windows = {{0, window}, {1, window}};
  *shares = {0.5, 0.5};
  absl::StatusOr<PlanChange> r = s.Rebalance(1, 4, windows);
  ASSERT_THAT(r, IsOk()) << r.status();
  EXPECT_EQ((*seen)[1].history.size(), 2u);
  EXPECT_EQ((*seen)[1].current_batch, 16);
  EXPECT_EQ(r->later_quotas.front().at(0), 32);
  EXPECT_EQ(r->revisions.at(1).from_step, 4);
  // A window that leaves the split as it is changes nothing.
  EXPECT_THAT(s.Rebalance(1, 5, windows), StatusCodeIs(absl::StatusCode::kFailedPrecondition));
  EXPECT_THAT(s.Rebalance(1, 4, {{0, window}}), StatusCodeIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(s.Rebalance(1, 10, windows), StatusCodeIs(absl::StatusCode::kFailedPrecondition));
}

}  // namespace
}  // namespace dbs

namespace dbs {
namespace {

// A worker's run of steps without a sample (idle) and with at most one (out), counted back
// from a step through the epochs before, as the dbs policy's probes read them.
TEST(IdleRunTest, CountsTheNewestStepsWithoutASampleAndWithAtMostOne) {
  auto epoch = [](std::vector<std::vector<int>> batches) {
    EpochRecord r;
    for (size_t id = 0; id < batches.size(); ++id) {
      StepRanges steps;
      for (int b : batches[id]) {
        steps.push_back(b > 0 ? std::vector<SampleRange>{{0, b}} : std::vector<SampleRange>{});
      }
      r.layout[static_cast<int>(id)] = steps;
    }
    return r;
  };
  std::vector<EpochRecord> records = {epoch({{4, 4, 4, 2}, {4, 4, 4, 4}}),
                                      epoch({{1, 0, 0, 1}, {4, 4, 4, 4}}),
                                      epoch({{0, 0, 0, 0}, {4, 4, 4, 4}})};
  // Worker 0 before step 3 of epoch 2: 3 idle steps there, 1 more before its probe of one sample
  // in epoch 1, whose steps run out to the 2 samples at the end of epoch 0.
  IdleRun run = IdleRunOf(records, 0, 2, 3, 16);
  EXPECT_EQ(run.idle_steps, 3);
  EXPECT_EQ(run.out_steps, 7);
  run = IdleRunOf(records, 0, 2, 1000, 16);  // past the last step: the whole epoch
  EXPECT_EQ(run.idle_steps, 4);
  EXPECT_EQ(run.out_steps, 8);
  EXPECT_EQ(IdleRunOf(records, 0, 2, 4, 1).out_steps, 4);   // one epoch looked at
  EXPECT_EQ(IdleRunOf(records, 1, 2, 4, 16).out_steps, 0);  // it computes now
  // A step it was not in (a worker that joined since, or was removed) ends the run.
  records[1].dead.insert(0);
  EXPECT_EQ(IdleRunOf(records, 0, 2, 4, 16).out_steps, 4);
  records[1].layout.erase(1);
  EXPECT_EQ(IdleRunOf(records, 1, 2, 0, 16).out_steps, 0);
  EXPECT_EQ(IdleRunOf(records, 2, 2, 4, 16).out_steps, 0);
}

}  // namespace
}  // namespace dbs
