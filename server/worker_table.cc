#include "server/worker_table.h"

#include <cmath>
#include <map>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/cpu_limit.h"
#include "common/secrets.h"
#include "common/status_macros.h"

namespace dbs {

WorkerTable::WorkerTable(TokenSource token_source)
    : token_source_(token_source ? std::move(token_source) : TokenSource(RandomToken)) {}

absl::Status WorkerTable::Validate(const WorkerRegistration& reg, int global_batch) {
  if (reg.name.empty()) return absl::InvalidArgumentError("worker name is empty");
  if (reg.name.size() > kMaxNameLength || reg.device.size() > kMaxNameLength) {
    return absl::InvalidArgumentError(
        absl::StrCat("worker name and device must be at most ", kMaxNameLength, " bytes"));
  }
  if (reg.train_samples <= 0) {
    return absl::InvalidArgumentError("worker reports an empty training set");
  }
  if (reg.train_samples > kMaxSamples || reg.test_samples > kMaxSamples) {
    return absl::InvalidArgumentError(
        absl::StrCat("a data set of more than ", kMaxSamples, " samples is not supported"));
  }
  // ceil(D / B) steps per epoch, each with a layout per worker: bounded.
  const int64_t steps = (reg.train_samples + global_batch - 1) / global_batch;
  if (steps > kMaxStepsPerEpoch) {
    return absl::InvalidArgumentError(absl::StrCat(
        reg.train_samples, " training samples in global batches of ", global_batch, " make ", steps,
        " steps per epoch; at most ", kMaxStepsPerEpoch, " (raise the batch)"));
  }
  if (reg.test_samples < 0) return absl::InvalidArgumentError("negative test set size");
  if (!std::isfinite(reg.cpu_limit_cores) || reg.cpu_limit_cores < 0 ||
      reg.cpu_limit_cores > kMaxCpuLimitCores) {
    return absl::InvalidArgumentError(absl::StrCat("a CPU limit must be in [0, ", kMaxCpuLimitCores,
                                                   "] cores, not ", reg.cpu_limit_cores));
  }
  return absl::OkStatus();
}

int WorkerTable::Find(absl::string_view name) const {
  int id = -1;
  for (int i = 0; i < size(); ++i) {
    if (workers_[i].name == name && !left_[i]) id = i;
  }
  return id;
}

absl::Status WorkerTable::RoomFor(const std::string& source, int max_per_source) const {
  size_t active = 0, from_source = 0;
  for (size_t i = 0; i < workers_.size(); ++i) {
    if (left_[i]) continue;
    ++active;
    from_source += workers_[i].source == source ? 1 : 0;
  }
  if (active >= kMaxWorkers) {
    return absl::ResourceExhaustedError(
        absl::StrCat("the job already has ", active, " workers; at most ", kMaxWorkers));
  }
  if (max_per_source > 0 && from_source >= static_cast<size_t>(max_per_source)) {
    return absl::ResourceExhaustedError(
        absl::StrCat("the job already has ", from_source, " workers from ", source, "; at most ",
                     max_per_source, " (dbs_ps --max_workers_per_host)"));
  }
  if (workers_.size() >= kMaxWorkerIds) {
    return absl::ResourceExhaustedError(absl::StrCat("the job has handed out ", workers_.size(),
                                                     " worker ids; at most ", kMaxWorkerIds,
                                                     ": start a new job"));
  }
  return absl::OkStatus();
}

int WorkerTable::Add(const WorkerRegistration& reg, absl::Time now) {
  workers_.push_back(reg);
  left_.push_back(false);
  last_call_.push_back(now);
  tokens_.push_back(NewToken());
  return size() - 1;
}

absl::Status WorkerTable::Authenticate(int id, absl::string_view token, absl::string_view identity,
                                       absl::Time now) {
  if (!Known(id)) {
    return absl::NotFoundError(
        absl::StrCat("unknown worker ", id, "; call SchedulerService.RegisterWorker first"));
  }
  if (token.empty()) {
    return absl::UnauthenticatedError("the call carries no worker token (x-dbs-token)");
  }
  if (!ConstantTimeEquals(token, tokens_[id])) {
    return absl::PermissionDeniedError(absl::StrCat("the token does not belong to worker ", id));
  }
  return Reclaim(id, identity, now);
}

absl::Status WorkerTable::Reclaim(int id, absl::string_view identity, absl::Time now) {
  DBS_RETURN_IF_ERROR(CheckIdentity(id, workers_[id].identity, identity));
  last_call_[id] = now;
  return absl::OkStatus();
}

std::vector<std::pair<int, absl::Duration>> WorkerTable::ExpireIdle(
    absl::Time now, absl::Duration idle, const std::function<bool(int)>& keep) {
  std::vector<std::pair<int, absl::Duration>> expired;
  for (int id = 0; id < size(); ++id) {
    if (left_[id] || now - last_call_[id] < idle || keep(id)) continue;
    left_[id] = true;
    expired.emplace_back(id, now - last_call_[id]);
  }
  return expired;
}

bool WorkerTable::Leave(int id) {
  if (left_[id]) return false;
  left_[id] = true;
  return true;
}

void WorkerTable::MarkRemoved(int id) {
  if (!Known(id)) return;
  if (!left_[id]) removed_.insert(id);  // a worker that called Leave is not coming back
  left_[id] = true;
}

void WorkerTable::NoteAskedAfterEnd(const std::string& name) {
  for (int removed : removed_) {  // remembered for removed workers only (bounded)
    if (workers_[removed].name == name) back_after_end_.insert(name);
  }
}

int WorkerTable::RemovedNotBack() const {
  std::map<std::string, bool> away;  // by name: its newest registration was removed
  for (int i = 0; i < size(); ++i) away[workers_[i].name] = removed_.count(i) > 0;
  int n = 0;
  for (const auto& [name, removed] : away) n += removed && back_after_end_.count(name) == 0;
  return n;
}

int WorkerTable::Active() const {
  int n = 0;
  for (bool l : left_) n += l ? 0 : 1;
  return n;
}

void WorkerTable::Load(std::vector<WorkerRegistration> workers, std::vector<bool> left,
                       std::vector<std::string> tokens, absl::Time now) {
  workers_ = std::move(workers);
  left_ = std::move(left);
  tokens_ = std::move(tokens);
  last_call_.assign(workers_.size(), now);
  // A checkpoint without tokens (none are written empty) gets fresh ones: its workers register
  // again under their names.
  while (tokens_.size() < workers_.size()) tokens_.push_back(NewToken());
}

std::string WorkerTable::NewToken() {
  if (token_key_.empty()) return token_source_();
  return IssueWorkerToken(token_key_, static_cast<int>(tokens_.size()));
}

}  // namespace dbs
