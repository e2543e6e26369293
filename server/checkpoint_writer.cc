#include "server/checkpoint_writer.h"

#include <utility>

namespace dbs {

CheckpointWriter::CheckpointWriter(WriteFn write, Written written, const Clock* clock)
    : write_(std::move(write)), written_(std::move(written)), clock_(clock) {
  thread_ = std::thread([this] { Run(); });
}

CheckpointWriter::~CheckpointWriter() {
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
  }
  thread_.join();
}

bool CheckpointWriter::Busy() const {
  absl::MutexLock lock(&mu_);
  return !queue_.empty();
}

void CheckpointWriter::Queue(JobState state) {
  absl::MutexLock lock(&mu_);
  queue_.push_back(std::move(state));
  ++queued_;
}

void CheckpointWriter::Flush() {
  absl::MutexLock lock(&mu_);
  const int64_t target = queued_;
  const auto done = [this, target]()
                        ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return written_count_ >= target; };
  mu_.Await(absl::Condition(&done));
}

absl::StatusOr<std::string> CheckpointWriter::WriteNow(const JobState& state) {
  Flush();
  return Write(state);
}

absl::StatusOr<std::string> CheckpointWriter::Write(const JobState& state) {
  absl::MutexLock lock(&write_mu_);
  const absl::Time started = clock_->Now();
  absl::StatusOr<std::string> path = write_(state);
  if (written_) written_(path, clock_->Now() - started);
  return path;
}

void CheckpointWriter::Run() {
  while (true) {
    JobState state;
    {
      absl::MutexLock lock(&mu_);
      mu_.Await(absl::Condition(
          +[](CheckpointWriter* w)
               ABSL_EXCLUSIVE_LOCKS_REQUIRED(w->mu_) { return w->stop_ || !w->queue_.empty(); },
          this));
      if (queue_.empty()) return;  // stopped, everything written
      state = std::move(queue_.front());
      queue_.pop_front();
    }
    // The outcome goes to the `written` callback (the job logs a failure and counts it).
    Write(state).IgnoreError();
    absl::MutexLock lock(&mu_);
    ++written_count_;
  }
}

}  // namespace dbs
