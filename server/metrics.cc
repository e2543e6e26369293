#include "server/metrics.h"

#include <algorithm>
#include <limits>
#include <sstream>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "prometheus/text_serializer.h"

namespace dbs {
namespace {

using prometheus::BuildCounter;
using prometheus::BuildGauge;
using prometheus::BuildHistogram;
using prometheus::Histogram;

// Sets a counter derived from the run record to `value` (it only ever grows).
void AdvanceTo(prometheus::Counter& c, double value) {
  if (value > c.Value()) c.Increment(value - c.Value());
}

Histogram::BucketBoundaries SecondsBuckets() {
  return {0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120};
}

prometheus::Family<prometheus::Counter>& CounterFamily(prometheus::Registry& r,
                                                       const std::string& name,
                                                       const std::string& help) {
  return BuildCounter().Name(name).Help(help).Register(r);
}

prometheus::Family<prometheus::Gauge>& GaugeFamily(prometheus::Registry& r, const std::string& name,
                                                   const std::string& help) {
  return BuildGauge().Name(name).Help(help).Register(r);
}

// An unlabelled histogram of durations in seconds.
Histogram& SecondsHistogram(prometheus::Registry& r, const std::string& name,
                            const std::string& help) {
  return BuildHistogram().Name(name).Help(help).Register(r).Add({}, SecondsBuckets());
}

// The status code's name, as gRPC and Abseil spell it ("PERMISSION_DENIED").
std::string CodeName(int code) {
  return absl::StatusCodeToString(static_cast<absl::StatusCode>(code));
}

}  // namespace

Metrics::Metrics()
    : registry_(std::make_shared<prometheus::Registry>()),
      step_seconds_(
          SecondsHistogram(*registry_, "dbs_step_seconds",
                           "Wall time of a synchronous step, from the previous step's end")),
      barrier_wait_(CounterFamily(*registry_, "dbs_barrier_wait_seconds_total",
                                  "Time a worker's step waited at the barrier for slower "
                                  "workers (step wall time minus its compute)")),
      checkpoint_writes_(
          CounterFamily(*registry_, "dbs_checkpoint_writes_total", "Checkpoints written").Add({})),
      checkpoint_failures_(CounterFamily(*registry_, "dbs_checkpoint_failures_total",
                                         "Checkpoints that could not be written")
                               .Add({})),
      checkpoint_seconds_(
          SecondsHistogram(*registry_, "dbs_checkpoint_seconds", "Time to write a checkpoint")),
      received_bytes_(CounterFamily(*registry_, "dbs_received_bytes_total",
                                    "Request bytes received by the gRPC services")
                          .Add({})),
      sent_bytes_(
          CounterFamily(*registry_, "dbs_sent_bytes_total", "Reply bytes sent by the gRPC services")
              .Add({})),
      calls_(CounterFamily(*registry_, "dbs_calls_total",
                           "gRPC calls answered, by method and status code")),
      refused_(CounterFamily(*registry_, "dbs_refused_calls_total",
                             "gRPC calls answered with an error, by method and status code")),
      steps_(CounterFamily(*registry_, "dbs_steps_total",
                           "Synchronous steps completed by this process")
                 .Add({})),
      shared_memory_workers_(
          GaugeFamily(*registry_, "dbs_shared_memory_workers",
                      "Workers on this host whose steps pass through memory shared with dbs_ps")
              .Add({})),
      shared_answers_over_grpc_(
          CounterFamily(*registry_, "dbs_shared_memory_answers_over_grpc_total",
                        "Answers a sharing worker asked for in shared memory that went over gRPC "
                        "(the version was not in the parameter slots)")
              .Add({})),
      epochs_completed_(
          GaugeFamily(*registry_, "dbs_epochs_completed", "Epochs completed").Add({})),
      epoch_(GaugeFamily(*registry_, "dbs_epoch",
                         "The epoch in progress (1-based; the last one once the job is over)")
                 .Add({})),
      epoch_seconds_(
          GaugeFamily(*registry_, "dbs_last_epoch_seconds", "Wall time of the last completed epoch")
              .Add({})),
      train_loss_(GaugeFamily(*registry_, "dbs_train_loss",
                              "Mean training loss of the last completed epoch")
                      .Add({})),
      test_accuracy_(GaugeFamily(*registry_, "dbs_test_accuracy",
                                 "Test accuracy after the last completed epoch")
                         .Add({})),
      workers_(GaugeFamily(*registry_, "dbs_workers",
                           "Workers by state: alive (in the current epoch), evicted (removed as "
                           "dead, left or quarantined), quarantined (removed for a faulty "
                           "gradient), joined (ever registered)")),
      replans_(CounterFamily(*registry_, "dbs_replans_total",
                             "Re-plans of an epoch's remaining steps (rebalancing and evictions)")
                   .Add({})),
      faulty_(CounterFamily(*registry_, "dbs_faulty_gradients_total",
                            "Pushes whose gradient was found faulty (--faulty_gradients): "
                            "quarantined, or only logged")
                  .Add({})),
      imbalance_(GaugeFamily(*registry_, "dbs_compute_imbalance",
                             "Slowest worker's compute time over the fastest's, last epoch")
                     .Add({})),
      batch_(GaugeFamily(*registry_, "dbs_worker_batch_size",
                         "The worker's batch size in the current epoch's plan")),
      share_(GaugeFamily(*registry_, "dbs_worker_share",
                         "The worker's share of the current epoch's samples")),
      speed_(GaugeFamily(*registry_, "dbs_worker_speed_samples_per_second",
                         "The worker's measured compute speed in its last reported epoch")),
      compute_(CounterFamily(*registry_, "dbs_worker_compute_seconds_total",
                             "Compute time the worker reported, over completed epochs")),
      wait_(CounterFamily(*registry_, "dbs_worker_wait_seconds_total",
                          "Time the worker reported waiting on the server, over completed "
                          "epochs")) {}

void Metrics::OnStep(absl::Duration wall, const StepStats& stats) {
  steps_.Increment();
  if (wall <= absl::ZeroDuration()) return;  // an epoch's first step: no previous end
  const double w = absl::ToDoubleSeconds(wall);
  step_seconds_.Observe(w);
  absl::MutexLock lock(&names_mu_);
  for (const auto& [id, reported] : stats.workers) {
    const double waited = std::max(0.0, w - reported.second);
    auto name = names_.find(id);
    if (name == names_.end()) {
      unnamed_wait_[id] += waited;  // labelled by name at the next scrape
    } else {
      barrier_wait_.Add({{"worker", name->second}}).Increment(waited);
    }
  }
}

void Metrics::OnCheckpoint(absl::Duration took, bool ok) {
  (ok ? checkpoint_writes_ : checkpoint_failures_).Increment();
  checkpoint_seconds_.Observe(absl::ToDoubleSeconds(took));
}

void Metrics::OnCall(const char* method, size_t received, size_t sent, int code) {
  received_bytes_.Increment(static_cast<double>(received));
  sent_bytes_.Increment(static_cast<double>(sent));
  calls_.Add({{"method", method}, {"code", CodeName(code)}}).Increment();
  if (code != 0) refused_.Add({{"method", method}, {"code", CodeName(code)}}).Increment();
}

void Metrics::OnSharedMemoryWorkers(int workers) { shared_memory_workers_.Set(workers); }

void Metrics::OnSharedAnswerOverGrpc() { shared_answers_over_grpc_.Increment(); }

std::string Metrics::WorkerLabel(const RunInfo& run, int id) {
  return id >= 0 && id < static_cast<int>(run.workers.size()) ? run.workers[id].name
                                                              : absl::StrCat("id", id);
}

void Metrics::NameWorkers(const RunInfo& run) {
  absl::MutexLock lock(&names_mu_);
  for (size_t id = 0; id < run.workers.size(); ++id) names_[id] = run.workers[id].name;
  for (auto it = unnamed_wait_.begin(); it != unnamed_wait_.end();) {
    auto name = names_.find(it->first);
    if (name == names_.end()) {
      ++it;
      continue;
    }
    barrier_wait_.Add({{"worker", name->second}}).Increment(it->second);
    it = unnamed_wait_.erase(it);
  }
}

void Metrics::SetFromRun(const RunInfo& run, const StepProgress& progress) {
  NameWorkers(run);
  int completed = 0;
  int revisions = 0;
  std::set<int> removed;
  std::map<int, double> compute_total, wait_total;
  for (const EpochRecord& r : run.epochs) {
    completed += r.complete ? 1 : 0;
    revisions += r.revision;
    removed.insert(r.dead.begin(), r.dead.end());
    for (const auto& [id, t] : r.reports) {
      compute_total[id] += t.compute_seconds;
      wait_total[id] += t.wait_seconds;
    }
  }
  epochs_completed_.Set(completed);
  epoch_.Set(progress.epoch + 1);
  AdvanceTo(replans_, revisions);
  AdvanceTo(faulty_, static_cast<double>(run.faulty_pushes));
  workers_.Add({{"state", "quarantined"}}).Set(static_cast<double>(run.quarantined.size()));
  workers_.Add({{"state", "joined"}}).Set(static_cast<double>(run.workers.size()));
  workers_.Add({{"state", "evicted"}}).Set(static_cast<double>(removed.size()));
  workers_.Add({{"state", "alive"}})
      .Set(run.epochs.empty() ? 0.0
                              : static_cast<double>(run.epochs.back().plans.size() -
                                                    run.epochs.back().dead.size()));
  for (const auto& [id, seconds] : compute_total) {
    AdvanceTo(compute_.Add({{"worker", WorkerLabel(run, id)}}), seconds);
  }
  for (const auto& [id, seconds] : wait_total) {
    AdvanceTo(wait_.Add({{"worker", WorkerLabel(run, id)}}), seconds);
  }
  if (!run.epochs.empty()) {
    for (const auto& [id, plan] : run.epochs.back().plans) {
      batch_.Add({{"worker", WorkerLabel(run, id)}}).Set(plan.batch_size);
      share_.Add({{"worker", WorkerLabel(run, id)}}).Set(plan.share);
    }
  }
  // The last complete epoch: its time, loss, accuracy, speeds and balance.
  for (auto r = run.epochs.rbegin(); r != run.epochs.rend(); ++r) {
    if (!r->complete) continue;
    epoch_seconds_.Set(absl::ToDoubleSeconds(r->end - r->start));
    auto loss = run.losses.find(r->epoch);
    if (loss != run.losses.end()) train_loss_.Set(loss->second.mean());
    test_accuracy_.Set(TestAccuracy(*r));
    double lo = std::numeric_limits<double>::infinity(), hi = 0.0;
    for (const auto& [id, t] : r->reports) {
      if (t.compute_seconds <= 0) continue;
      speed_.Add({{"worker", WorkerLabel(run, id)}})
          .Set(static_cast<double>(t.samples) / t.compute_seconds);
      lo = std::min(lo, t.compute_seconds);
      hi = std::max(hi, t.compute_seconds);
    }
    if (hi > 0) imbalance_.Set(hi / lo);
    break;
  }
}

std::string Metrics::Render(const RunInfo& run, const StepProgress& progress) {
  absl::MutexLock lock(&render_mu_);
  SetFromRun(run, progress);
  std::ostringstream out;
  prometheus::TextSerializer().Serialize(out, registry_->Collect());
  return out.str();
}

nlohmann::json Metrics::Status(const RunInfo& run, const StepProgress& progress, absl::Time now) {
  nlohmann::json s = BuildSummary(run);
  // While the job runs it has no outcome yet: "running"; then "ok" or the error that ended it.
  if (!run.finished) s["status"] = "running";
  s["state"] = !run.finished ? "running" : run.status == "ok" ? "finished" : "failed";
  nlohmann::json live;
  live["epoch"] = progress.epoch + 1;
  live["step"] = progress.step;
  live["num_steps"] = progress.num_steps;
  live["waiting_for"] = progress.waiting_for;
  live["elapsed_seconds"] = absl::ToDoubleSeconds(now - run.start);
  // ETA from the pace so far: completed epochs' mean time for each one left, the current one
  // by its remaining fraction.
  double epoch_seconds = 0.0;
  int complete = 0;
  for (const EpochRecord& r : run.epochs) {
    if (!r.complete) continue;
    epoch_seconds += absl::ToDoubleSeconds(r.end - r.start);
    ++complete;
  }
  if (complete > 0) {
    const double per_epoch = epoch_seconds / complete;
    const double left_in_epoch =
        progress.num_steps > 0
            ? 1.0 - static_cast<double>(progress.step) / static_cast<double>(progress.num_steps)
            : 0.0;
    const int epochs_after = std::max(0, run.scheduler.epochs - (progress.epoch + 1));
    live["eta_seconds"] = per_epoch * (epochs_after + std::max(0.0, left_in_epoch));
  } else {
    live["eta_seconds"] = nullptr;
  }
  s["live"] = live;
  return s;
}

}  // namespace dbs
