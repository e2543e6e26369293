// ShardedPsClient against two fake shards: once one shard refuses a step, the client stops
// waiting for the others. (A follower restarted with its leader may hold a push for a step the
// leader has not logged, while the leader refused that push and waits for this worker to redo
// the step before; waiting for both held the job until the leader declared the worker dead.)
#include "worker/sharded_ps_client.h"

#include <atomic>
#include <memory>
#include <string>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "common/rpc/waiting_reactor.h"
#include "common/tensor_codec.h"
#include "gmock/gmock.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "proto/dbs.grpc.pb.h"
#include "tests/loopback_server.h"
#include "tests/status_matchers.h"

namespace dbs {
namespace {

using ::testing::HasSubstr;

// A shard that answers registrations and pulls with zeros of the layout it was sent, and
// either refuses every push as the wrong step or holds it until the client cancels it.
class FakeShard final : public v1::ParameterService::CallbackService {
 public:
  explicit FakeShard(bool refuses_pushes) : refuses_pushes_(refuses_pushes) {}

  // A refusal waits (at most 10 s) for `other` to hold a push: the refused step is then one
  // whose other part is in flight.
  void RefuseWhenHolding(const FakeShard* other) { other_.store(other); }

  std::atomic<int> pushes{0};
  std::atomic<int> cancelled_pushes{0};

  grpc::ServerUnaryReactor* RegisterModel(grpc::CallbackServerContext* ctx,
                                          const v1::RegisterModelRequest* req,
                                          v1::Parameters* reply) override {
    absl::StatusOr<ModelLayout> layout = LayoutOf(req->parameters(), /*with_data=*/false);
    if (layout.ok()) {
      absl::MutexLock lock(&mu_);
      layout_ = *layout;
    }
    return Zeros(ctx, reply);
  }
  grpc::ServerUnaryReactor* PullParameters(grpc::CallbackServerContext* ctx,
                                           const v1::PullParametersRequest*,
                                           v1::Parameters* reply) override {
    return Zeros(ctx, reply);
  }
  grpc::ServerBidiReactor<v1::PushGradientRequest, v1::PushGradientReply>* PushGradientSession(
      grpc::CallbackServerContext*) override {
    return new Session(this);
  }

 private:
  grpc::ServerUnaryReactor* Zeros(grpc::CallbackServerContext* ctx, v1::Parameters* reply) {
    absl::MutexLock lock(&mu_);
    reply->set_version(0);
    EncodeTensors(layout_, std::vector<float>(static_cast<size_t>(TotalElements(layout_))),
                  reply->mutable_parameters());
    grpc::ServerUnaryReactor* r = ctx->DefaultReactor();
    r->Finish(grpc::Status::OK);
    return r;
  }

  // A push session that refuses its first push (a refusing shard) or holds it unanswered,
  // counting it as cancelled when the client gives up.
  class Session final
      : public grpc::ServerBidiReactor<v1::PushGradientRequest, v1::PushGradientReply> {
   public:
    explicit Session(FakeShard* shard) : shard_(shard) { StartRead(&push_); }

    void OnReadDone(bool ok) override {
      if (!ok) return End(grpc::Status::OK);
      ++shard_->pushes;
      if (!shard_->refuses_pushes_) {
        absl::MutexLock lock(&mu_);
        holding_ = !finished_;
        return;
      }
      const absl::Time deadline = absl::Now() + absl::Seconds(10);
      const FakeShard* other = shard_->other_.load();
      while (other != nullptr && other->pushes.load() == 0 && absl::Now() < deadline) {
        absl::SleepFor(absl::Milliseconds(1));
      }
      End(grpc::Status(grpc::StatusCode::FAILED_PRECONDITION,
                       "push for epoch 0 step " + std::to_string(push_.step()) +
                           " does not match the current step (epoch 0 step 0)"));
    }
    void OnCancel() override {
      {
        absl::MutexLock lock(&mu_);
        if (holding_) ++shard_->cancelled_pushes;
        holding_ = false;
      }
      End(grpc::Status(grpc::StatusCode::CANCELLED, "the client went away"));
    }
    void OnDone() override { delete this; }

   private:
    void End(const grpc::Status& status) {
      absl::MutexLock lock(&mu_);
      if (finished_) return;
      finished_ = true;
      Finish(status);
    }
    FakeShard* const shard_;
    v1::PushGradientRequest push_;
    absl::Mutex mu_;
    bool holding_ ABSL_GUARDED_BY(mu_) = false;
    bool finished_ ABSL_GUARDED_BY(mu_) = false;
  };

  const bool refuses_pushes_;
  std::atomic<const FakeShard*> other_{nullptr};
  absl::Mutex mu_;
  ModelLayout layout_ ABSL_GUARDED_BY(mu_);  // the registration's
};

TEST(ShardedPsClientTest, AStepOneShardRefusesIsNotWaitedForOnTheOthers) {
  FakeShard leader(/*refuses_pushes=*/true), follower(/*refuses_pushes=*/false);
  leader.RefuseWhenHolding(&follower);
  LoopbackServer l = ServeOnLoopback(&leader), f = ServeOnLoopback(&follower);
  GrpcClientConfig config;
  // Long enough that waiting for the held push (then retrying it) would take minutes.
  config.call_timeout = absl::Seconds(60);
  config.connect_timeout = absl::Seconds(60);
  config.max_wait = absl::Seconds(20);
  std::vector<std::unique_ptr<GrpcPsClient>> shards;
  for (const std::string& a : {l.address(), f.address()}) {
    GrpcClientConfig c = config;
    c.address = a;
    shards.push_back(std::make_unique<GrpcPsClient>(c));
  }
  ShardedPsClient client(std::move(shards));
  const ModelLayout layout = {{"w", {64}, false}};  // two ranges of 32 values
  std::vector<float> initial(64, 1.0f), params(64, 7.0f), grad(64, 0.5f);
  ASSERT_THAT(client.RegisterModel(0, layout, initial, absl::MakeSpan(params)), IsOk());

  const absl::Time start = absl::Now();
  const absl::StatusOr<StepOutcome> pushed =
      client.PushGradient(0, 0, 1, 4, 1.0, 0.1, grad, absl::MakeSpan(params));
  const absl::Duration took = absl::Now() - start;
  // The leader's refusal, as the worker must see it to resume (not the abandoned follower's
  // CANCELLED, which it would not act on).
  EXPECT_THAT(pushed.status(), StatusIs(absl::StatusCode::kFailedPrecondition,
                                        HasSubstr("shard 0/2: PushGradient")));
  EXPECT_THAT(pushed.status().message(), HasSubstr("does not match the current step"));
  // The held push was given up, not answered: the follower saw its client go.
  const absl::Time deadline = absl::Now() + absl::Seconds(20);
  while (follower.cancelled_pushes.load() == 0 && absl::Now() < deadline) {
    absl::SleepFor(absl::Milliseconds(5));
  }
  EXPECT_EQ(follower.pushes.load(), 1);
  EXPECT_EQ(follower.cancelled_pushes.load(), 1);
  EXPECT_LT(took, absl::Seconds(30)) << "the refused step waited for the held push";

  // Abandoning was for that step only: the next calls reach every shard again.
  EXPECT_THAT(client.PullParameters(0, absl::MakeSpan(params)), IsOk());
  EXPECT_EQ(params, std::vector<float>(64, 0.0f));
  l.server->Shutdown();
  f.server->Shutdown();
}

}  // namespace
}  // namespace dbs
