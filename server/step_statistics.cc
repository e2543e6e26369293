#include "server/step_statistics.h"

namespace dbs {

void StepStatistics::BeginEpoch(int epoch) {
  DropStep();
  epoch_loss_[epoch];
  Released(epoch, -1);
}

void StepStatistics::Released(int epoch, int step) {
  if (clock_ == nullptr) return;
  released_ = clock_->Now();
  released_epoch_ = epoch;
  released_step_ = step;
}

void StepStatistics::Accepted(int worker, int epoch, int step, int samples, double loss_sum,
                              double compute_seconds) {
  losses_[worker] = loss_sum;
  step_.samples += samples;
  step_.workers[worker] = {samples, compute_seconds};
  accepted_[epoch].insert({worker, step});
  ++accepted_pushes_;
  if (clock_ != nullptr && released_epoch_ == epoch && released_step_ == step - 1) {
    step_.cycle[worker] = absl::ToDoubleSeconds(clock_->Now() - released_);
  }
}

StepStats StepStatistics::EndStep(int epoch, int step, bool last_of_epoch, bool applied) {
  StepStats stats = std::move(step_);
  stats.epoch = epoch;
  stats.step = step;
  stats.last_of_epoch = last_of_epoch;
  stats.loss_sum = 0.0;
  for (const auto& [id, loss] : losses_) stats.loss_sum += loss;  // in worker order
  DropStep();
  if (applied) {
    EpochLoss& el = epoch_loss_[epoch];
    el.loss_sum += stats.loss_sum;
    el.samples += stats.samples;
    el.steps_completed += 1;
  }
  return stats;
}

void StepStatistics::DropStep() {
  step_ = StepStats();
  losses_.clear();
}

EpochLoss StepStatistics::LossOf(int epoch) const {
  auto it = epoch_loss_.find(epoch);
  return it == epoch_loss_.end() ? EpochLoss{} : it->second;
}

std::set<std::pair<int, int>> StepStatistics::AcceptedPushes(int epoch) const {
  auto it = accepted_.find(epoch);
  return it == accepted_.end() ? std::set<std::pair<int, int>>{} : it->second;
}

void StepStatistics::Restore(int epoch, std::map<int, EpochLoss> losses,
                             std::set<std::pair<int, int>> accepted) {
  DropStep();
  epoch_loss_ = std::move(losses);
  accepted_.clear();
  accepted_[epoch] = std::move(accepted);
}

}  // namespace dbs
