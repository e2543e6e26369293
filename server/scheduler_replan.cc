// The Scheduler's changes to a running epoch's plan: workers removed at a step, mid-epoch
// re-plans, and the step times they are made from.
#include <algorithm>
#include <cmath>
#include <utility>

#include "absl/strings/str_cat.h"
#include "server/scheduler.h"

namespace dbs {

absl::StatusOr<PlanChange> Scheduler::RemoveWorkers(const std::set<int>& dead, int epoch,
                                                    int step) {
  absl::MutexLock lock(&mu_);
  if (!aborted_.ok()) return aborted_;
  if (epoch < 0 || epoch >= static_cast<int>(records_.size()) || records_[epoch].complete) {
    return absl::FailedPreconditionError(absl::StrCat("epoch ", epoch, " is not running"));
  }
  EpochRecord& rec = records_[epoch];
  std::vector<int> survivors;
  std::vector<double> shares;
  for (const auto& [id, plan] : rec.plans) {
    if (rec.dead.count(id) == 0 && dead.count(id) == 0) {
      survivors.push_back(id);
      shares.push_back(plan.share > 0 ? plan.share : 1e-9);
    }
  }
  if (survivors.empty()) {
    return absl::FailedPreconditionError("every worker of the epoch is gone");
  }
  // The dead workers' part of the current step was never trained on: it becomes an extra step.
  std::vector<SampleRange> orphaned;
  for (int id : dead) {
    auto it = rec.layout.find(id);
    if (it != rec.layout.end() && step < static_cast<int>(it->second.size())) {
      orphaned.insert(orphaned.end(), it->second[step].begin(), it->second[step].end());
    }
  }
  PlanChange out = ResplitLocked(rec, survivors, shares, step + 1, std::move(orphaned));
  for (int id : dead) {
    auto it = rec.layout.find(id);
    if (it != rec.layout.end()) {
      for (size_t s = static_cast<size_t>(step); s < it->second.size(); ++s) it->second[s].clear();
    }
    rec.dead.insert(id);
    table_.MarkRemoved(id);
  }
  return out;
}

WorkerObservation Scheduler::ReplanObservationLocked(const EpochRecord& rec, int id, int from_step,
                                                     const Measurement& window) const {
  WorkerObservation o = HistoryLocked(id, rec.epoch);
  o.previous_share = rec.plans.at(id).share;
  const StepRanges& steps = rec.layout.at(id);
  o.current_batch = from_step - 1 < static_cast<int>(steps.size())
                        ? static_cast<int>(CountSamples(steps[from_step - 1]))
                        : 0;
  auto earlier = rec.windows.find(id);
  if (earlier != rec.windows.end()) {
    o.history.insert(o.history.end(), earlier->second.begin(), earlier->second.end());
  }
  o.history.push_back(window);
  const IdleRun run = IdleRunOf(records_, id, rec.epoch, from_step, kHistoryEpochs);
  o.idle_steps = run.idle_steps;
  o.out_steps = run.out_steps;
  return o;
}

absl::StatusOr<PlanChange> Scheduler::Rebalance(int epoch, int from_step,
                                                const std::map<int, Measurement>& window) {
  absl::MutexLock lock(&mu_);
  if (!aborted_.ok()) return aborted_;
  if (epoch < 0 || epoch >= static_cast<int>(records_.size()) || records_[epoch].complete) {
    return absl::FailedPreconditionError(absl::StrCat("epoch ", epoch, " is not running"));
  }
  EpochRecord& rec = records_[epoch];
  if (from_step < 1 || from_step >= rec.num_steps) {
    return absl::FailedPreconditionError("no step left to re-plan");
  }
  std::vector<int> workers;
  std::vector<WorkerObservation> obs;
  std::vector<int> current;
  for (const auto& [id, plan] : rec.plans) {
    if (rec.dead.count(id) > 0) continue;
    auto w = window.find(id);
    if (w == window.end()) {
      return absl::InvalidArgumentError(absl::StrCat("no measurement of worker ", id));
    }
    workers.push_back(id);
    obs.push_back(ReplanObservationLocked(rec, id, from_step, w->second));
    current.push_back(obs.back().current_batch);
  }
  const std::vector<double> shares = policy_->NextShares(obs);
  for (size_t k = 0; k < workers.size(); ++k) {
    std::vector<Measurement>& windows = rec.windows[workers[k]];
    windows.push_back(obs[k].history.back());
    if (windows.size() > kHistoryWindows) windows.erase(windows.begin());
  }
  const bool keep = LargestRemainder(config_.global_batch, shares) ==
                    std::vector<int64_t>(current.begin(), current.end());
  if (listener_ != nullptr) {
    PlanDecision decision;
    decision.from_step = from_step;
    decision.applied = !keep;
    for (size_t k = 0; k < workers.size(); ++k) {
      decision.workers.push_back({workers[k], obs[k].current_batch, obs[k].previous_share, true,
                                  obs[k].history.back(), k < shares.size() ? shares[k] : 0.0,
                                  obs[k].idle_steps, obs[k].out_steps});
    }
    listener_->OnPlanDecision(epoch, decision);
  }
  if (keep) return absl::FailedPreconditionError("the policy keeps the current split");
  for (size_t k = 0; k < workers.size(); ++k) rec.plans[workers[k]].share = shares[k];
  return ResplitLocked(rec, workers, shares, from_step, {});
}

void Scheduler::RecordStep(int epoch, const std::map<int, std::pair<int64_t, double>>& times) {
  absl::MutexLock lock(&mu_);
  if (epoch < 0 || epoch >= static_cast<int>(records_.size()) || records_[epoch].complete) return;
  EpochRecord& rec = records_[epoch];
  rec.steps_end = clock_->Now();
  for (const auto& [id, t] : times) {
    if (rec.plans.count(id) == 0 || rec.dead.count(id) > 0 || t.first <= 0 ||
        !std::isfinite(t.second) || t.second < 0) {
      continue;
    }
    rec.step_times[id][static_cast<int>(t.first)].Add(t.second);
  }
}

PlanChange Scheduler::ResplitLocked(EpochRecord& rec, const std::vector<int>& survivors,
                                    const std::vector<double>& shares, int from_step,
                                    std::vector<SampleRange> extra) {
  // Each step's block: every worker's slices of it together, whoever computed them so far.
  const int old_steps = rec.num_steps;
  std::vector<std::vector<SampleRange>> blocks(old_steps);
  for (const auto& [id, steps] : rec.layout) {
    for (int s = from_step; s < old_steps && s < static_cast<int>(steps.size()); ++s) {
      blocks[s].insert(blocks[s].end(), steps[s].begin(), steps[s].end());
    }
  }
  for (auto& [id, steps] : rec.layout) {
    for (int s = from_step; s < static_cast<int>(steps.size()); ++s) steps[s].clear();
  }
  const bool extra_step = CountSamples(extra) > 0;
  rec.num_steps = old_steps + (extra_step ? 1 : 0);
  for (int id : survivors) rec.layout[id].resize(rec.num_steps);
  auto split = [&](std::vector<SampleRange> block, int s) {
    std::sort(block.begin(), block.end(),
              [](const SampleRange& a, const SampleRange& b) { return a.begin < b.begin; });
    const std::vector<int64_t> counts = LargestRemainder(CountSamples(block), shares);
    RangeCursor cursor(block);
    for (size_t k = 0; k < survivors.size(); ++k) {
      rec.layout[survivors[k]][s] = cursor.Take(counts[k]);
    }
  };
  for (int s = from_step; s < old_steps; ++s) split(std::move(blocks[s]), s);
  if (extra_step) split(std::move(extra), old_steps);

  const std::vector<int64_t> test = LargestRemainder(table_.at(0).test_samples, shares);
  int64_t test_offset = 0;
  PlanChange out;
  ++rec.revision;
  for (size_t k = 0; k < survivors.size(); ++k) {
    const int id = survivors[k];
    rec.plans[id].test_range = {test_offset, test_offset + test[k]};
    test_offset += test[k];
    PlanRevision rev;
    rev.epoch = rec.epoch;
    rev.revision = rec.revision;
    rev.from_step = from_step;
    rev.num_steps = rec.num_steps;
    rev.steps.assign(rec.layout[id].begin() + from_step, rec.layout[id].end());
    rev.test_range = rec.plans[id].test_range;
    out.revisions[id] = std::move(rev);
  }
  for (int s = from_step; s < rec.num_steps; ++s) {
    std::map<int, int> q;
    for (int id : survivors) q[id] = static_cast<int>(CountSamples(rec.layout[id][s]));
    out.later_quotas.push_back(std::move(q));
  }
  return out;
}

}  // namespace dbs
