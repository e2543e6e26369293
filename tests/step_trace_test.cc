// StepTrace: a JSON line per completed step, flushed at each epoch's end; a restored job appends.
#include "server/step_trace.h"

#include <fstream>
#include <string>
#include <vector>

#include "common/clock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tests/status_matchers.h"

namespace dbs {
namespace {

using ::testing::HasSubstr;

std::vector<nlohmann::json> Lines(const std::string& path) {
  std::ifstream in(path);
  std::vector<nlohmann::json> out;
  for (std::string line; std::getline(in, line);) out.push_back(nlohmann::json::parse(line));
  return out;
}

std::unique_ptr<StepTrace> MustOpen(const std::string& path, bool append, const Clock* clock) {
  absl::StatusOr<std::unique_ptr<StepTrace>> trace = StepTrace::Open(path, append, clock);
  EXPECT_THAT(trace.status(), IsOk());
  return trace.ok() ? std::move(*trace) : nullptr;
}

StepStats Step(int epoch, int step, bool last) {
  StepStats s;
  s.epoch = epoch;
  s.step = step;
  s.last_of_epoch = last;
  s.loss_sum = 12.0;
  s.samples = 8;
  s.workers = {{0, {6, 0.03}}, {3, {2, 0.01}}};
  s.cycle = {{0, 0.035}};  // worker 3's step began before the server saw it (a restore)
  return s;
}

TEST(StepTraceTest, WritesEachStepAndFlushesAtTheEpochsEnd) {
  const std::string path = ::testing::TempDir() + "/trace.jsonl";
  FakeClock clock;
  clock.Advance(absl::Seconds(1000));
  std::unique_ptr<StepTrace> trace = MustOpen(path, false, &clock);
  ASSERT_NE(trace, nullptr);
  trace->OnStep(absl::ZeroDuration(), Step(2, 0, false));
  clock.Advance(absl::Milliseconds(40));
  trace->OnStep(absl::Milliseconds(40), Step(2, 1, true));
  const std::vector<nlohmann::json> lines = Lines(path);  // flushed: the epoch ended
  ASSERT_EQ(lines.size(), 2u);
  const nlohmann::json& l = lines[1];
  EXPECT_EQ(l.at("epoch"), 2);
  EXPECT_EQ(l.at("step"), 1);
  EXPECT_DOUBLE_EQ(l.at("time").get<double>(),
                   absl::ToDoubleSeconds(clock.Now() - absl::UnixEpoch()));
  EXPECT_DOUBLE_EQ(l.at("wall_seconds").get<double>(), 0.04);
  EXPECT_EQ(l.at("samples"), 8);
  EXPECT_DOUBLE_EQ(l.at("loss").get<double>(), 1.5);
  ASSERT_EQ(l.at("workers").size(), 2u);
  EXPECT_EQ(l.at("workers")[0].at("id"), 0);
  EXPECT_EQ(l.at("workers")[0].at("samples"), 6);
  EXPECT_DOUBLE_EQ(l.at("workers")[0].at("compute_seconds").get<double>(), 0.03);
  EXPECT_DOUBLE_EQ(l.at("workers")[0].at("step_seconds").get<double>(), 0.035);
  EXPECT_EQ(l.at("workers")[1].at("id"), 3);
  EXPECT_FALSE(l.at("workers")[1].contains("step_seconds"));
}

TEST(StepTraceTest, ARestoredJobAppendsAFreshOneStartsOver) {
  const std::string path = ::testing::TempDir() + "/trace_restored.jsonl";
  FakeClock clock;
  {
    auto trace = MustOpen(path, false, &clock);
    ASSERT_NE(trace, nullptr);
    trace->OnStep(absl::ZeroDuration(), Step(0, 0, false));
  }  // closed: flushed
  {
    auto trace = MustOpen(path, /*append=*/true, &clock);
    ASSERT_NE(trace, nullptr);
    trace->OnStep(absl::ZeroDuration(), Step(0, 1, false));
  }
  ASSERT_EQ(Lines(path).size(), 2u);
  {
    auto trace = MustOpen(path, false, &clock);
    ASSERT_NE(trace, nullptr);
    trace->OnStep(absl::ZeroDuration(), Step(1, 0, true));
  }
  const std::vector<nlohmann::json> lines = Lines(path);
  ASSERT_EQ(lines.size(), 1u);
  EXPECT_EQ(lines[0].at("epoch"), 1);
}

TEST(StepTraceTest, NoPathNoTraceAndAnUnwritableOneIsAnError) {
  FakeClock clock;
  absl::StatusOr<std::unique_ptr<StepTrace>> none = StepTrace::Open("", false, &clock);
  ASSERT_THAT(none.status(), IsOk());
  EXPECT_EQ(*none, nullptr);
  EXPECT_THAT(StepTrace::Open("/nonexistent-dir/trace.jsonl", false, &clock),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("--step_trace_path: cannot write /nonexistent-dir/trace.jsonl")));
}

}  // namespace
}  // namespace dbs
