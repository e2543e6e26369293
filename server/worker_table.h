// WorkerTable: a job's membership by worker id — each worker's registration, whether it is still
// in the job, its token and when it last called — and the limits on who may join. Not
// thread-safe: the Scheduler's lock guards it.
#ifndef DBS_SERVER_WORKER_TABLE_H_
#define DBS_SERVER_WORKER_TABLE_H_

#include <cstddef>
#include <cstdint>
#include <functional>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "common/plan.h"

namespace dbs {

// Limits on what a registering peer may declare.
inline constexpr size_t kMaxNameLength = 256;
inline constexpr int64_t kMaxSamples = int64_t{1} << 31;
inline constexpr size_t kMaxWorkers = 1024;  // in the job at once
// Ids handed out over the job's life (each registration of a new name, or of a name whose
// worker was removed, takes one): bounds the memory registrations can take.
inline constexpr size_t kMaxWorkerIds = 16 * kMaxWorkers;

class WorkerTable {
 public:
  // Makes each worker's token (default: 128 random bits from the kernel).
  using TokenSource = std::function<std::string()>;

  explicit WorkerTable(TokenSource token_source = nullptr);

  // From now on, tokens are signed with `key` (IssueWorkerToken, common/secrets.h).
  void SetTokenKey(std::string key) { token_key_ = std::move(key); }

  // What a registering peer declares, within the limits above and a job of `global_batch`.
  static absl::Status Validate(const WorkerRegistration& reg, int global_batch);
  // The id of the worker in the job under `name`, or -1.
  int Find(absl::string_view name) const;
  // RESOURCE_EXHAUSTED when a new worker from `source` would exceed a limit (`max_per_source`
  // from one source; 0: none).
  absl::Status RoomFor(const std::string& source, int max_per_source) const;
  // Adds `reg` under a new id and token; returns the id.
  int Add(const WorkerRegistration& reg, absl::Time now);

  // OK when `token` is worker `id`'s and `identity` (the call's client certificate) is the one
  // it registered with: NOT_FOUND for an unknown id, UNAUTHENTICATED for no token,
  // PERMISSION_DENIED otherwise. A call that passes counts as the worker's last call.
  absl::Status Authenticate(int id, absl::string_view token, absl::string_view identity,
                            absl::Time now);
  // The worker `id` registers again from `identity`: PERMISSION_DENIED when that is not the
  // certificate it registered with; else its last call.
  absl::Status Reclaim(int id, absl::string_view identity, absl::Time now);

  // Worker `id` made a call.
  void Touch(int id, absl::Time now) { last_call_[id] = now; }
  // Drops the registrations that have made no call for `idle`, but for those `keep` holds;
  // returns their ids, each with how long it had made no call.
  std::vector<std::pair<int, absl::Duration>> ExpireIdle(absl::Time now, absl::Duration idle,
                                                         const std::function<bool(int)>& keep);
  // Worker `id` leaves by its own call: false when it had left already.
  bool Leave(int id);
  // Worker `id` is out of the job; removed for silence unless it had left by its own call.
  void MarkRemoved(int id);
  // A worker named `name` asked to register after the job ended.
  void NoteAskedAfterEnd(const std::string& name);
  // Workers removed for silence that have not been heard from since, by name.
  int RemovedNotBack() const;

  bool Known(int id) const { return id >= 0 && id < size(); }
  bool InJob(int id) const { return Known(id) && !left_[id]; }
  int Active() const;  // in the job
  int size() const { return static_cast<int>(workers_.size()); }
  const WorkerRegistration& at(int id) const { return workers_[id]; }
  const std::vector<WorkerRegistration>& all() const { return workers_; }
  const std::vector<bool>& left() const { return left_; }
  const std::vector<std::string>& tokens() const { return tokens_; }
  const std::string& token(int id) const { return tokens_[id]; }

  // Replaces the table with a restored checkpoint's; ids without a token get fresh ones.
  void Load(std::vector<WorkerRegistration> workers, std::vector<bool> left,
            std::vector<std::string> tokens, absl::Time now);

 private:
  std::string NewToken();

  const TokenSource token_source_;
  std::string token_key_;                    // '' : tokens from token_source_
  std::vector<WorkerRegistration> workers_;  // index = id
  std::vector<bool> left_;
  std::vector<std::string> tokens_;
  // When the worker registered or last made a call the scheduler saw.
  std::vector<absl::Time> last_call_;
  std::set<int> removed_;  // ids removed for silence
  // Names of removed workers that asked to register after the end.
  std::set<std::string> back_after_end_;
};

}  // namespace dbs

#endif  // DBS_SERVER_WORKER_TABLE_H_
