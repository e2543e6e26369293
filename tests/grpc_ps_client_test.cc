// GrpcPsClient against a server that accepts calls and never answers them (a hung or
// livelocked peer): every call ends by its deadline instead of hanging the worker. A call that
// answers at once is retried within --connect_timeout_s; a waiting call (plan, push) is asked
// again each --call_timeout_s, and gives up after --max_wait_s.
#include "worker/grpc_ps_client.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <memory>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "absl/synchronization/barrier.h"
#include "absl/synchronization/mutex.h"
#include "common/clock.h"
#include "common/rpc/waiting_reactor.h"
#include "common/shard_range.h"
#include "common/wire_values.h"
#include "gmock/gmock.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "proto/dbs.grpc.pb.h"
#include "server/ps_server.h"
#include "tests/loopback_server.h"
#include "tests/status_matchers.h"

namespace dbs {
namespace {

using ::testing::HasSubstr;

// Holds every call until the client cancels it (its deadline); counts the calls.
class BlackHole final : public v1::SchedulerService::CallbackService {
 public:
  std::atomic<int> calls{0};

  grpc::ServerUnaryReactor* GetEpochPlan(grpc::CallbackServerContext*,
                                         const v1::GetEpochPlanRequest*, v1::EpochPlan*) override {
    return Hold();
  }
  grpc::ServerUnaryReactor* ReportEpoch(grpc::CallbackServerContext*, const v1::EpochReport*,
                                        v1::EpochReportReply*) override {
    return Hold();
  }

 private:
  grpc::ServerUnaryReactor* Hold() {
    ++calls;
    auto* reactor = new WaitingReactor();
    reactor->SetWithdraw([] { return true; });
    reactor->Release();
    return reactor;
  }
};

// A client of `address` that gives up retrying after 1 s, retrying every 10-50 ms.
GrpcClientConfig QuickRetries(const std::string& address) {
  GrpcClientConfig config;
  config.address = address;
  config.connect_timeout = absl::Seconds(1);
  config.backoff.initial = absl::Milliseconds(10);
  config.backoff.max = absl::Milliseconds(50);
  return config;
}

class GrpcPsClientDeadlineTest : public ::testing::Test {
 protected:
  void SetUp() override {
    LoopbackServer s = ServeOnLoopback(&hole_);
    ASSERT_NE(s.port, 0);
    config_ = QuickRetries(s.address());
    server_ = std::move(s.server);
    config_.call_timeout = absl::Milliseconds(100);
  }
  void TearDown() override { server_->Shutdown(); }

  BlackHole hole_;
  std::unique_ptr<grpc::Server> server_;
  GrpcClientConfig config_;
};

TEST_F(GrpcPsClientDeadlineTest, ACallThatIsNeverAnsweredIsRetriedThenFails) {
  GrpcPsClient client(config_);
  EpochTiming timing;
  // Returns at all rather than waiting forever, with the call named.
  const absl::Status s = client.ReportEpoch(timing);
  EXPECT_THAT(s, StatusIs(absl::StatusCode::kDeadlineExceeded, HasSubstr("ReportEpoch")));
  EXPECT_GE(hole_.calls.load(), 2) << "timed-out attempts are retried";
}

TEST_F(GrpcPsClientDeadlineTest, AWaitingCallIsAskedAgainUntilTheMaximumWait) {
  config_.max_wait = absl::Milliseconds(700);
  GrpcPsClient client(config_);
  const absl::StatusOr<WorkerPlan> plan = client.GetEpochPlan(0, 0);
  EXPECT_THAT(plan.status(),
              StatusIs(absl::StatusCode::kDeadlineExceeded, HasSubstr("--max_wait_s")));
  EXPECT_GE(hole_.calls.load(), 4) << "each 100 ms attempt ends and the wait is asked again";
}

// Answers ReportEpoch UNAVAILABLE with a retry-after of 1 ms (as a follower shard answers a
// call ahead of its leader) `busy` times, then OK.
class PushesBack final : public v1::SchedulerService::CallbackService {
 public:
  std::atomic<int> calls{0};
  int busy = 3;

  grpc::ServerUnaryReactor* ReportEpoch(grpc::CallbackServerContext* ctx, const v1::EpochReport*,
                                        v1::EpochReportReply*) override {
    auto* reactor = ctx->DefaultReactor();
    if (++calls <= busy) {
      ctx->AddTrailingMetadata(kRetryAfterMsKey, "1");
      reactor->Finish(grpc::Status(grpc::StatusCode::UNAVAILABLE, "not yet"));
    } else {
      reactor->Finish(grpc::Status::OK);
    }
    return reactor;
  }
};

TEST(GrpcPsClientRetryTest, AServerThatAsksToBeCalledAgainSoonIsCalledAgainQuietly) {
  PushesBack server;
  LoopbackServer s = ServeOnLoopback(&server);
  ASSERT_NE(s.port, 0);
  GrpcClientConfig config;
  config.address = s.address();
  config.connect_timeout = absl::Seconds(30);
  // The client's own backoff would not retry before the deadline: the server's delay is used.
  config.backoff.initial = absl::Minutes(5);
  config.backoff.max = absl::Minutes(5);
  GrpcPsClient client(config);
  EXPECT_THAT(client.ReportEpoch(EpochTiming{}), IsOk());
  EXPECT_EQ(server.calls.load(), 4);
  EXPECT_FALSE(client.TakeReconnected()) << "the server never went away";
  s.server->Shutdown();
}

// A bare HTTP/2 endpoint that resets every stream it is sent with ENHANCE_YOUR_CALM, as gRPC's
// transport does under a memory quota's pressure; counts the streams.
class ResetEveryStream {
 public:
  ResetEveryStream() {
    listener_ = socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t len = sizeof(addr);
    if (bind(listener_, reinterpret_cast<sockaddr*>(&addr), len) != 0 ||
        listen(listener_, 8) != 0 ||
        getsockname(listener_, reinterpret_cast<sockaddr*>(&addr), &len) != 0) {
      return;
    }
    port_ = ntohs(addr.sin_port);
    accepting_ = std::thread([this] { Accept(); });
  }
  ~ResetEveryStream() {
    shutdown(listener_, SHUT_RDWR);  // wakes accept()
    if (accepting_.joinable()) accepting_.join();
    {
      absl::MutexLock lock(&mu_);
      for (int fd : open_) shutdown(fd, SHUT_RDWR);  // wakes their recv()
    }
    for (std::thread& t : serving_) t.join();
    close(listener_);
  }
  std::string address() const { return "127.0.0.1:" + std::to_string(port_); }
  int port() const { return port_; }
  int streams() const { return streams_.load(); }

 private:
  static constexpr uint8_t kHeaders = 1, kRstStream = 3, kSettings = 4, kPing = 6, kAck = 1;
  static constexpr uint32_t kEnhanceYourCalm = 11;

  void Accept() {
    while (true) {
      const int fd = accept(listener_, nullptr, nullptr);
      if (fd < 0) return;
      absl::MutexLock lock(&mu_);
      open_.push_back(fd);
      serving_.emplace_back([this, fd] { Serve(fd); });
    }
  }
  static bool Read(int fd, std::string* out, size_t n) {
    out->resize(n);
    for (size_t got = 0; got < n;) {
      const ssize_t r = recv(fd, out->data() + got, n - got, 0);
      if (r <= 0) return false;
      got += static_cast<size_t>(r);
    }
    return true;
  }
  static void Send(int fd, uint8_t kind, uint8_t flags, uint32_t stream,
                   const std::string& payload) {
    const uint32_t n = static_cast<uint32_t>(payload.size());
    std::string frame = {static_cast<char>(n >> 16),
                         static_cast<char>(n >> 8),
                         static_cast<char>(n),
                         static_cast<char>(kind),
                         static_cast<char>(flags),
                         static_cast<char>(stream >> 24),
                         static_cast<char>(stream >> 16),
                         static_cast<char>(stream >> 8),
                         static_cast<char>(stream)};
    frame += payload;
    (void)send(fd, frame.data(), frame.size(), MSG_NOSIGNAL);
  }
  void Serve(int fd) {
    std::string head, payload;
    if (!Read(fd, &head, 24)) return;  // the client's connection preface
    Send(fd, kSettings, 0, 0, "");
    while (Read(fd, &head, 9)) {
      const auto byte = [&](int i) { return static_cast<uint32_t>(static_cast<uint8_t>(head[i])); };
      const uint8_t kind = head[3], flags = head[4];
      const uint32_t stream = (byte(5) << 24 | byte(6) << 16 | byte(7) << 8 | byte(8)) & 0x7fffffff;
      if (!Read(fd, &payload, byte(0) << 16 | byte(1) << 8 | byte(2))) return;
      if ((kind == kSettings || kind == kPing) && (flags & kAck) == 0) {
        Send(fd, kind, kAck, 0, kind == kPing ? payload : "");
      } else if (kind == kHeaders) {
        ++streams_;
        Send(fd, kRstStream, 0, stream, std::string{0, 0, 0, static_cast<char>(kEnhanceYourCalm)});
      }
    }
  }

  int listener_ = -1;
  int port_ = 0;
  std::atomic<int> streams_{0};
  std::thread accepting_;
  absl::Mutex mu_;
  std::vector<int> open_ ABSL_GUARDED_BY(mu_);
  std::vector<std::thread> serving_;
};

// gRPC's transport under memory pressure resets streams (RESOURCE_EXHAUSTED, "Received RST_STREAM
// with error code 11"): the server is up and the call goes through once memory is freed, so it
// is retried like an unreachable server's, registration included.
TEST(GrpcPsClientRetryTest, StreamsResetUnderMemoryPressureAreRetried) {
  ResetEveryStream server;
  ASSERT_NE(server.port(), 0);
  GrpcPsClient client(QuickRetries(server.address()));
  WorkerRegistration reg;
  reg.name = "w";
  reg.train_samples = 10;
  EXPECT_THAT(client.RegisterWorker(reg).status(),
              StatusIs(absl::StatusCode::kUnavailable, HasSubstr("RST_STREAM with error code 11")));
  EXPECT_GT(server.streams(), 1) << "the reset registration was retried";
  const int before = server.streams();
  EXPECT_THAT(client.ReportEpoch(EpochTiming{}),
              StatusIs(absl::StatusCode::kUnavailable, HasSubstr("ReportEpoch")));
  EXPECT_GT(server.streams() - before, 1) << "a reset call was retried";
}

// A client of `server` over the socket.
GrpcClientConfig ClientOf(const PsServer& server) {
  GrpcClientConfig config;
  config.address = "127.0.0.1:" + std::to_string(server.port());
  config.shared_memory = false;
  return config;
}
const ModelLayout kTwoTensorLayout = {{"a", {1000}, false}, {"b", {40, 50}, false}};

// A model too large for --max_message_mb is refused before any call, saying what to raise.
TEST(GrpcPsClientModelTest, AModelTooLargeForAMessageIsRefusedBeforeAnyCall) {
  GrpcClientConfig config;
  config.address = "127.0.0.1:1";  // nothing listens: the check comes first
  config.max_message_mb = 1;
  GrpcPsClient client(config);
  const ModelLayout layout = {{"w", {300000}, false}};  // 1.1 MiB in fp32
  std::vector<float> initial(300000), params(300000);
  EXPECT_THAT(client.RegisterModel(0, layout, initial, absl::MakeSpan(params)),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("the model (300000 values, 1 MiB in fp32) does not fit in a "
                                 "message of --max_message_mb=1: raise it, on dbs_ps and on "
                                 "every worker, to at least 3")));
}

// The first worker's initial values become the model's; the second sends none of its own and
// gets them, as does a pull.
TEST(GrpcPsClientModelTest, TheFirstWorkersValuesAreTheModelEveryWorkerGets) {
  ServerConfig c;  // two workers; no step is trained
  c.host = "127.0.0.1";
  c.port = 0;
  c.job.scheduler.expected_workers = 2;
  std::atomic<int> released{0};
  c.release_freed_memory = [&] { ++released; };
  const RealClock clock;
  absl::StatusOr<std::unique_ptr<PsServer>> server = PsServer::Start(c, &clock);
  ASSERT_THAT(server, IsOk());
  const GrpcClientConfig config = ClientOf(**server);
  const ModelLayout layout = kTwoTensorLayout;
  std::vector<float> initial(3000);
  for (size_t i = 0; i < initial.size(); ++i) initial[i] = 0.001f * static_cast<float>(i) - 1;
  GrpcPsClient first(config), second(config);
  absl::StatusOr<RegistrationResult> r1 = first.RegisterWorker({"w0", 16, 4, "cpu", ""});
  absl::StatusOr<RegistrationResult> r2 = second.RegisterWorker({"w1", 16, 4, "cpu", ""});
  ASSERT_THAT(r1, IsOk());
  ASSERT_THAT(r2, IsOk());
  std::vector<float> p1(3000, 7.0f), p2(3000, 7.0f), pulled(3000, 7.0f);
  ASSERT_THAT(first.RegisterModel(r1->worker_id, layout, initial, absl::MakeSpan(p1)), IsOk());
  // The second sends no values of its own: zeros, which must not win.
  ASSERT_THAT(second.RegisterModel(r2->worker_id, layout, std::vector<float>(3000, 0.0f),
                                   absl::MakeSpan(p2)),
              IsOk());
  EXPECT_EQ(p1, initial);
  EXPECT_EQ(p2, initial);
  absl::StatusOr<int64_t> version = second.PullParameters(r2->worker_id, absl::MakeSpan(pulled));
  ASSERT_THAT(version, IsOk());
  EXPECT_EQ(*version, 0);
  EXPECT_EQ(pulled, initial);
  EXPECT_EQ(released.load(), 1) << "once, after the registration that stored the values";
  (*server)->Stop(absl::CancelledError("test over"));
}

// Two workers, B = 4, the fixed split: two samples each per step.
ServerConfig TwoWorkerConfig() {
  ServerConfig c;
  c.host = "127.0.0.1";
  c.port = 0;
  c.job.scheduler.expected_workers = 2;
  c.job.scheduler.global_batch = 4;
  c.job.policy = PolicyKind::kFixed;
  return c;
}

// Two workers of a TwoWorkerConfig job (plain SGD, lr 1), every value starting at `initial`, on
// clients of `config` (the address set here), registered and holding epoch 0's plans. Step(s)
// pushes both workers' gradients at once: worker w's is (w + 1) * (s + 1) / 64 on every value
// (exact in fp32 and bf16), so the mean is 1.5 * (s + 1) / 64 and the parameters fall by that
// at each step; the workers get them rounded as the job's `dtype` rounds them on the wire.
class TwoWorkerJob {
 public:
  void Start(ServerConfig c, GrpcClientConfig config, const ModelLayout& layout) {
    c.job.optimizer.sgd.lr = 1.0;
    c.job.optimizer.sgd.momentum = 0.0;
    absl::StatusOr<std::unique_ptr<PsServer>> server = PsServer::Start(c, &clock_);
    ASSERT_THAT(server, IsOk());
    server_ = std::move(*server);
    config.address = "127.0.0.1:" + std::to_string(server_->port());
    n_ = static_cast<size_t>(TotalElements(layout));
    expected_ = initial;
    for (int w = 0; w < 2; ++w) {
      GrpcClientConfig mine = config;
      if (w == 1 && !second_shares_memory) mine.shared_memory = false;
      clients_[w] = std::make_unique<GrpcPsClient>(mine);
      params_[w].assign(n_, 0.0f);
      absl::StatusOr<RegistrationResult> r =
          clients_[w]->RegisterWorker({"w" + std::to_string(w), 400, 4, "cpu", ""});
      ASSERT_THAT(r, IsOk());
      ids_[w] = r->worker_id;
    }
    // The job starts once both models are accepted.
    for (int w = 0; w < 2; ++w) {
      ASSERT_THAT(clients_[w]->RegisterModel(ids_[w], layout, std::vector<float>(n_, initial),
                                             absl::MakeSpan(params_[w])),
                  IsOk());
    }
    for (int w = 0; w < 2; ++w) {
      absl::StatusOr<WorkerPlan> plan = clients_[w]->GetEpochPlan(ids_[w], 0);
      ASSERT_THAT(plan, IsOk());
      plans_[w] = *plan;
      ASSERT_EQ(plans_[w].batch_size, 2);
    }
  }

  void Step(int step) {
    absl::Status pushed[2];
    std::thread threads[2];
    for (int w = 0; w < 2; ++w) {
      threads[w] = std::thread([&, w] {
        const std::vector<float> g(n_, static_cast<float>((w + 1) * (step + 1)) / 64.0f);
        absl::StatusOr<StepOutcome> out = clients_[w]->PushGradient(
            ids_[w], 0, step, plans_[w].BatchAt(step), 0.0, 0.0, g, absl::MakeSpan(params_[w]));
        pushed[w] = out.status();
        if (out.ok()) {
          EXPECT_EQ(out->global_samples, 4);
        }
      });
    }
    for (std::thread& t : threads) t.join();
    ASSERT_THAT(pushed[0], IsOk());
    ASSERT_THAT(pushed[1], IsOk());
    expected_ -= 1.5f * static_cast<float>(step + 1) / 64.0f;
    std::vector<float> expected(n_, expected_);
    CopyRoundedAsWire(expected.data(), n_, dtype, expected.data());
    EXPECT_EQ(params_[0], params_[1]) << "step " << step;
    EXPECT_EQ(params_[0], expected) << "step " << step;
  }

  ~TwoWorkerJob() {
    if (server_ != nullptr) server_->Stop(absl::CancelledError("test over"));
  }

  bool second_shares_memory = true;    // set before Start: worker 1 pushes over the socket
  float initial = 1.0f;                // set before Start
  WireDtype dtype = WireDtype::kFp32;  // the job's (set before Start)
  const RealClock clock_;
  std::unique_ptr<PsServer> server_;
  size_t n_ = 0;
  std::unique_ptr<GrpcPsClient> clients_[2];
  std::vector<float> params_[2];
  int ids_[2] = {0, 0};
  WorkerPlan plans_[2];
  float expected_ = 1.0f;  // the server's fp32 values
};

// Two workers push steps at once against a real server, and both end every step with the same
// parameters: plain SGD on the sample-weighted mean of their gradients.
TEST(GrpcPsClientModelTest, TwoWorkersPushStepsAndHoldTheSameParameters) {
  TwoWorkerJob job;
  GrpcClientConfig config;
  config.shared_memory = false;
  ASSERT_NO_FATAL_FAILURE(job.Start(TwoWorkerConfig(), config, kTwoTensorLayout));
  for (int step = 0; step < 3; ++step) ASSERT_NO_FATAL_FAILURE(job.Step(step));
  std::vector<float> pulled(job.n_);
  absl::StatusOr<int64_t> version =
      job.clients_[0]->PullParameters(job.ids_[0], absl::MakeSpan(pulled));
  ASSERT_THAT(version, IsOk());
  EXPECT_EQ(*version, 3);
  EXPECT_EQ(pulled, job.params_[0]);
}

// A worker that dies between its pushes to the two shards of a job: its push of step 0 reached
// the leader, which completed the step, but never the follower, whose step waits for it while
// the leader's next step waits for nobody (every worker waits for the follower's answer). Before,
// the job hung until the stall timeout. The follower tells the leader once the worker timeout
// has passed; the leader removes the worker at its step 1, and both shards go on without it.
TEST(GrpcPsClientShardTest, AWorkerThatDiesBetweenItsPushesToTheShardsIsRemovedFromBoth) {
  ServerConfig c = TwoWorkerConfig();
  c.job.worker_timeout = absl::Milliseconds(300);
  c.job.stall_timeout = absl::Seconds(20);  // without the follower's report: the job ends here
  c.supervise_every = absl::Milliseconds(10);
  c.linger = absl::ZeroDuration();
  c.num_shards = 2;
  const RealClock clock;
  absl::StatusOr<std::unique_ptr<PsServer>> leader = PsServer::Start(c, &clock);
  ASSERT_THAT(leader, IsOk());
  c.shard = 1;
  c.leader = "127.0.0.1:" + std::to_string((*leader)->port());
  absl::StatusOr<std::unique_ptr<PsServer>> follower = PsServer::Start(c, &clock);
  ASSERT_THAT(follower, IsOk());
  std::ostringstream out[2];
  std::thread runners[2] = {std::thread([&] { (*leader)->Run(out[0]).IgnoreError(); }),
                            std::thread([&] { (*follower)->Run(out[1]).IgnoreError(); })};
  // Each worker reaches each shard through a client of its own, as ShardedPsClient does.
  constexpr size_t kValues = 64;  // 16 or more a shard
  const ModelLayout layout = {{"w", {kValues}, false}};
  const ValueRange range[2] = {ShardRange(kValues, 2, 0), ShardRange(kValues, 2, 1)};
  GrpcClientConfig to[2];
  to[0].address = c.leader;
  to[1].address = "127.0.0.1:" + std::to_string((*follower)->port());
  std::vector<std::unique_ptr<GrpcPsClient>> clients[2];  // [worker][shard]
  int ids[2] = {0, 0};
  WorkerPlan plans[2];
  std::vector<float> params[2] = {std::vector<float>(kValues), std::vector<float>(kValues)};
  const std::vector<float> initial(kValues, 1.0f), gradient(kValues, 0.5f);
  for (int w = 0; w < 2; ++w) {
    for (int s = 0; s < 2; ++s) clients[w].push_back(std::make_unique<GrpcPsClient>(to[s]));
    absl::StatusOr<RegistrationResult> r =
        clients[w][0]->RegisterWorker({"w" + std::to_string(w), 16, 4, "cpu", ""});
    ASSERT_THAT(r, IsOk());
    ids[w] = r->worker_id;
    clients[w][1]->AdoptRegistration(clients[w][0]->token(), clients[w][0]->wire_dtype());
  }
  for (int w = 0; w < 2; ++w) {
    for (int s = 0; s < 2; ++s) {
      const ValueRange r = range[s];
      ASSERT_THAT(
          clients[w][s]->RegisterModel(ids[w], ShardLayout(layout, r),
                                       absl::MakeConstSpan(initial).subspan(r.begin, r.size()),
                                       absl::MakeSpan(params[w]).subspan(r.begin, r.size())),
          IsOk());
    }
  }
  for (int w = 0; w < 2; ++w) {  // the job starts once both models are accepted
    absl::StatusOr<WorkerPlan> plan = clients[w][0]->GetEpochPlan(ids[w], 0);
    ASSERT_THAT(plan, IsOk());
    plans[w] = *plan;
  }
  // Pushes worker w's step to shard s.
  auto push = [&](int w, int s, int step) {
    const ValueRange r = range[s];
    return clients[w][s]->PushGradient(ids[w], 0, step, plans[w].BatchAt(step), 0.0, 0.0,
                                       absl::MakeConstSpan(gradient).subspan(r.begin, r.size()),
                                       absl::MakeSpan(params[w]).subspan(r.begin, r.size()));
  };
  absl::StatusOr<StepOutcome> victim, survivor_at_leader;
  std::thread dying([&] { victim = push(1, 0, 0); });  // never reaches the follower
  std::thread lead([&] { survivor_at_leader = push(0, 0, 0); });
  const absl::Time start = absl::Now();
  const absl::StatusOr<StepOutcome> survivor_at_follower = push(0, 1, 0);
  const absl::Duration waited = absl::Now() - start;
  dying.join();
  lead.join();
  ASSERT_THAT(victim, IsOk());
  ASSERT_THAT(survivor_at_leader, IsOk());
  ASSERT_THAT(survivor_at_follower, IsOk());
  EXPECT_GE(waited, c.job.worker_timeout) << "the follower waited the worker timeout first";
  EXPECT_EQ(survivor_at_leader->global_samples, 4);
  EXPECT_EQ(survivor_at_follower->global_samples, plans[0].BatchAt(0))
      << "the follower's step 0 without worker 1's gradient";
  EXPECT_EQ((*leader)->job()->scheduler()->History().back().dead, std::set<int>{ids[1]});
  // Neither shard shares memory, even with a client that asks (a follower may read a push
  // late): the pushes went over gRPC.
  EXPECT_FALSE(clients[0][0]->shares_memory());
  EXPECT_FALSE(clients[0][1]->shares_memory());
  // Both shards' step 1 waits for the survivor alone. The follower may answer step 0 a moment
  // before it has applied the leader's removal of worker 1 to step 1: wait for that, briefly.
  for (PsServer* server : {leader->get(), follower->get()}) {
    StepProgress p = server->job()->aggregator()->Progress();
    for (const absl::Time until = absl::Now() + absl::Seconds(5);
         p.waiting_for != std::vector<int>{ids[0]} && absl::Now() < until;
         p = server->job()->aggregator()->Progress()) {
      absl::SleepFor(absl::Milliseconds(5));
    }
    EXPECT_EQ(p.step, 1);
    EXPECT_EQ(p.waiting_for, std::vector<int>{ids[0]})
        << (server == leader->get() ? "leader" : "follower");
  }
  // Step 1 completes on both shards with the survivor alone.
  absl::StatusOr<StepOutcome> next[2];
  std::thread follow([&] { next[1] = push(0, 1, 1); });
  next[0] = push(0, 0, 1);
  follow.join();
  for (const auto& n : next) {
    ASSERT_THAT(n, IsOk());
    EXPECT_EQ(n->global_samples, plans[0].BatchAt(1));
  }
  EXPECT_THAT(out[1].str(), ::testing::IsEmpty()) << "the follower is still following";
  (*leader)->Stop(absl::CancelledError("test over"));
  (*follower)->Stop(absl::CancelledError("test over"));
  for (std::thread& t : runners) t.join();
}

// GET `path` from the status endpoint at 127.0.0.1:`port`: the whole HTTP answer.
std::string HttpGet(int port, const std::string& path) {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  std::string out;
  if (connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0) {
    const std::string req = "GET " + path + " HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n";
    if (write(fd, req.data(), req.size()) == static_cast<ssize_t>(req.size())) {
      char buf[4096];
      for (ssize_t n; (n = read(fd, buf, sizeof(buf))) > 0;) out.append(buf, n);
    }
  }
  close(fd);
  return out;
}

// The value of the sample line of `metrics` (Prometheus text) that starts with `name` and
// contains every one of `labels`; -1 when there is none.
double Sample(const std::string& metrics, const std::string& name,
              const std::vector<std::string>& labels) {
  for (absl::string_view line : absl::StrSplit(metrics, '\n')) {
    if (!absl::StartsWith(line, name + "{") && !absl::StartsWith(line, name + " ")) continue;
    bool all = true;
    for (const std::string& l : labels) all = all && absl::StrContains(line, l);
    double v = 0;
    if (all && absl::SimpleAtod(line.substr(line.rfind(' ') + 1), &v)) return v;
  }
  return -1;
}

// Two workers push every step on one push session each, and the server counts each push as
// one; a push the server refuses ends the session, and the next push opens another.
TEST(GrpcPsClientSessionTest, WorkersPushTheirStepsOnOneSessionEach) {
  ServerConfig c = TwoWorkerConfig();
  c.metrics_port = 0;
  GrpcClientConfig config;
  config.shared_memory = false;  // SharedMemoryTest pushes through it on sessions
  TwoWorkerJob job;
  ASSERT_NO_FATAL_FAILURE(job.Start(c, config, {{"a", {10}, false}, {"b", {2, 3}, false}}));
  for (int step = 0; step < 5; ++step) ASSERT_NO_FATAL_FAILURE(job.Step(step));
  EXPECT_EQ(job.clients_[0]->sessions_opened(), 1);
  EXPECT_EQ(job.clients_[1]->sessions_opened(), 1);
  // A push for a step that has not begun is refused (and ends worker 0's session); the job goes
  // on, worker 0 on a new one.
  const std::vector<float> g(job.n_, 0.0f);
  EXPECT_THAT(job.clients_[0]->PushGradient(job.ids_[0], 0, 9, job.plans_[0].BatchAt(9), 0.0, 0.0,
                                            g, absl::MakeSpan(job.params_[0])),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("does not match")));
  ASSERT_NO_FATAL_FAILURE(job.Step(5));
  EXPECT_EQ(job.clients_[0]->sessions_opened(), 2);
  EXPECT_EQ(job.clients_[1]->sessions_opened(), 1);
  const std::string metrics = HttpGet(job.server_->metrics_port(), "/metrics");
  const char* used = "method=\"PushGradientSession\"";
  EXPECT_EQ(Sample(metrics, "dbs_calls_total", {used, "code=\"OK\""}), 12) << metrics;
  EXPECT_EQ(Sample(metrics, "dbs_refused_calls_total", {used, "FAILED_PRECONDITION"}), 1)
      << metrics;
}

// Workers on the server's host push through shared memory by default: each attaches at its
// first push (one AttachSharedMemory call), every push goes on its session without the
// gradient, and every answer's values are read from the server's slots; the parameters are
// exactly those of pushes over the socket (TwoWorkerJob::Step checks every value), also where
// one worker shares memory and the other does not, in fp32 and bf16. The values
// start at 1 + 2^-10, so that the server's fp32 values are no bf16 values: a worker of a bf16
// job rounds what it reads from the slots (fp32) as the answers over the socket are rounded.
struct SharedMemoryCase {
  WireDtype dtype;
  bool second_shares;
  bool server_shares;
};

class SharedMemoryTest : public ::testing::TestWithParam<SharedMemoryCase> {};

TEST_P(SharedMemoryTest, WorkersOnTheServersHostPushThroughSharedMemory) {
  const SharedMemoryCase p = GetParam();
  ServerConfig c = TwoWorkerConfig();
  c.metrics_port = 0;
  c.job.wire_dtype = p.dtype;
  c.shared_memory = p.server_shares;
  GrpcClientConfig config;
  TwoWorkerJob job;
  job.second_shares_memory = p.second_shares;
  job.initial = 1.0f + 1.0f / 1024;
  job.dtype = p.dtype;
  ASSERT_NO_FATAL_FAILURE(job.Start(c, config, kTwoTensorLayout));
  for (int step = 0; step < 4; ++step) ASSERT_NO_FATAL_FAILURE(job.Step(step));
  EXPECT_EQ(job.clients_[0]->shares_memory(), p.server_shares);
  EXPECT_EQ(job.clients_[1]->shares_memory(), p.server_shares && p.second_shares);
  const int sharing = (p.server_shares ? 1 : 0) + (p.server_shares && p.second_shares ? 1 : 0);
  const std::string metrics = HttpGet(job.server_->metrics_port(), "/metrics");
  const int attached = p.second_shares ? 2 : 1;  // calls, answered or refused
  EXPECT_EQ(Sample(metrics, "dbs_calls_total", {"method=\"AttachSharedMemory\"", "code=\"OK\""}),
            p.server_shares ? attached : -1)
      << metrics;
  if (!p.server_shares) {
    EXPECT_EQ(Sample(metrics, "dbs_refused_calls_total",
                     {"method=\"AttachSharedMemory\"", "FAILED_PRECONDITION"}),
              attached)
        << metrics;
  }
  // Every push on a session, with its gradient in shared memory or carried.
  EXPECT_EQ(Sample(metrics, "dbs_calls_total", {"method=\"PushGradientSession\""}), 8) << metrics;
  EXPECT_EQ(Sample(metrics, "dbs_shared_memory_workers", {}), sharing) << metrics;
  std::vector<float> pulled(job.n_);
  absl::StatusOr<int64_t> version =
      job.clients_[0]->PullParameters(job.ids_[0], absl::MakeSpan(pulled));
  ASSERT_THAT(version, IsOk());
  EXPECT_EQ(*version, 4);
  EXPECT_EQ(pulled, job.params_[0]);
}

INSTANTIATE_TEST_SUITE_P(Cases, SharedMemoryTest,
                         ::testing::Values(SharedMemoryCase{WireDtype::kFp32, true, true},
                                           SharedMemoryCase{WireDtype::kFp32, false, true},
                                           SharedMemoryCase{WireDtype::kBf16, true, true},
                                           SharedMemoryCase{WireDtype::kBf16, false, true},
                                           SharedMemoryCase{WireDtype::kFp32, true, false}));

// A sharded worker abandons the other shards' calls from another thread the moment one shard
// fails (ShardedPsClient::OnAll), and a shard's push session may be ending just then: killed
// shards once crashed a worker under ASan ("pure virtual method called") when Abandon
// cancelled the context of a session already destroyed. Here every push is refused (a step
// that has not begun), which ends its session, while a second thread abandons and resumes the
// client's calls without pause; ASan and TSan (the suite runs under both) report a cancel that
// reaches an ended session. The client then pushes the real step as before.
TEST(GrpcPsClientSessionTest, AbandoningWhileSessionsEndNeverReachesAnEndedSession) {
  TwoWorkerJob job;
  ASSERT_NO_FATAL_FAILURE(
      job.Start(TwoWorkerConfig(), GrpcClientConfig{}, {{"a", {10}, false}, {"b", {2, 3}, false}}));
  GrpcPsClient& client = *job.clients_[0];
  std::atomic<bool> done{false};
  std::atomic<int> abandons{0};
  std::thread abandoner([&] {
    while (!done.load()) {
      client.Abandon();
      client.ResumeCalls();
      // 1 us to 8 ms apart, doubling: the short gaps abandon pushes in flight, the long ones
      // let pushes reach the server and be refused however slow the build (TSan) or machine.
      std::this_thread::sleep_for(std::chrono::microseconds(1 << (abandons++ % 14)));
    }
  });
  const std::vector<float> g(job.n_, 0.0f);
  int refused = 0;
  int cancelled = 0;
  const absl::Time until = absl::Now() + absl::Seconds(20);
  for (int i = 0; i < 300 || ((refused == 0 || cancelled == 0) && absl::Now() < until); ++i) {
    const absl::StatusOr<StepOutcome> r = client.PushGradient(
        job.ids_[0], 0, 9, job.plans_[0].BatchAt(9), 0.0, 0.0, g, absl::MakeSpan(job.params_[0]));
    ASSERT_FALSE(r.ok());
    if (r.status().code() == absl::StatusCode::kFailedPrecondition) {
      ++refused;
    } else {
      ASSERT_EQ(r.status().code(), absl::StatusCode::kCancelled) << r.status();
      ++cancelled;
    }
  }
  done = true;
  abandoner.join();
  client.ResumeCalls();
  EXPECT_GT(refused, 0) << "sessions were opened and ended by the server's refusal";
  EXPECT_GT(cancelled, 0) << "pushes were abandoned";
  EXPECT_GE(client.sessions_opened(), refused);
  EXPECT_GT(abandons.load(), 0);
  ASSERT_NO_FATAL_FAILURE(job.Step(0));
}

// A call refused before it starts (the client abandoned or interrupted) leaves no call in
// progress: CI's ASan run once crashed in the test above when an Abandon cancelled the context
// of such a call after its frame had gone. Refused, abandoned and completed calls all end with
// nothing for Abandon to cancel.
TEST(GrpcPsClientSessionTest, NoCallStaysInProgressBetweenCalls) {
  TwoWorkerJob job;
  ASSERT_NO_FATAL_FAILURE(
      job.Start(TwoWorkerConfig(), GrpcClientConfig{}, {{"a", {10}, false}, {"b", {2, 3}, false}}));
  GrpcPsClient& client = *job.clients_[0];
  const std::vector<float> g(job.n_, 0.0f);
  EXPECT_FALSE(client.in_call());
  client.Abandon();
  const absl::StatusOr<StepOutcome> abandoned = client.PushGradient(
      job.ids_[0], 0, 0, job.plans_[0].BatchAt(0), 0.0, 0.0, g, absl::MakeSpan(job.params_[0]));
  ASSERT_EQ(abandoned.status().code(), absl::StatusCode::kCancelled) << abandoned.status();
  EXPECT_FALSE(client.in_call()) << "an abandoned push left its context as the call in progress";
  ASSERT_EQ(client.PullParameters(job.ids_[0], absl::MakeSpan(job.params_[0])).status().code(),
            absl::StatusCode::kCancelled);
  EXPECT_FALSE(client.in_call());
  client.ResumeCalls();
  const absl::StatusOr<StepOutcome> refused = client.PushGradient(
      job.ids_[0], 0, 9, job.plans_[0].BatchAt(9), 0.0, 0.0, g, absl::MakeSpan(job.params_[0]));
  ASSERT_EQ(refused.status().code(), absl::StatusCode::kFailedPrecondition) << refused.status();
  EXPECT_FALSE(client.in_call());
  ASSERT_NO_FATAL_FAILURE(job.Step(0));
  EXPECT_FALSE(client.in_call());
}

// Four workers register a model larger than a chunk at the same moment, each with values of its
// own: one worker's values go up (one RegisterModel with values), the others wait for them, and
// every worker ends with those values.
TEST(GrpcPsClientModelTest, WorkersRegisteringAtOnceSendOneCopyOfTheModel) {
  ServerConfig c;
  c.host = "127.0.0.1";
  c.port = 0;
  c.metrics_port = 0;
  c.job.scheduler.expected_workers = 4;
  std::atomic<int> released{0};
  c.release_freed_memory = [&] { ++released; };
  const RealClock clock;
  absl::StatusOr<std::unique_ptr<PsServer>> server = PsServer::Start(c, &clock);
  ASSERT_THAT(server, IsOk());
  const GrpcClientConfig config = ClientOf(**server);
  const ModelLayout layout = kTwoTensorLayout;
  constexpr int kWorkers = 4;
  constexpr size_t kValues = 3000;
  std::vector<std::unique_ptr<GrpcPsClient>> clients;
  std::vector<int> ids;
  for (int w = 0; w < kWorkers; ++w) {
    clients.push_back(std::make_unique<GrpcPsClient>(config));
    absl::StatusOr<RegistrationResult> r =
        clients[w]->RegisterWorker({"w" + std::to_string(w), 16, 4, "cpu", ""});
    ASSERT_THAT(r, IsOk());
    ids.push_back(r->worker_id);
  }
  std::vector<std::vector<float>> params(kWorkers, std::vector<float>(kValues, -1.0f));
  absl::Status registered[kWorkers];
  {
    absl::Barrier* go = new absl::Barrier(kWorkers);
    std::vector<std::thread> threads;
    for (int w = 0; w < kWorkers; ++w) {
      threads.emplace_back([&, w] {
        const std::vector<float> initial(kValues, static_cast<float>(w + 1));
        if (go->Block()) delete go;
        registered[w] =
            clients[w]->RegisterModel(ids[w], layout, initial, absl::MakeSpan(params[w]));
      });
    }
    for (std::thread& t : threads) t.join();
  }
  for (int w = 0; w < kWorkers; ++w) ASSERT_THAT(registered[w], IsOk()) << "worker " << w;
  const float winner = params[0][0];
  EXPECT_GE(winner, 1.0f);
  EXPECT_LE(winner, static_cast<float>(kWorkers));
  for (int w = 0; w < kWorkers; ++w) {
    EXPECT_EQ(params[w], std::vector<float>(kValues, winner)) << "worker " << w;
  }
  const std::string metrics = HttpGet((*server)->metrics_port(), "/metrics");
  // One copy of the model's bytes came up, not four (the rest: headers and layouts): no worker
  // sent its values while another did.
  const double received = Sample(metrics, "dbs_received_bytes_total", {});
  EXPECT_GT(received, kValues * 4.0);
  EXPECT_LT(received, kValues * 4.0 * 1.5) << metrics;
  EXPECT_EQ(released.load(), 1) << "four registrations, one of them storing the values";
  (*server)->Stop(absl::CancelledError("test over"));
}

}  // namespace
}  // namespace dbs
