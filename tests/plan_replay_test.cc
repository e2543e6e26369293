#include "server/plan_replay.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <fstream>
#include <map>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "common/clock.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/batch_allocator.h"
#include "server/run_summary.h"
#include "server/scheduler.h"
#include "tests/status_matchers.h"

namespace dbs {
namespace {

using nlohmann::json;

// Keeps the share policy's decisions, as TrainingJob does for the run's summary.
class DecisionListener : public SchedulerListener {
 public:
  void OnEpochPlanned(int, int, const std::map<int, WorkerPlan>&) override {}
  void OnEpochCompleted(const EpochRecord&) override {}
  void OnJobFinished(const absl::Status&) override {}
  void OnWorkerLeft(int) override {}
  void OnPlanDecision(int epoch, const PlanDecision& decision) override {
    decisions[epoch].Add(decision);
  }
  std::map<int, EpochDecisions> decisions;
};

// A job driven through a real Scheduler: three workers whose step takes overhead + batch / speed
// seconds with a deterministic wobble, re-planned every 8 steps, as the server would.
class RecordedJob {
 public:
  static constexpr int kWindow = 8;

  explicit RecordedJob(PolicyConfig pc) : pc_(pc) {
    SchedulerConfig c;
    c.expected_workers = 3;
    c.epochs = 4;
    c.global_batch = pc.global_batch;
    c.seed = 3;
    scheduler_ = std::make_unique<Scheduler>(c, *MakeSharePolicy(pc), &clock_, &listener_);
    for (const char* name : {"a", "b", "c"}) {
      EXPECT_THAT(scheduler_->Register({name, 2400, 300, "cpu"}), IsOk());
    }
  }

  double StepSeconds(int id, int64_t batch) {
    static constexpr double kOverhead[] = {0.004, 0.002, 0.001};
    static constexpr double kSpeed[] = {1000, 2500, 5000};
    seed_ = seed_ * 6364136223846793005ULL + 1442695040888963407ULL;
    const double wobble = 1.0 + 0.1 * (static_cast<double>(seed_ >> 40) / (1 << 24) - 0.5);
    return (kOverhead[id] + batch / kSpeed[id]) * wobble;
  }

  // Runs every epoch, counting the re-plans asked for and applied.
  void Run() {
    for (int epoch = 0; epoch < 4; ++epoch) {
      std::map<int, Measurement> window;
      for (int step = 0;; ++step) {
        const EpochRecord rec = scheduler_->History()[epoch];
        if (step >= rec.num_steps) break;
        std::map<int, std::pair<int64_t, double>> times;
        for (const auto& [id, steps] : rec.layout) {
          const int64_t b = CountSamples(steps[step]);
          if (b == 0) continue;
          const double t = StepSeconds(id, b);
          times[id] = {b, t};
          Measurement& m = window[id];
          m.samples += b;
          m.steps += 1;
          m.compute_seconds += t;
          m.by_batch[static_cast<int>(b)].Add(t);
        }
        scheduler_->RecordStep(epoch, times);
        if ((step + 1) % kWindow == 0 && step + 1 < rec.num_steps) {
          for (const auto& [id, plan] : rec.plans) window.try_emplace(id);
          absl::StatusOr<PlanChange> r = scheduler_->Rebalance(epoch, step + 1, window);
          ++replans_asked;
          replans_applied += r.ok() ? 1 : 0;
          window.clear();
        }
      }
      const EpochRecord rec = scheduler_->History()[epoch];
      for (const auto& [id, plan] : rec.plans) {
        EpochTiming t;
        t.worker_id = id;
        t.epoch = epoch;
        t.samples = rec.SamplesOf(id);
        t.test_samples = plan.test_range.size();
        t.test_correct = t.test_samples / 2;
        for (const auto& [b, bt] :
             rec.step_times.count(id) ? rec.step_times.at(id) : std::map<int, BatchTime>{}) {
          t.compute_seconds += bt.seconds;
        }
        ASSERT_THAT(scheduler_->Report(t), IsOk());
      }
    }
  }

  // The run's summary, written and read back as text.
  json Summary() const {
    RunInfo run;
    run.policy = PolicyName(pc_.kind);
    run.controller = pc_;
    run.scheduler = scheduler_->config();
    run.workers = scheduler_->Workers();
    run.epochs = scheduler_->History();
    run.decisions = listener_.decisions;
    return json::parse(BuildSummary(run).dump());
  }

  int replans_asked = 0;
  int replans_applied = 0;

 private:
  PolicyConfig pc_;
  FakeClock clock_;
  DecisionListener listener_;
  std::unique_ptr<Scheduler> scheduler_;
  uint64_t seed_ = 11;
};

PolicyConfig Dbs() {
  PolicyConfig pc;
  pc.kind = PolicyKind::kDbs;
  pc.global_batch = 96;
  pc.min_batch = 1;
  return pc;
}

TEST(PlanReplayTest, EveryDecisionOfARunReplaysToTheSameSharesFromItsSummary) {
  RecordedJob job(Dbs());
  ASSERT_NO_FATAL_FAILURE(job.Run());
  ASSERT_GT(job.replans_applied, 0) << "the job must re-plan mid-epoch for this test to mean much";
  const json summary = job.Summary();
  absl::StatusOr<std::vector<RecordedDecision>> decisions = DecisionsOf(summary);
  ASSERT_THAT(decisions, IsOk()) << decisions.status();
  ASSERT_EQ(decisions->size(), 4u + job.replans_asked);
  absl::StatusOr<PolicyConfig> pc = PolicyConfigFromJson(summary.at("controller"));
  ASSERT_THAT(pc, IsOk()) << pc.status();
  auto policy = *MakeSharePolicy(*pc);
  int applied = 0, plans = 0;
  std::map<int, size_t> replans;  // by epoch, so far
  for (const RecordedDecision& d : *decisions) {
    EXPECT_EQ(Replay(*policy, d), d.shares) << "epoch " << d.epoch << " step " << d.from_step;
    plans += d.from_step == 0;
    applied += d.from_step > 0 && d.applied;
    ASSERT_EQ(d.ids, (std::vector<int>{0, 1, 2}));
    EXPECT_EQ(d.observations[0].name, "a");
    // The history: the epochs before, plus for a re-plan the windows of the epoch's re-plans
    // up to this one (the newest 16).
    const size_t windows =
        d.from_step > 0 ? std::min(++replans[d.epoch], Scheduler::kHistoryWindows) : 0;
    EXPECT_EQ(d.observations[0].history.size(), static_cast<size_t>(d.epoch) + windows);
  }
  EXPECT_EQ(plans, 4);
  EXPECT_EQ(applied, job.replans_applied);
  // The replay is the policy's answer, not an echo: the paper's rule answers otherwise.
  PolicyConfig other = *pc;
  other.kind = PolicyKind::kProportional;
  auto proportional = *MakeSharePolicy(other);
  int differ = 0;
  for (const RecordedDecision& d : *decisions) differ += Replay(*proportional, d) != d.shares;
  EXPECT_GT(differ, 0);
}

TEST(PlanReplayTest, EpochsWithoutDecisionsStillGiveTheirMeasurements) {
  RecordedJob job(Dbs());
  ASSERT_NO_FATAL_FAILURE(job.Run());
  json summary = job.Summary();
  const size_t first = summary["epochs"][0]["decisions"].size();
  summary["epochs"][0].erase("decisions");  // as for epochs restored from a checkpoint
  absl::StatusOr<std::vector<RecordedDecision>> decisions = DecisionsOf(summary);
  ASSERT_THAT(decisions, IsOk());
  ASSERT_EQ(decisions->size(), 4u + job.replans_asked - first);
  auto policy = *MakeSharePolicy(Dbs());
  for (const RecordedDecision& d : *decisions) {
    EXPECT_GE(d.epoch, 1);
    EXPECT_EQ(Replay(*policy, d), d.shares);
  }
}

TEST(PlanReplayTest, RoundTripsMeasurementsAndSettings) {
  Measurement m;
  m.samples = 100;
  m.steps = 3;
  m.compute_seconds = 0.1 / 3;
  m.by_batch[32].Add(0.011);
  m.by_batch[36].Add(1.0 / 7);
  absl::StatusOr<Measurement> back = MeasurementFromJson(json::parse(MeasurementJson(m).dump()));
  ASSERT_THAT(back, IsOk());
  EXPECT_EQ(back->samples, 100);
  EXPECT_EQ(back->steps, 3);
  EXPECT_EQ(back->compute_seconds, m.compute_seconds);
  EXPECT_EQ(back->by_batch, m.by_batch);

  PolicyConfig pc;
  pc.kind = PolicyKind::kFixed;
  pc.global_batch = 77;
  pc.noise_margin = 0.5;
  pc.smoothing = 0.25;
  pc.fixed_split = {{"x", 2.0}, {"y:z", 1.0}};
  absl::StatusOr<PolicyConfig> c = PolicyConfigFromJson(json::parse(PolicyConfigJson(pc).dump()));
  ASSERT_THAT(c, IsOk()) << c.status();
  EXPECT_EQ(c->kind, PolicyKind::kFixed);
  EXPECT_EQ(c->global_batch, 77);
  EXPECT_EQ(c->noise_margin, 0.5);
  EXPECT_EQ(c->smoothing, 0.25);
  EXPECT_EQ(c->fixed_split, pc.fixed_split);
}

// A real run (4 workers slowed 8, 8, 4, 2x, B = 128; docs/controller.md): its epoch-4 plan
// read a noise-flat segment of worker 1's curve as cheap samples and moved it from 12 to 5, the
// next window putting it back at 9. The controller now pools segments flatter than noise before
// it moves a worker (StepTimeModelOptions::relative_noise).
TEST(PlanReplayTest, ANoiseFlatSegmentNoLongerMovesAWorkerFarFromARealRun) {
  std::ifstream in("tests/testdata/flat_segment_run_summary.json");
  ASSERT_TRUE(in) << "tests/testdata/flat_segment_run_summary.json";
  std::stringstream text;
  text << in.rdbuf();
  const json summary = json::parse(text.str());
  absl::StatusOr<std::vector<RecordedDecision>> decisions = DecisionsOf(summary);
  ASSERT_THAT(decisions, IsOk()) << decisions.status();
  absl::StatusOr<PolicyConfig> pc = PolicyConfigFromJson(summary.at("controller"));
  ASSERT_THAT(pc, IsOk());
  auto policy = *MakeSharePolicy(*pc);
  const RecordedDecision* plan = nullptr;
  for (const RecordedDecision& d : *decisions) {
    if (d.epoch == 3 && d.from_step == 0) plan = &d;
  }
  ASSERT_NE(plan, nullptr);
  std::vector<int64_t> current;
  for (const WorkerObservation& o : plan->observations) current.push_back(o.current_batch);
  ASSERT_EQ(current, (std::vector<int64_t>{72, 12, 33, 11}));
  ASSERT_EQ(LargestRemainder(128, plan->shares), (std::vector<int64_t>{78, 5, 34, 11}));
  const std::vector<int64_t> now = LargestRemainder(128, Replay(*policy, *plan));
  for (size_t i = 0; i < now.size(); ++i) {
    EXPECT_LE(std::abs(now[i] - current[i]), 3)
        << "worker " << i << ": " << current[i] << " -> " << now[i];
  }
}

// A long epoch re-planned often keeps its plan and the first re-plans, and counts the rest.
TEST(PlanReplayTest, AnEpochKeepsABoundedNumberOfDecisions) {
  SchedulerConfig c;
  c.expected_workers = 2;
  c.epochs = 1;
  c.global_batch = 64;
  FakeClock clock;
  DecisionListener listener;
  PolicyConfig pc;
  pc.kind = PolicyKind::kFixed;
  pc.global_batch = 64;
  Scheduler s(c, *MakeSharePolicy(pc), &clock, &listener);
  ASSERT_THAT(s.Register({"a", 64000, 100, "cpu"}), IsOk());
  ASSERT_THAT(s.Register({"b", 64000, 100, "cpu"}), IsOk());
  Measurement window;
  window.samples = 32;
  window.steps = 1;
  window.compute_seconds = 0.01;
  window.by_batch[32].Add(0.01);
  const int asked = kMaxDecisionsPerEpoch + 6;
  for (int step = 1; step <= asked; ++step) {
    // The fixed split never moves: every re-plan is a decision that kept it.
    EXPECT_THAT(s.Rebalance(0, step, {{0, window}, {1, window}}),
                StatusCodeIs(absl::StatusCode::kFailedPrecondition));
  }
  const EpochDecisions& r = listener.decisions[0];
  ASSERT_EQ(r.kept.size(), static_cast<size_t>(kMaxDecisionsPerEpoch));
  EXPECT_EQ(r.left_out, asked - (kMaxDecisionsPerEpoch - 1));
  EXPECT_EQ(r.kept.front().from_step, 0);
  EXPECT_EQ(r.kept.back().from_step, kMaxDecisionsPerEpoch - 1);
  EXPECT_FALSE(r.kept.back().applied);
}

TEST(PlanReplayTest, MalformedSummariesAreRefusedByField) {
  RecordedJob job(Dbs());
  ASSERT_NO_FATAL_FAILURE(job.Run());
  const json good = job.Summary();
  const auto refused = [](const json& s, const std::string& field) {
    absl::StatusOr<std::vector<RecordedDecision>> d = DecisionsOf(s);
    EXPECT_THAT(d, StatusIs(absl::StatusCode::kInvalidArgument, ::testing::HasSubstr(field)));
  };
  refused(json::array(), "format");
  refused(json{{"format", 1}}, "format");
  json s = good;
  s.erase("worker_info");
  refused(s, "worker_info");
  s = good;
  s["epochs"][1]["decisions"][0]["workers"][0]["id"] = 9;
  refused(s, "no worker 9");
  s = good;
  s["epochs"][1]["decisions"][0]["workers"][1]["current_batch"] = "12";
  refused(s, "current_batch");
  s = good;
  s["epochs"][0]["workers"][0]["measured"]["step_times"][0]["seconds"] = nullptr;
  refused(s, "seconds");
  s = good;
  s["epochs"][1]["decisions"][0]["applied"] = 1;
  refused(s, "applied");
  s = good;
  s["epochs"][0]["workers"][0]["measured"]["step_times"].push_back(
      s["epochs"][0]["workers"][0]["measured"]["step_times"][0]);
  refused(s, "twice");

  json c = good.at("controller");
  c["noise_margin"] = 9.0;
  EXPECT_THAT(PolicyConfigFromJson(c), StatusCodeIs(absl::StatusCode::kInvalidArgument));
  c = good.at("controller");
  c["policy"] = "fastest";
  EXPECT_THAT(PolicyConfigFromJson(c), StatusCodeIs(absl::StatusCode::kInvalidArgument));
  c.erase("policy");
  EXPECT_THAT(PolicyConfigFromJson(c), StatusCodeIs(absl::StatusCode::kInvalidArgument));
}

}  // namespace
}  // namespace dbs
