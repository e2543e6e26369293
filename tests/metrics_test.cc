// Metrics: the Prometheus text of a job's run record and of what the observers heard, and the
// live status with its ETA.
#include "server/metrics.h"

#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace dbs {
namespace {

using ::testing::HasSubstr;

RunInfo TwoWorkerRun() {
  RunInfo run;
  run.policy = "dbs";
  run.scheduler.epochs = 3;
  run.scheduler.expected_workers = 2;
  run.scheduler.global_batch = 64;
  run.workers = {{"fast", 100, 10, "cpu"}, {"slow", 100, 10, "cpu"}};
  run.start = absl::FromUnixSeconds(1000);
  EpochRecord e;
  e.epoch = 0;
  e.start = absl::FromUnixSeconds(1000);
  e.end = absl::FromUnixSeconds(1010);
  e.complete = true;
  e.revision = 2;
  e.num_steps = 4;
  WorkerPlan p0, p1;
  p0.batch_size = 48;
  p0.share = 0.75;
  p1.batch_size = 16;
  p1.share = 0.25;
  e.plans = {{0, p0}, {1, p1}};
  EpochTiming t0, t1;
  t0.worker_id = 0;
  t0.samples = 75;
  t0.compute_seconds = 5.0;
  t0.wait_seconds = 1.0;
  t0.test_samples = 5;
  t0.test_correct = 4;
  t1.worker_id = 1;
  t1.samples = 25;
  t1.compute_seconds = 4.0;
  t1.wait_seconds = 2.0;
  t1.test_samples = 5;
  t1.test_correct = 3;
  e.reports = {{0, t0}, {1, t1}};
  run.epochs = {e};
  run.losses[0] = EpochLoss{50.0, 100, 4};
  return run;
}

TEST(MetricsTest, RendersTheRunAndWhatTheObserversHeard) {
  Metrics m;
  const RunInfo run = TwoWorkerRun();
  StepProgress progress;
  progress.epoch = 1;
  m.Render(run, progress);  // learns the workers' names
  StepStats first, second;
  first.workers = {{0, {10, 0.1}}, {1, {5, 0.2}}};
  second.workers = {{0, {10, 0.125}}, {1, {5, 0.25}}};
  m.OnStep(absl::ZeroDuration(), first);  // an epoch's first step: no wall time
  m.OnStep(absl::Milliseconds(500), second);
  m.OnCheckpoint(absl::Milliseconds(20), true);
  m.OnCall("PushGradientSession", 1000, 2000, 0);
  m.OnCall("PushGradientSession", 10, 0, 7);
  m.OnSharedMemoryWorkers(2);
  m.OnSharedMemoryWorkers(1);
  m.OnSharedAnswerOverGrpc();
  const std::string text = m.Render(run, progress);
  for (const char* line : {
           "dbs_steps_total 2",
           "dbs_step_seconds_count 1",
           "dbs_step_seconds_sum 0.5",
           "dbs_barrier_wait_seconds_total{worker=\"fast\"} 0.375",
           "dbs_barrier_wait_seconds_total{worker=\"slow\"} 0.25",
           "dbs_checkpoint_writes_total 1",
           "dbs_received_bytes_total 1010",
           "dbs_sent_bytes_total 2000",
           "dbs_calls_total{code=\"OK\",method=\"PushGradientSession\"} 1",
           "dbs_refused_calls_total{code=\"PERMISSION_DENIED\",method=\"PushGradientSession\"} 1",
           "dbs_epochs_completed 1",
           "dbs_epoch 2",
           "dbs_last_epoch_seconds 10",
           "dbs_train_loss 0.5",
           "dbs_test_accuracy 0.7",
           "dbs_replans_total 2",
           "dbs_compute_imbalance 1.25",
           "dbs_workers{state=\"joined\"} 2",
           "dbs_worker_batch_size{worker=\"slow\"} 16",
           "dbs_worker_share{worker=\"fast\"} 0.75",
           "dbs_worker_speed_samples_per_second{worker=\"fast\"} 15",
           "dbs_worker_compute_seconds_total{worker=\"slow\"} 4",
           "dbs_worker_wait_seconds_total{worker=\"slow\"} 2",
           "dbs_shared_memory_workers 1",
           "dbs_shared_memory_answers_over_grpc_total 1",
       }) {
    EXPECT_THAT(text, HasSubstr(line));
  }
  // Scraping again does not count the run-derived totals twice.
  EXPECT_THAT(m.Render(run, progress),
              HasSubstr("dbs_worker_compute_seconds_total{worker=\"slow\"} 4"));
}

TEST(MetricsTest, StatusSaysWhereTheJobStandsWithAnEta) {
  const RunInfo run = TwoWorkerRun();
  StepProgress progress;
  progress.epoch = 1;  // the second of three
  progress.step = 1;
  progress.num_steps = 4;
  const nlohmann::json s = Metrics::Status(run, progress, absl::FromUnixSeconds(1012));
  EXPECT_EQ(s["live"]["epoch"], 2);
  EXPECT_DOUBLE_EQ(s["live"]["elapsed_seconds"].get<double>(), 12.0);
  // 10 s per epoch: 3/4 of this one and one more.
  EXPECT_DOUBLE_EQ(s["live"]["eta_seconds"].get<double>(), 17.5);
  EXPECT_EQ(s["policy"], "dbs");
}

}  // namespace
}  // namespace dbs
