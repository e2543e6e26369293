// WaitingReactor: a unary callback reactor for a call that waits on the domain (a plan that is
// not laid out yet, a step barrier) and that gives its wait back when the client goes away.
//
// Without it a cancelled call (client deadline, dropped connection) keeps its waiter, its
// reply buffer and its reactor until the awaited event happens; a flood of such calls is
// memory the peer chooses. With it:
//   - the domain callback calls Finish(status) when the answer is ready;
//   - OnCancel runs the withdraw hook (SetWithdraw); when the hook says it removed the waiter
//     (so the callback will never run) the call ends at once with CANCELLED.
// Finish runs exactly once whichever comes first. The object frees itself once gRPC is done
// with it AND the handler has released it (Release), so a callback that finishes the call
// before the handler returns cannot leave the handler holding a freed pointer.
#ifndef DBS_COMMON_WAITING_REACTOR_H_
#define DBS_COMMON_WAITING_REACTOR_H_

#include <atomic>
#include <functional>
#include <utility>

#include "absl/synchronization/mutex.h"
#include "common/tsan.h"
#include "grpcpp/support/server_callback.h"
#include "grpcpp/support/status.h"

namespace dbs {

class WaitingReactor final : public tsan::Reactor<grpc::ServerUnaryReactor> {
 public:
  // Returns true when it removed the waiter (its callback will never run).
  using Withdraw = std::function<bool()>;

  // Runs just before the answer goes out (to serialize the reply); may turn it into an error.
  using BeforeFinish = std::function<grpc::Status(const grpc::Status&)>;

  explicit WaitingReactor(BeforeFinish before_finish = nullptr)
      : before_finish_(std::move(before_finish)) {}

  // Answers the call; later calls are ignored.
  void FinishOnce(const grpc::Status& status) {
    {
      absl::MutexLock lock(&mu_);
      if (finished_) return;
      finished_ = true;
    }
    Finish(before_finish_ ? before_finish_(status) : status);
  }

  // Sets how to withdraw the wait; if the client has already gone, withdraws now.
  void SetWithdraw(Withdraw withdraw) {
    bool cancelled;
    {
      absl::MutexLock lock(&mu_);
      withdraw_ = std::move(withdraw);
      cancelled = cancelled_;
    }
    if (cancelled) WithdrawNow();
  }

  // The handler's hold; call once, after SetWithdraw. Its reactions may begin then, OnCancel
  // first where the client went away before the answer.
  void Release() {
    Publish();
    Unref();
  }

  void OnCancel() override {
    const auto reacting = Reacting();
    {
      absl::MutexLock lock(&mu_);
      cancelled_ = true;
    }
    WithdrawNow();
  }

  void OnDone() override {
    { const auto reacting = Reacting(); }
    Unref();
  }

 private:
  ~WaitingReactor() override = default;

  void WithdrawNow() {
    Withdraw withdraw;
    {
      absl::MutexLock lock(&mu_);
      withdraw = std::move(withdraw_);  // at most once
      withdraw_ = nullptr;
    }
    // Outside our lock: the hook takes the domain's lock, whose callbacks take ours.
    if (withdraw && withdraw()) {
      FinishOnce(grpc::Status(grpc::StatusCode::CANCELLED, "the client cancelled the call"));
    }
  }

  void Unref() {
    if (refs_.fetch_sub(1, std::memory_order_acq_rel) == 1) delete this;
  }

  const BeforeFinish before_finish_;
  absl::Mutex mu_;
  bool finished_ ABSL_GUARDED_BY(mu_) = false;
  bool cancelled_ ABSL_GUARDED_BY(mu_) = false;
  Withdraw withdraw_ ABSL_GUARDED_BY(mu_);
  std::atomic<int> refs_{2};  // gRPC's (until OnDone) and the handler's (until Release)
};

}  // namespace dbs

#endif  // DBS_COMMON_WAITING_REACTOR_H_
