// FakePsClient: an in-process parameter server for one worker, standing beside PsClient as c10d's
// HashStore stands beside Store, so the training loop can be tested without processes or network.
//
// It keeps the job's real state: the current epoch and step, the parameters (plain SGD on the
// pushed mean gradient), one plan per epoch (the whole training set in batches of the global
// batch, test set whole) and the revisions it sent. Like the real server it refuses a push or a
// report that is not the one it expects (FAILED_PRECONDITION), a report whose sample count does
// not match (INVALID_ARGUMENT), and any call from an evicted worker (NOT_FOUND). Scripted events
// make it restart from an earlier step, revise the rest of an epoch, or evict the worker.
// Every push can take simulated network time on an injected FakeClock. Not thread-safe.
#ifndef DBS_TESTS_FAKE_PS_CLIENT_H_
#define DBS_TESTS_FAKE_PS_CLIENT_H_

#include <map>
#include <utility>
#include <vector>

#include "common/clock.h"
#include "worker/ps_client.h"

namespace dbs {

struct FakeJobConfig {
  int epochs = 2;
  int global_batch = 4;
  int start_epoch = 0;  // the epoch the worker joins at (later: joining a running job)
  float learning_rate = 0.5f;
  absl::Duration push_time;  // simulated time of each push on the clock (if any)
  bool finished = false;     // the job has finished before the worker registers
};

class FakePsClient : public PsClient {
 public:
  struct Push {
    int epoch = 0;
    int step = 0;
    int num_samples = 0;
    double compute_seconds = 0.0;
  };

  // `clock` may be null (no simulated time); it must outlive the client.
  explicit FakePsClient(FakeJobConfig config, FakeClock* clock = nullptr);

  // The push of (epoch, step) -- or the epoch's report when `step` is the epoch's step count --
  // finds a server that restarted from its checkpoint at `resume_step` (<= step) of that epoch:
  // the call first waits for the server (TakeReconnected turns true), then fails as the real
  // server does for a worker ahead of it.
  void RestartAt(int epoch, int step, int resume_step);
  // The reply to the push of (epoch, step) carries `revision`, which the server also follows.
  void ReviseAfter(int epoch, int step, PlanRevision revision);
  // From the push of (epoch, step) on -- or from the epoch's report when `step` is the epoch's
  // step count, or from the plan request after it when `step` is one more -- the worker is dead
  // to the server (NOT_FOUND), until it registers again: then it gets a new id and rejoins at
  // the next epoch.
  void EvictAt(int epoch, int step);
  // The job finishes while the worker is evicted: registering again finds it done.
  void FinishWhileEvicted() { finish_while_evicted_ = true; }
  // The plan request after the report of `epoch` finds a server restarted from a checkpoint
  // written after that epoch's steps but before the report (FAILED_PRECONDITION until the
  // worker resumes and reports again).
  void LoseReportOf(int epoch) { lose_report_of_ = epoch; }
  // Right after the worker registers its model, the job's parameters become `values` (other
  // workers trained meanwhile, as when joining a running job).
  void MoveParametersAfterRegistration(std::vector<float> values) {
    moved_after_registration_ = std::move(values);
  }
  // The push of (epoch, step) finds a server restarted from a checkpoint of that same step that
  // was written before the newest revision: it expects the epoch's plan without it (and refuses
  // the push as not matching), until the worker resumes.
  void ForgetRevisionAt(int epoch, int step) { forget_revision_at_ = {epoch, step}; }
  // The next Resume finds the worker declared dead (NOT_FOUND), as EvictAt does.
  void EvictBeforeResume() { evict_before_resume_ = true; }
  // Every Resume fails with `status` (a server that cannot say where the job stands).
  void FailResumeWith(absl::Status status) { resume_failure_ = std::move(status); }

  const std::vector<Push>& pushes() const { return pushes_; }
  const std::vector<EpochTiming>& reports() const { return reports_; }
  const std::vector<float>& parameters() const { return params_; }
  bool left() const { return left_; }
  int restarts() const { return restarts_; }
  int rejoins() const { return rejoins_; }

  absl::StatusOr<RegistrationResult> RegisterWorker(const WorkerRegistration& reg) override;
  absl::Status RegisterModel(int worker_id, const ModelLayout& layout,
                             absl::Span<const float> initial, absl::Span<float> params) override;
  absl::StatusOr<int64_t> PullParameters(int worker_id, absl::Span<float> params) override;
  absl::StatusOr<WorkerPlan> GetEpochPlan(int worker_id, int epoch) override;
  absl::StatusOr<StepOutcome> PushGradient(int worker_id, int epoch, int step, int num_samples,
                                           double loss_sum, double compute_seconds,
                                           absl::Span<const float> gradient,
                                           absl::Span<float> params) override;
  absl::Status ReportEpoch(const EpochTiming& timing) override;
  absl::Status Leave(int worker_id) override;
  absl::StatusOr<ResumePoint> Resume(int worker_id, absl::Span<float> params) override;
  bool TakeReconnected() override;

 private:
  absl::Status CheckWorker(int worker_id) const;
  // A push's step, sample count and sizes against the server's state.
  absl::Status CheckPush(int epoch, int step, int num_samples, absl::Span<const float> gradient,
                         absl::Span<float> params) const;
  // The revision set for (epoch, step), if any, goes into `out` and the server follows it.
  void ReviseAt(int epoch, int step, StepOutcome* out);
  // Restarts the server when a scripted restart is due at (epoch, step); true when it did.
  bool MaybeRestart(int epoch, int step);
  void StartEpoch(int epoch);
  WorkerPlan PlanOf(int epoch) const;

  const FakeJobConfig config_;
  FakeClock* const clock_;
  WorkerRegistration reg_;
  bool registered_ = false;
  int id_ = 0;
  int rejoins_ = 0;
  bool left_ = false;
  bool reconnected_ = false;
  int restarts_ = 0;
  std::vector<float> params_;
  std::vector<float> moved_after_registration_;
  std::pair<int, int> forget_revision_at_ = {-1, -1};
  StepRanges before_revision_;  // the schedule the newest revision replaced
  SampleRange test_before_revision_;
  absl::Status resume_failure_;
  bool evict_before_resume_ = false;
  int64_t version_ = 0;
  // The job's position and the current epoch's steps (revisions applied).
  int epoch_ = 0;
  int step_ = 0;
  StepRanges schedule_;
  SampleRange test_range_;
  int revision_ = 0;
  // Parameters at the start of each step of the current epoch (the restart checkpoints).
  std::map<int, std::vector<float>> checkpoints_;

  std::map<std::pair<int, int>, int> restarts_at_;  // (epoch, step) -> resume step
  std::map<std::pair<int, int>, PlanRevision> revisions_at_;
  std::pair<int, int> evict_at_ = {-1, -1};
  bool evicted_ = false;
  bool finish_while_evicted_ = false;
  int lose_report_of_ = -1;

  std::vector<Push> pushes_;
  std::vector<EpochTiming> reports_;
};

}  // namespace dbs

#endif  // DBS_TESTS_FAKE_PS_CLIENT_H_
