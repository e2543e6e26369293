// Received pushes let go on a thread of ours while gRPC's memory quota is over its size.
//
// The server keeps a push's gradient in the slices gRPC received it in
// (common/rpc/grpc_step_wire.h) and its reducer thread drops them once summed. Under a resource
// quota's pressure, dropping the last reference to received memory re-registers the connection's
// reclaimer and wakes gRPC's reclamation loop, which needs an execution context that only gRPC's
// own threads have: dbs_ps segfaulted there (a 10M job at --memory_quota_mb=96, 5 runs of 12). This
// test builds that state on purpose, 60 times, each on a new connection, with every core kept busy:
// 1 MiB pushes held by the server until an 8 MiB quota refuses the next call, then let go on a
// plain thread. With the received slices dropped outside gRPC (the code before the fix in
// ReceivedSlices) the test process died with SIGSEGV in 10 runs of 10, gRPC's stack the server's;
// with the fix it passed 10 of 10 (12-15 s each).
#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/rpc/grpc_step_wire.h"
#include "common/tsan.h"
#include "grpcpp/generic/async_generic_service.h"
#include "grpcpp/generic/generic_stub.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "proto/dbs.pb.h"

namespace dbs {
namespace {

// Reads each call's one message as a push (RawDecode, the server's own reader), keeps the
// gradient (still in the received slices) and answers with an empty message.
class HoldingService : public grpc::CallbackGenericService {
 public:
  grpc::ServerGenericBidiReactor* CreateReactor(grpc::GenericCallbackServerContext*) override {
    return new Reactor(this);
  }

  std::vector<std::shared_ptr<const WirePayload>> TakeHeld() {
    absl::MutexLock lock(&mu_);
    return std::move(held_);
  }
  int decoded() {
    absl::MutexLock lock(&mu_);
    return decoded_;
  }

 private:
  class Reactor : public tsan::Reactor<grpc::ServerGenericBidiReactor> {
   public:
    explicit Reactor(HoldingService* service) : service_(service) { StartRead(&in_); }
    void OnReadDone(bool ok) override {
      const auto reacting = Reacting();
      if (!ok) {
        Finish(grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "no message"));
        return;
      }
      PushRequest request;
      status_ = RawDecode(&in_, &request);
      if (status_.ok()) {
        absl::MutexLock lock(&service_->mu_);
        ++service_->decoded_;
        service_->held_.push_back(std::move(request.gradient));
      }
      grpc::Slice empty("", 0);
      out_ = grpc::ByteBuffer(&empty, 1);  // an empty message: the reply has no fields
      StartWrite(&out_);
    }
    void OnWriteDone(bool) override {
      const auto reacting = Reacting();
      Finish(status_);
    }
    void OnDone() override {
      { const auto reacting = Reacting(); }
      delete this;
    }

   private:
    HoldingService* service_;
    grpc::ByteBuffer in_;
    grpc::ByteBuffer out_;
    grpc::Status status_;
  };

  absl::Mutex mu_;
  std::vector<std::shared_ptr<const WirePayload>> held_ ABSL_GUARDED_BY(mu_);
  int decoded_ ABSL_GUARDED_BY(mu_) = 0;
};

// Threads that keep every core busy while they live. The crash needs gRPC's reclamation to lag
// behind the release, as it does on a loaded machine (dbs_ps's reducer, the workers): on an
// idle one the code before the fix passed this test 10 times of 10, with two `yes` processes
// beside it it crashed 10 times of 10.
class BusyCores {
 public:
  BusyCores() {
    const unsigned n = 2 * std::max(1u, std::thread::hardware_concurrency());
    for (unsigned i = 0; i < n; ++i) {
      threads_.emplace_back([this] {
        uint64_t x = 0;
        while (!stop_.load(std::memory_order_relaxed)) x = x * 6364136223846793005u + 1;
        sink_.fetch_add(x, std::memory_order_relaxed);
      });
    }
  }
  ~BusyCores() {
    stop_.store(true);
    for (std::thread& t : threads_) t.join();
  }

 private:
  std::atomic<bool> stop_{false};
  std::atomic<uint64_t> sink_{0};
  std::vector<std::thread> threads_;
};

grpc::ByteBuffer PushOf(int worker, size_t floats) {
  v1::PushGradientRequest push;
  push.set_worker_id(worker);
  push.set_num_samples(1);
  push.set_wire_dtype(v1::WIRE_FP32);
  std::string gradient(floats * sizeof(float), '\0');
  for (size_t i = 0; i < gradient.size(); i += 4096) gradient[i] = static_cast<char>(i >> 12);
  push.set_gradient(std::move(gradient));
  grpc::Slice slice(push.SerializeAsString());
  return grpc::ByteBuffer(&slice, 1);
}

grpc::Status Call(grpc::GenericStub* stub, const grpc::ByteBuffer& request) {
  grpc::ClientContext context;
  grpc::ByteBuffer reply;
  absl::Notification done;
  grpc::Status status;
  // gRPC starts the call before its callback runs, through code TSan does not see.
  tsan::Release(&status);
  stub->UnaryCall(&context, "/dbs.v1.Test/Push", grpc::StubOptions(), &request, &reply,
                  [&](grpc::Status s) {
                    tsan::Acquire(&status);
                    status = std::move(s);
                    done.Notify();
                  });
  done.WaitForNotification();
  return status;
}

TEST(ReceivedMemoryTest, PushesHeldOverTheQuotaAreLetGoOnAPlainThread) {
  constexpr size_t kQuota = 8 << 20;
  constexpr size_t kFloats = 1 << 18;  // 1 MiB a push
  constexpr int kMaxPushes = 64;       // 64 MiB: far past the quota
  constexpr int kRounds = 60;
  HoldingService service;
  grpc::ResourceQuota quota("received_memory_test");
  quota.Resize(kQuota);
  grpc::ServerBuilder builder;
  int port = 0;
  builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
  builder.SetResourceQuota(quota);
  builder.RegisterCallbackGenericService(&service);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  ASSERT_NE(server, nullptr);
  ASSERT_GT(port, 0);

  BusyCores busy;
  for (int round = 0; round < kRounds; ++round) {
    // A connection of its own each round (the crash came at a connection's first pressure).
    grpc::ChannelArguments args;
    args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
    grpc::GenericStub stub(grpc::CreateCustomChannel("127.0.0.1:" + std::to_string(port),
                                                     grpc::InsecureChannelCredentials(), args));
    // Push and hold until the quota is full: gRPC then refuses new calls.
    int accepted = 0;
    grpc::Status refused;
    for (int w = 0; w < kMaxPushes && refused.ok(); ++w) {
      grpc::Status s = Call(&stub, PushOf(w, kFloats));
      if (s.ok()) {
        ++accepted;
      } else {
        refused = s;
      }
    }
    ASSERT_FALSE(refused.ok()) << "round " << round << ": " << accepted
                               << " pushes held and the quota never filled";
    std::vector<std::shared_ptr<const WirePayload>> held = service.TakeHeld();
    // Every accepted push is held (the refused one may have been read before its answer was).
    ASSERT_GE(held.size(), static_cast<size_t>(accepted));
    ASSERT_GT(accepted, 0) << refused.error_message();
    for (const auto& g : held) ASSERT_EQ(g->bytes, kFloats * sizeof(float));
    // Let them go where the reducer does: on a thread gRPC knows nothing of.
    std::thread reducer([held = std::move(held)]() mutable {
      while (!held.empty()) held.pop_back();
    });
    reducer.join();
    // The memory goes back to the quota (gRPC's reclaimer, on its own threads): the server
    // takes pushes again.
    grpc::Status again;
    for (int attempt = 0; attempt < 200; ++attempt) {
      again = Call(&stub, PushOf(100 + round, kFloats));
      if (again.ok()) break;
      absl::SleepFor(absl::Milliseconds(10));
    }
    ASSERT_TRUE(again.ok()) << "round " << round << ": " << again.error_message();
    service.TakeHeld();
  }
  server->Shutdown();
}

}  // namespace
}  // namespace dbs
