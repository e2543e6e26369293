#include "server/shard_coordinator.h"

#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"

namespace dbs {

absl::Status ShardCoordinator::Admit() const {
  return log_ == nullptr ? absl::OkStatus() : log_->Admit();
}

void ShardCoordinator::Append(ShardEventData event) {
  if (log_ != nullptr) log_->Append(std::move(event));
}

void ShardCoordinator::Registered(int worker_id, const std::string& token,
                                  const std::string& identity) {
  ShardEventData e;
  e.kind = ShardEventData::Kind::kWorker;
  e.worker_id = worker_id;
  e.token = token;
  e.identity = identity;
  Append(std::move(e));
}

void ShardCoordinator::EpochPlanned(int epoch, const StepQuotas& quotas, bool checkpoint_follows) {
  if (log_ == nullptr) return;
  ShardEventData e;
  e.kind = ShardEventData::Kind::kEpoch;
  e.epoch = epoch;
  e.quotas = quotas;
  e.checkpoint = checkpoint_follows;
  Append(std::move(e));
}

void ShardCoordinator::Checkpointed(int epoch, bool written) {
  ShardEventData e;
  e.kind = ShardEventData::Kind::kCheckpoint;
  e.epoch = epoch;
  e.checkpoint = written;
  Append(std::move(e));
}

void ShardCoordinator::StepCompleted(const StepStats& stats,
                                     const std::optional<PlanChange>& change, bool checkpointed) {
  if (log_ == nullptr) return;
  ShardEventData e;
  e.kind = ShardEventData::Kind::kStep;
  e.epoch = stats.epoch;
  e.step = stats.step;
  e.checkpoint = checkpointed;
  if (change.has_value() && !stats.last_of_epoch) {  // as the aggregator applies it
    e.changed = true;
    e.quotas = change->later_quotas;
  }
  Append(std::move(e));
}

void ShardCoordinator::Removed(int epoch, int step, const std::set<int>& dead,
                               const StepQuotas* later) {
  if (log_ == nullptr) return;
  ShardEventData e;
  e.kind = ShardEventData::Kind::kStep;
  e.epoch = epoch;
  e.step = step;
  e.dead = dead;
  if (later != nullptr) {
    e.changed = true;
    e.quotas = *later;
  }
  Append(std::move(e));
}

void ShardCoordinator::Ended(const absl::Status& status) {
  ShardEventData e;
  e.kind = ShardEventData::Kind::kEnd;
  e.status = status;
  Append(std::move(e));
}

void ShardCoordinator::Restored(const JobState& st, const StepQuotas& quotas,
                                const Scheduler::State& now, const std::set<int>& registered) {
  if (log_ == nullptr) return;
  // Where the barrier stands first: a follower restores before it serves anything.
  std::vector<ShardEventData> events;
  ShardEventData r;
  r.kind = ShardEventData::Kind::kResume;
  r.epoch = st.aggregator.epoch;
  r.step = st.aggregator.step;
  r.quotas = quotas;
  r.version = st.aggregator.store.version;
  events.push_back(std::move(r));
  for (size_t id = 0; id < now.tokens.size(); ++id) {
    ShardEventData w;
    w.kind = ShardEventData::Kind::kWorker;
    w.worker_id = static_cast<int>(id);
    w.token = now.tokens[id];
    if (id < now.workers.size()) w.identity = now.workers[id].identity;
    events.push_back(std::move(w));
  }
  log_->Seed(std::move(events));
  absl::MutexLock lock(&mu_);
  to_resume_ = registered;
}

absl::Status ShardCoordinator::AdmitPush(int worker_id) const {
  absl::MutexLock lock(&mu_);
  if (to_resume_.count(worker_id) == 0) return absl::OkStatus();
  return absl::FailedPreconditionError(
      absl::StrCat("dbs_ps restarted from a checkpoint; worker ", worker_id,
                   " must resume before it pushes, so that every shard redoes the same step"));
}

void ShardCoordinator::Resumed(int worker_id) {
  absl::MutexLock lock(&mu_);
  to_resume_.erase(worker_id);
}

}  // namespace dbs
