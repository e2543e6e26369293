#include "server/run_summary.h"

#include <algorithm>
#include <cstdio>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "server/plan_replay.h"

namespace dbs {
namespace {

double Seconds(absl::Time a, absl::Time b) { return absl::ToDoubleSeconds(b - a); }

struct Spread {
  double min = 0.0, max = 0.0;
  double ratio() const { return min > 0 ? max / min : 0.0; }
};

// Over the workers that trained on samples: one given batch 0 (its overhead alone would make it
// the slowest) computes nothing and is not an imbalance.
Spread ComputeSpread(const EpochRecord& r) {
  Spread s;
  bool first = true;
  for (const auto& [id, t] : r.reports) {
    if (t.samples <= 0) continue;
    if (first) {
      s.min = s.max = t.compute_seconds;
      first = false;
    }
    s.min = std::min(s.min, t.compute_seconds);
    s.max = std::max(s.max, t.compute_seconds);
  }
  return s;
}

double TestLoss(const EpochRecord& r) {
  double loss = 0.0;
  int64_t n = 0;
  for (const auto& [id, t] : r.reports) {
    loss += t.test_loss_sum;
    n += t.test_samples;
  }
  return n > 0 ? loss / n : 0.0;
}

}  // namespace

SampleAudit AuditEpoch(const EpochRecord& record, const std::set<std::pair<int, int>>& accepted,
                       int64_t samples) {
  std::vector<uint8_t> hits(static_cast<size_t>(std::max<int64_t>(samples, 0)), 0);
  SampleAudit a;
  a.samples = samples;
  for (const auto& [worker, step] : accepted) {
    auto it = record.layout.find(worker);
    if (it == record.layout.end() || step >= static_cast<int>(it->second.size())) continue;
    for (const SampleRange& r : it->second[step]) {
      for (int64_t i = std::max<int64_t>(0, r.begin); i < std::min(r.end, samples); ++i) {
        if (hits[i] < 2) ++hits[i];
      }
    }
  }
  for (uint8_t h : hits) {
    if (h == 0) ++a.missing;
    if (h == 1) ++a.used_once;
    if (h > 1) ++a.duplicated;
  }
  return a;
}

double TestAccuracy(const EpochRecord& r) {
  int64_t correct = 0, n = 0;
  for (const auto& [id, t] : r.reports) {
    correct += t.test_correct;
    n += t.test_samples;
  }
  return n > 0 ? static_cast<double>(correct) / n : 0.0;
}

namespace {

using nlohmann::json;

json WorkerInfo(const std::vector<WorkerRegistration>& workers) {
  json out = json::array();
  for (size_t id = 0; id < workers.size(); ++id) {
    const WorkerRegistration& w = workers[id];
    out.push_back({{"id", id},
                   {"name", w.name},
                   {"device", w.device},
                   {"cpu_limit_cores", w.cpu_limit_cores},
                   {"train_samples", w.train_samples},
                   {"test_samples", w.test_samples}});
  }
  return out;
}

json AuditJson(const SampleAudit& a) {
  return {{"samples", a.samples},
          {"used_once", a.used_once},
          {"missing", a.missing},
          {"duplicated", a.duplicated},
          {"every_sample_once", a.ok()}};
}

// Each planned worker of the epoch: its plan and report, or that it died.
json EpochWorkers(const EpochRecord& r) {
  json out = json::array();
  for (const auto& [id, plan] : r.plans) {
    auto report = r.reports.find(id);
    if (report == r.reports.end()) {
      out.push_back(
          {{"id", id}, {"dead", true}, {"share", plan.share}, {"batch_size", plan.batch_size}});
      continue;
    }
    const EpochTiming& t = report->second;
    // The step times the controller balanced, as the server observed them (compute and the
    // worker's own communication).
    double step_seconds = 0.0;
    if (auto st = r.step_times.find(id); st != r.step_times.end()) {
      for (const auto& [batch, bt] : st->second) step_seconds += bt.seconds;
    }
    out.push_back({{"id", id},
                   {"step_seconds", step_seconds},
                   {"share", plan.share},
                   {"batch_size", plan.batch_size},
                   {"final_batch_size", plan.final_batch_size},
                   {"samples", t.samples},
                   {"compute_seconds", t.compute_seconds},
                   {"wait_seconds", t.wait_seconds},
                   {"eval_seconds", t.eval_seconds},
                   {"test_samples", t.test_samples},
                   {"test_correct", t.test_correct},
                   {"measured", MeasurementJson(MeasurementOf(r, id).value_or(Measurement{}))}});
  }
  return out;
}

json EpochJson(const RunInfo& run, const EpochRecord& r) {
  json e;
  e["epoch"] = r.epoch;
  e["wall_seconds"] = Seconds(r.start, r.end);
  // From the plan to the last step's update: training alone, without validation and reports.
  e["train_seconds"] = r.steps_end > r.start ? Seconds(r.start, r.steps_end) : 0.0;
  e["start_seconds"] = Seconds(run.start, r.start);
  auto loss = run.losses.find(r.epoch);
  e["train_loss"] = loss == run.losses.end() ? 0.0 : loss->second.mean();
  e["steps"] = r.num_steps;
  e["revisions"] = r.revision;
  e["dead_workers"] = std::vector<int>(r.dead.begin(), r.dead.end());
  auto audit = run.audits.find(r.epoch);
  if (audit != run.audits.end()) e["audit"] = AuditJson(audit->second);
  e["test_accuracy"] = TestAccuracy(r);
  e["test_loss"] = TestLoss(r);
  e["compute_seconds_max_over_min"] = ComputeSpread(r).ratio();
  e["workers"] = EpochWorkers(r);
  json decisions = json::array();
  int left_out = 0;
  if (auto d = run.decisions.find(r.epoch); d != run.decisions.end()) {
    for (const PlanDecision& p : d->second.kept) decisions.push_back(DecisionJson(p));
    left_out = d->second.left_out;
  }
  e["decisions"] = std::move(decisions);
  e["decisions_left_out"] = left_out;
  return e;
}

}  // namespace

nlohmann::json BuildSummary(const RunInfo& run) {
  json out;
  out["format"] = "dbs.run_summary.v1";
  out["status"] = run.status;
  out["policy"] = run.policy;
  out["optimizer"] = run.optimizer;
  out["workers"] = run.scheduler.expected_workers;
  out["epochs_planned"] = run.scheduler.epochs;
  out["global_batch"] = run.scheduler.global_batch;
  out["seed"] = run.scheduler.seed;
  out["controller"] = PolicyConfigJson(run.controller);
  out["worker_info"] = WorkerInfo(run.workers);
  json epochs = json::array();
  double final_accuracy = 0.0, final_loss = 0.0;
  for (const EpochRecord& r : run.epochs) {
    if (!r.complete) continue;
    epochs.push_back(EpochJson(run, r));
    final_accuracy = TestAccuracy(r);
    final_loss = TestLoss(r);
  }
  out["epochs_completed"] = epochs.size();
  out["epochs"] = std::move(epochs);
  out["final_test_accuracy"] = final_accuracy;
  out["final_test_loss"] = final_loss;
  out["wall_seconds"] = Seconds(run.start, run.end);
  json quarantined = json::array();
  for (const Quarantine& q : run.quarantined) {
    quarantined.push_back({{"id", q.worker_id},
                           {"epoch", q.epoch},
                           {"step", q.step},
                           {"reason", q.reason},
                           {"samples_reassigned", q.samples_reassigned}});
  }
  out["quarantined"] = std::move(quarantined);
  out["faulty_pushes"] = run.faulty_pushes;
  return out;
}

std::string EpochLine(const RunInfo& run, const EpochRecord& r) {
  std::vector<std::string> batches, compute, wait;
  for (const auto& [id, plan] : r.plans) {
    batches.push_back(absl::StrCat(plan.batch_size));
    auto t = r.reports.find(id);
    compute.push_back(t == r.reports.end() ? "-"
                                           : absl::StrFormat("%.2f", t->second.compute_seconds));
    wait.push_back(t == r.reports.end() ? "-" : absl::StrFormat("%.2f", t->second.wait_seconds));
  }
  auto loss = run.losses.find(r.epoch);
  const double elapsed = Seconds(run.start, r.end);
  const int done = r.epoch + 1;
  const double eta = done > 0 ? elapsed / done * (run.scheduler.epochs - done) : 0.0;
  return absl::StrFormat(
      "epoch %d/%d done in %.1f s | train loss %.4f | test acc %.2f%% loss %.4g | ETA %.0f s | "
      "batch [%s] compute s [%s] wait s [%s]",
      done, run.scheduler.epochs, Seconds(r.start, r.end),
      loss == run.losses.end() ? 0.0 : loss->second.mean(), 100.0 * TestAccuracy(r), TestLoss(r),
      eta, absl::StrJoin(batches, " "), absl::StrJoin(compute, " "), absl::StrJoin(wait, " "));
}

std::string HumanSummary(const RunInfo& run) {
  std::string out =
      absl::StrFormat("dbs run summary: policy=%s, %d workers, global batch %d, %s\n", run.policy,
                      run.scheduler.expected_workers, run.scheduler.global_batch, run.optimizer);
  int completed = 0;
  const EpochRecord* last = nullptr;
  for (const EpochRecord& r : run.epochs) {
    if (!r.complete) continue;
    ++completed;
    last = &r;
  }
  absl::StrAppendFormat(&out, "  status: %s\n  epochs: %d of %d, wall time %.1f s\n", run.status,
                        completed, run.scheduler.epochs, Seconds(run.start, run.end));
  for (const Quarantine& q : run.quarantined) {
    absl::StrAppendFormat(&out,
                          "  quarantined: worker %d at epoch %d step %d (%s); its %d samples went "
                          "to the others\n",
                          q.worker_id, q.epoch + 1, q.step + 1, q.reason, q.samples_reassigned);
  }
  if (last != nullptr) {
    absl::StrAppendFormat(&out, "  final test accuracy: %.2f%%, test loss %.6g\n",
                          100.0 * TestAccuracy(*last), TestLoss(*last));
    absl::StrAppendFormat(&out, "  last epoch compute time max/min across workers: %.2f\n",
                          ComputeSpread(*last).ratio());
    for (const auto& [id, plan] : last->plans) {
      auto report = last->reports.find(id);
      if (report == last->reports.end()) {
        absl::StrAppendFormat(&out, "  worker %d: removed as dead during the epoch\n", id);
        continue;
      }
      const EpochTiming& t = report->second;
      const std::string name =
          id < static_cast<int>(run.workers.size()) ? run.workers[id].name : "?";
      absl::StrAppendFormat(&out,
                            "  worker %d (%s): batch %d (share %.3f), compute %.2f s, "
                            "wait %.2f s, eval %.2f s\n",
                            id, name, plan.batch_size, plan.share, t.compute_seconds,
                            t.wait_seconds, t.eval_seconds);
    }
  }
  return out;
}

}  // namespace dbs
