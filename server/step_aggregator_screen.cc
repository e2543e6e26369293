// StepAggregator's screen of faulty pushes (AggregatorOptions::screen): values no GPU computes,
// and norms far above the job's recent ones judged against the step's other pushes.
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "glog/logging.h"
#include "server/step_aggregator.h"

namespace dbs {

absl::Status StepAggregator::ScreenLocked(const GradientPush& push, const CheckedGradient& checked,
                                          std::vector<FaultyPush>* faulty) const {
  if (push.num_samples <= 0 || options_.screen.mode == FaultyGradients::kOff) {
    return absl::OkStatus();
  }
  if (checked.bad_values && options_.screen.mode == FaultyGradients::kEvict) {
    // A value no GPU computes: its worker is removed as a dead one is.
    faulty->push_back(FaultyPush{push.worker_id, push.epoch, push.step, checked.status, true});
    return Quarantined(push.worker_id, push.epoch, push.step, checked.status);
  }
  return absl::OkStatus();
}

absl::Status StepAggregator::Quarantined(int worker, int epoch, int step, const absl::Status& why) {
  return absl::AbortedError(absl::StrCat(
      "worker ", worker, " is quarantined: its gradient of epoch ", epoch + 1, " step ", step + 1,
      " is faulty (", why.message(), "); the job goes on without it"));
}

void StepAggregator::ResolveSuspectsLocked(PushOutcome* out) {
  if (suspects_.empty() || step_ >= static_cast<int>(quotas_.size()) ||
      pending_.size() + suspects_.size() < quotas_[step_].size()) {
    return;
  }
  const bool evict = options_.screen.mode == FaultyGradients::kEvict;
  for (auto& [id, s] : suspects_) {
    std::vector<PushNorm> others;
    for (const auto& [w, n] : step_norms_) {
      if (w != id) others.push_back(n);
    }
    // Alone at its step, the job's history is all there is to judge it by.
    absl::Status verdict = s.verdict;
    if (!others.empty()) {
      verdict = JudgeNorm(s.norm, others, options_.screen.norm_ratio,
                          absl::StrCat("the other ", others.size(), " workers' at this step"));
      if (!verdict.ok()) {
        verdict = absl::InvalidArgumentError(absl::StrCat(
            verdict.message(), "; against the job's recent pushes: ", s.verdict.message()));
      }
    }
    if (verdict.ok() || !evict) {
      if (!verdict.ok()) out->faulty.push_back(FaultyPush{id, epoch_, step_, verdict, false});
      screen_.Accepted(s.norm);
      AcceptLocked(s.push, std::move(s.pending), std::move(s.blocks), out);
    } else {
      out->faulty.push_back(FaultyPush{id, epoch_, step_, verdict, true});
      step_norms_.erase(id);
      out->refusals.emplace_back(std::move(s.pending.done),
                                 Quarantined(id, epoch_, step_, verdict));
    }
  }
  suspects_.clear();
}

void StepAggregator::TellFaulty(const std::vector<FaultyPush>& faulty, Refusals* refusals) {
  for (const FaultyPush& f : faulty) {
    LOG(WARNING) << "worker " << f.worker_id << "'s gradient of epoch " << f.epoch + 1 << " step "
                 << f.step + 1 << " is faulty: " << f.why.message()
                 << (f.counted      ? "; summed only up to there, the worker is quarantined"
                     : f.quarantine ? "; not summed, the worker is quarantined"
                                    : "; summed (--faulty_gradients=log)");
    if (faulty_hook_) faulty_hook_(f);
  }
  for (auto& [done, why] : *refusals) {
    if (done) done(why);
  }
  refusals->clear();
}

}  // namespace dbs
