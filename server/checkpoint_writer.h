// CheckpointWriter: writes a job's checkpoints on a thread of its own, in the order they were
// taken, so that the answers of the step a checkpoint is taken at never wait for the disk. A
// state is taken (copied) at its step by the caller; only its encoding and writing happen here.
// Free of gRPC. Thread-safe.
#ifndef DBS_SERVER_CHECKPOINT_WRITER_H_
#define DBS_SERVER_CHECKPOINT_WRITER_H_

#include <deque>
#include <functional>
#include <string>
#include <thread>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/clock.h"
#include "server/checkpoint.h"

namespace dbs {

class CheckpointWriter {
 public:
  // Writes one state; returns its file. WriteCheckpoint into a directory, in production.
  using WriteFn = std::function<absl::StatusOr<std::string>(const JobState& state)>;
  // Told, on the thread that wrote it, of each state written (its file) or not (why), and how
  // long that took.
  using Written = std::function<void(const absl::StatusOr<std::string>& path, absl::Duration took)>;
  // `clock` must outlive the writer.
  CheckpointWriter(WriteFn write, Written written, const Clock* clock);
  // Writes what is queued, then stops.
  ~CheckpointWriter();
  CheckpointWriter(const CheckpointWriter&) = delete;
  CheckpointWriter& operator=(const CheckpointWriter&) = delete;

  // Whether a state waits to be written (besides the one being written): a checkpoint that may
  // be taken later is better not taken now.
  bool Busy() const;
  // Queues `state`, to be written after those queued before it.
  void Queue(JobState state);
  // Waits until every state queued so far has been written.
  void Flush();
  // Writes `state` on this thread once those queued before it are written; its file or why not.
  absl::StatusOr<std::string> WriteNow(const JobState& state);

 private:
  void Run();
  absl::StatusOr<std::string> Write(const JobState& state);

  const WriteFn write_;
  const Written written_;
  const Clock* const clock_;
  mutable absl::Mutex mu_;
  std::deque<JobState> queue_ ABSL_GUARDED_BY(mu_);
  int64_t queued_ ABSL_GUARDED_BY(mu_) = 0;         // states ever queued
  int64_t written_count_ ABSL_GUARDED_BY(mu_) = 0;  // of those, written (or failed)
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  absl::Mutex write_mu_ ABSL_ACQUIRED_AFTER(mu_);  // one write at a time, in order
  std::thread thread_;
};

}  // namespace dbs

#endif  // DBS_SERVER_CHECKPOINT_WRITER_H_
