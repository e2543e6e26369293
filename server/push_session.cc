#include <atomic>

#include "absl/strings/str_cat.h"
#include "common/plan_codec.h"
#include "common/rpc/grpc_status.h"
#include "common/rpc/raw_call.h"
#include "common/step_wire.h"
#include "common/tsan.h"
#include "server/parameter_service.h"

namespace dbs {

// A worker's pushes of many steps on one stream (PushGradientSession). Each push goes through
// AcceptPush (the header's checks, the gradient held where it arrived) and then the
// aggregator's barrier, and is answered with the step's result and the parameters serialized
// once for every worker; the next push is read only once that answer is written, so the server
// holds at most one push per stream. The first refusal ends the stream with it.
//
// The aggregator's callback (the step's result) comes from another thread, or from inside
// Push when this push completes the step. The reactor is freed when its reference count
// (gRPC's until OnDone, and one while a push waits for its step) reaches zero. Operations start
// under `mu_` and only before Finish.
class PushSessionReactor final
    : public tsan::Reactor<grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>> {
 public:
  PushSessionReactor(ParameterServiceImpl* service, grpc::CallbackServerContext* ctx)
      : service_(service), ctx_(ctx) {
    if (grpc::Status serving = ServingStatus(service_->hooks_); !serving.ok()) {
      FinishOnce(serving);
      return;
    }
    Read();
  }

  void OnReadDone(bool ok) override {
    const auto reacting = Reacting();
    if (!ok) return FinishOnce(grpc::Status::OK);  // the client closed its side
    received_ = in_.Length();
    PushRequest request;
    grpc::ByteBuffer bytes(in_);  // shares the slices
    in_.Clear();
    if (grpc::Status parsed = RawDecode(&bytes, &request); !parsed.ok()) {
      return FinishOnce(parsed);
    }
    const int worker = request.header.worker_id();
    if (worker_ < 0) worker_ = worker;
    if (worker != worker_) {
      return FinishOnce(grpc::Status(
          grpc::StatusCode::INVALID_ARGUMENT,
          absl::StrCat("a push session carries one worker's pushes: this one began with worker ",
                       worker_, "'s, not ", worker, "'s")));
    }
    absl::StatusOr<GradientPush> push = service_->AcceptPush(ctx_, request);
    if (!push.ok()) return FinishOnce(ToGrpcStatus(push.status()));
    shared_answer_ = request.header.answer_in_shared_memory();
    AwaitStep(*push);
  }

  void OnWriteDone(bool ok) override {
    const auto reacting = Reacting();
    if (!ok) return FinishOnce(grpc::Status(grpc::StatusCode::CANCELLED, "the client went away"));
    Read();
  }

  void OnCancel() override {
    const auto reacting = Reacting();
    // A waiting answer is withdrawn (its callback will not run: drop its reference).
    // A client ends its session between pushes this way too: only a withdrawn push is told
    // to the observer.
    const bool withdrawn = Withdraw();
    FinishOnce(grpc::Status(grpc::StatusCode::CANCELLED, "the client went away"), withdrawn);
  }

  void OnDone() override {
    { const auto reacting = Reacting(); }
    Unref();
  }

 private:
  ~PushSessionReactor() override = default;
  void Ref() { refs_.fetch_add(1); }
  void Unref() {
    if (refs_.fetch_sub(1) == 1) delete this;
  }

  // Counts `push` in its step; the result comes to Answer, or ends the stream, with a
  // reference held until then.
  void AwaitStep(const GradientPush& push) {
    Ref();
    StepAggregator* aggregator = service_->aggregator_;
    const int worker = push.worker_id;
    const uint64_t ticket =
        aggregator->Push(push, [this, worker](const absl::StatusOr<StepResult>& r) {
          ticket_.store(0);
          if (!r.ok()) {
            FinishOnce(ToGrpcStatus(r.status()));
          } else {
            Answer(*r, worker);
          }
          Unref();
        });
    if (ticket != 0) {
      ticket_.store(ticket);
      // The client may have gone while the push was being counted (Withdraw found no ticket).
      if (cancelled_.load() && ticket_.exchange(0) != 0 && aggregator->CancelWait(ticket)) {
        Unref();
      }
    }
  }

  // The client went away: a waiting push is withdrawn (its callback will not run). True if
  // there was one.
  bool Withdraw() {
    cancelled_.store(true);
    const uint64_t ticket = ticket_.exchange(0);
    if (ticket == 0 || !service_->aggregator_->CancelWait(ticket)) return false;
    Unref();
    return true;
  }

  void Answer(const StepResult& r, int worker) {
    PushAnswer answer;
    if (r.revisions != nullptr) {
      auto rev = r.revisions->find(worker);
      if (rev != r.revisions->end()) ToProto(rev->second, answer.head.mutable_revision());
    }
    answer.head.set_epoch(r.epoch);
    answer.head.set_step(r.step);
    answer.head.set_global_loss(r.global_loss);
    answer.head.set_global_samples(r.global_samples);
    answer.values = service_->AnswerValues(r.parameters, worker, shared_answer_);
    absl::MutexLock lock(&mu_);
    if (finished_) return;
    if (!RawEncode(answer, &out_)) {
      return FinishLocked(grpc::Status(grpc::StatusCode::INTERNAL, "cannot serialize the reply"));
    }
    if (service_->hooks_.observer != nullptr) {
      service_->hooks_.observer->OnCall("PushGradientSession", received_, out_.Length(), 0);
    }
    StartWrite(&out_);
  }

  void Read() {
    absl::MutexLock lock(&mu_);
    if (!finished_) StartRead(&in_);
  }

  // Ends the stream; a refusal (`observed`) is told to the observer as a refused call.
  void FinishOnce(const grpc::Status& status, bool observed = true) {
    absl::MutexLock lock(&mu_);
    FinishLocked(status, observed);
  }

  void FinishLocked(const grpc::Status& status, bool observed = true)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (finished_) return;
    finished_ = true;
    if (observed && !status.ok() && service_->hooks_.observer != nullptr) {
      service_->hooks_.observer->OnCall("PushGradientSession", received_, 0,
                                        static_cast<int>(status.error_code()));
    }
    Finish(status);
  }

  ParameterServiceImpl* const service_;
  grpc::CallbackServerContext* const ctx_;
  std::atomic<uint64_t> ticket_{0};  // of the push waiting for its step
  std::atomic<bool> cancelled_{false};
  std::atomic<int> refs_{1};
  grpc::ByteBuffer in_;  // the push being read (only between StartRead and OnReadDone)
  int worker_ = -1;      // the stream's, from its first push (OnReadDone only)
  // The push being answered asked for its answer in shared memory (set before AwaitStep).
  std::atomic<bool> shared_answer_{false};
  std::atomic<size_t> received_{0};  // the last push's bytes
  absl::Mutex mu_;
  bool finished_ ABSL_GUARDED_BY(mu_) = false;
  grpc::ByteBuffer out_ ABSL_GUARDED_BY(mu_);  // the answer being written
};

grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>*
ParameterServiceImpl::PushGradientSession(grpc::CallbackServerContext* ctx) {
  return new PushSessionReactor(this, ctx);
}

}  // namespace dbs
