// PsServer in-process: the configuration is checked in one place, the server serves on a port
// picked at run time and writes it, a stop ends the job with a summary, and a checkpoint of
// another job is refused at start.
#include "server/ps_server.h"

#include <cstring>
#include <fstream>
#include <limits>
#include <optional>
#include <sstream>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "common/clock.h"
#include "common/rpc/grpc_status.h"
#include "common/step_wire.h"
#include "gmock/gmock.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "proto/dbs.grpc.pb.h"
#include "proto/health.grpc.pb.h"
#include "server/checkpoint.h"
#include "tests/push_once.h"
#include "tests/status_matchers.h"

namespace dbs {
namespace {

using ::testing::HasSubstr;

ServerConfig SmallConfig() {
  ServerConfig c;
  c.host = "127.0.0.1";
  c.port = 0;
  c.job.scheduler.expected_workers = 2;
  c.job.scheduler.epochs = 1;
  c.job.scheduler.global_batch = 8;
  c.linger = absl::ZeroDuration();
  c.supervise_every = absl::Milliseconds(10);
  return c;
}

std::string ReadFile(const std::string& path) {
  std::ifstream in(path);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

// A worker driven by hand over gRPC: joins the job on `port`, registers a model of `values`
// fp32 zeros and gets epoch 0's plan.
struct HandWorker {
  std::shared_ptr<grpc::Channel> channel;
  std::unique_ptr<v1::SchedulerService::Stub> sched;
  std::unique_ptr<v1::ParameterService::Stub> params;
  v1::RegisterWorkerReply joined;
  v1::EpochPlan plan;

  void Sign(grpc::ClientContext* ctx) const { ctx->AddMetadata(kWorkerTokenKey, joined.token()); }

  // One push on a push session of its own, and its answer.
  grpc::Status Push(const v1::PushGradientRequest& push, v1::PushGradientReply* reply) const {
    grpc::ClientContext ctx;
    Sign(&ctx);
    return PushOnce(params.get(), &ctx, push, reply);
  }

  void Join(int port, int values) {
    channel = grpc::CreateChannel("127.0.0.1:" + std::to_string(port),
                                  grpc::InsecureChannelCredentials());
    sched = v1::SchedulerService::NewStub(channel);
    params = v1::ParameterService::NewStub(channel);
    v1::RegisterWorkerRequest reg;
    reg.set_name("w0");
    reg.set_train_samples(16);
    reg.set_test_samples(4);
    {
      grpc::ClientContext ctx;
      ASSERT_THAT(sched->RegisterWorker(&ctx, reg, &joined), IsOk());
    }
    {
      v1::RegisterModelRequest req;
      v1::Tensor* t = req.add_parameters();
      t->set_name("w");
      t->add_shape(values);
      t->set_data(std::string(4 * values, '\0'));
      v1::Parameters reply;
      grpc::ClientContext ctx;
      Sign(&ctx);
      ASSERT_THAT(params->RegisterModel(&ctx, req, &reply), IsOk());
    }
    v1::GetEpochPlanRequest req;
    grpc::ClientContext ctx;
    Sign(&ctx);
    ASSERT_THAT(sched->GetEpochPlan(&ctx, req, &plan), IsOk());
  }
};

// A server for one worker at lr 1 (the first step has no momentum yet, so the parameters
// become minus the gradient), run on a thread of its own until the object goes.
class OneWorkerServer {
 public:
  explicit OneWorkerServer(ServerConfig c) {
    c.job.scheduler.expected_workers = 1;
    c.job.optimizer.sgd.lr = 1.0;
    absl::StatusOr<std::unique_ptr<PsServer>> started = PsServer::Start(c, &clock_);
    status_ = started.status();
    if (!started.ok()) return;
    server_ = *std::move(started);
    runner_ = std::thread([this] { result_ = server_->Run(out_); });
  }
  ~OneWorkerServer() {
    if (server_ == nullptr) return;
    server_->Stop(absl::CancelledError("test over"));
    runner_.join();
  }
  const absl::Status& status() const { return status_; }
  int port() const { return server_->port(); }

 private:
  const RealClock clock_;
  absl::Status status_;
  std::unique_ptr<PsServer> server_;
  std::ostringstream out_;
  absl::Status result_;
  std::thread runner_;
};

TEST(ValidateServerConfigTest, NamesTheSettingAndNoFlag) {
  ServerConfig c = SmallConfig();
  EXPECT_THAT(ValidateServerConfig(c), IsOk());
  struct Case {
    void (*change)(ServerConfig&);
    const char* message;
  };
  const Case cases[] = {
      {[](ServerConfig& c) { c.port = 70000; }, "port must be in [0, 65535]"},
      {[](ServerConfig& c) { c.max_message_mb = 0; }, "max_message_mb must be in [1, 2047]"},
      {[](ServerConfig& c) { c.restore = true; }, "restore needs a checkpoint_dir"},
      {[](ServerConfig& c) { c.job.scheduler.expected_workers = 0; }, "workers must be >= 1"},
      {[](ServerConfig& c) { c.job.scheduler.epochs = 0; }, "epochs must be in [1, 1000000]"},
      {[](ServerConfig& c) { c.job.scheduler.expected_workers = 5000; }, "workers must be at most"},
      {[](ServerConfig& c) { c.job.scheduler.global_batch = 1 << 30; }, "global_batch must be in"},
      {[](ServerConfig& c) { c.job.min_batch = 5; }, "min_batch times workers exceeds"},
      {[](ServerConfig& c) { c.job.max_batch = -1; }, "batch bounds"},
      {[](ServerConfig& c) { c.job.smoothing = 0; }, "smoothing must be in (0, 1]"},
      {[](ServerConfig& c) { c.job.optimizer.sgd.lr = -1; }, "sgd needs lr > 0"},
      {[](ServerConfig& c) { c.job.optimizer.name = "lion"; }, "unknown optimizer 'lion'"},
      {[](ServerConfig& c) { c.job.replan_threshold = 1.0; }, "replan_threshold must be > 1"},
      {[](ServerConfig& c) { c.job.replan_window_steps = -2; }, "replan_window_steps"},
      {[](ServerConfig& c) { c.job.checkpoint_every_steps = 0; }, "checkpoint_every_steps"},
      {[](ServerConfig& c) { c.job.worker_timeout = absl::Seconds(-1); }, "worker_timeout"},
  };
  for (const Case& k : cases) {
    ServerConfig bad = SmallConfig();
    k.change(bad);
    const absl::Status s = ValidateServerConfig(bad);
    EXPECT_THAT(s, StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr(k.message)));
    EXPECT_THAT(std::string(s.message()), ::testing::Not(HasSubstr("--")));
    // Start refuses the same configuration before it listens.
    EXPECT_THAT(PsServer::Start(bad, nullptr), StatusCodeIs(absl::StatusCode::kInvalidArgument));
  }
}

TEST(PsServerTest, ServesOnAPickedPortAndStopsWithASummary) {
  const std::string dir = ::testing::TempDir();
  ServerConfig c = SmallConfig();
  c.port_file = dir + "/ps_server_test.port";
  c.summary_path = dir + "/ps_server_test.summary.json";
  const RealClock clock;
  absl::StatusOr<std::unique_ptr<PsServer>> server = PsServer::Start(c, &clock);
  ASSERT_THAT(server, IsOk());
  const int port = (*server)->port();
  ASSERT_GT(port, 0);
  EXPECT_EQ(ReadFile(c.port_file), std::to_string(port) + "\n");

  // A worker can join over gRPC.
  auto channel =
      grpc::CreateChannel("127.0.0.1:" + std::to_string(port), grpc::InsecureChannelCredentials());
  auto stub = v1::SchedulerService::NewStub(channel);
  v1::RegisterWorkerRequest req;
  req.set_name("w0");
  req.set_train_samples(16);
  req.set_test_samples(4);
  v1::RegisterWorkerReply reply;
  grpc::ClientContext ctx;
  ASSERT_THAT(stub->RegisterWorker(&ctx, req, &reply), IsOk());
  EXPECT_EQ(reply.expected_workers(), 2);

  // The second worker never comes; a signal stops the job.
  std::thread stopper([&] {
    absl::SleepFor(absl::Milliseconds(50));
    (*server)->Stop(absl::CancelledError("stopped by the test"));
  });
  std::ostringstream out;
  const absl::Status result = (*server)->Run(out);
  stopper.join();
  EXPECT_THAT(result, StatusIs(absl::StatusCode::kCancelled, HasSubstr("stopped by the test")));
  EXPECT_THAT(out.str(), HasSubstr("dbs run summary: policy=dbs"));
  const nlohmann::json summary = nlohmann::json::parse(ReadFile(c.summary_path));
  EXPECT_EQ(summary.at("policy"), "dbs");

  // After Run the port is closed.
  auto probe = v1::SchedulerService::NewStub(
      grpc::CreateChannel("127.0.0.1:" + std::to_string(port), grpc::InsecureChannelCredentials()));
  grpc::ClientContext probe_ctx;
  probe_ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Milliseconds(500)));
  EXPECT_EQ(probe->RegisterWorker(&probe_ctx, req, &reply).error_code(),
            grpc::StatusCode::UNAVAILABLE);
}

TEST(PsServerTest, PlanRequestsWhoseClientsGaveUpAreDropped) {
  // A client whose calls time out over and over (a flood, or a flaky link) must not fill the
  // server with waiters: each abandoned call's wait is withdrawn when gRPC cancels it. (Before,
  // they were kept until the plan existed, and the 17th got RESOURCE_EXHAUSTED.)
  const RealClock clock;
  absl::StatusOr<std::unique_ptr<PsServer>> server = PsServer::Start(SmallConfig(), &clock);
  ASSERT_THAT(server, IsOk());
  auto channel = grpc::CreateChannel("127.0.0.1:" + std::to_string((*server)->port()),
                                     grpc::InsecureChannelCredentials());
  auto stub = v1::SchedulerService::NewStub(channel);
  auto register_worker = [&](const std::string& name) {
    v1::RegisterWorkerRequest req;
    req.set_name(name);
    req.set_train_samples(16);
    req.set_test_samples(4);
    v1::RegisterWorkerReply reply;
    grpc::ClientContext ctx;
    EXPECT_THAT(stub->RegisterWorker(&ctx, req, &reply), IsOk());
    // The job starts once its workers' models are accepted.
    v1::RegisterModelRequest model;
    model.set_worker_id(reply.worker_id());
    v1::Tensor* t = model.add_parameters();
    t->set_name("w");
    t->add_shape(4);
    t->set_data(std::string(16, '\0'));
    v1::Parameters accepted;
    grpc::ClientContext model_ctx;
    model_ctx.AddMetadata(kWorkerTokenKey, reply.token());
    EXPECT_THAT(v1::ParameterService::NewStub(channel)->RegisterModel(&model_ctx, model, &accepted),
                IsOk());
    return reply.token();
  };
  const std::string token = register_worker("w0");
  auto ask = [&](absl::Duration deadline, v1::EpochPlan* plan) {
    v1::GetEpochPlanRequest req;
    req.set_worker_id(0);
    req.set_epoch(0);
    grpc::ClientContext ctx;
    ctx.AddMetadata(kWorkerTokenKey, token);
    ctx.set_deadline(absl::ToChronoTime(absl::Now() + deadline));
    return stub->GetEpochPlan(&ctx, req, plan);
  };
  // The server withdraws a wait when gRPC tells it of the cancellation, which may come a moment
  // after the client's deadline (under ThreadSanitizer, on a loaded machine): a call refused
  // because the earlier waits are not withdrawn yet is asked again, for at most 5 s. Waits that
  // were never withdrawn (the bug) keep it refused.
  for (int i = 0; i < 3 * kMaxWaitersPerWorker; ++i) {
    v1::EpochPlan plan;
    grpc::StatusCode code = ask(absl::Milliseconds(30), &plan).error_code();
    for (const absl::Time until = absl::Now() + absl::Seconds(5);
         code == grpc::StatusCode::RESOURCE_EXHAUSTED && absl::Now() < until;
         code = ask(absl::Milliseconds(30), &plan).error_code()) {
      absl::SleepFor(absl::Milliseconds(50));
    }
    ASSERT_EQ(code, grpc::StatusCode::DEADLINE_EXCEEDED) << "call " << i;
  }
  // The one call still waiting gets the plan once the second worker joins.
  v1::EpochPlan plan;
  grpc::Status waited;
  std::thread waiter([&] { waited = ask(absl::Seconds(20), &plan); });
  absl::SleepFor(absl::Milliseconds(100));
  register_worker("w1");
  waiter.join();
  EXPECT_THAT(waited, IsOk()) << waited.error_message();
  EXPECT_EQ(plan.epoch(), 0);
  (*server)->Stop(absl::CancelledError("test over"));
  std::ostringstream out;
  EXPECT_THAT((*server)->Run(out), StatusCodeIs(absl::StatusCode::kCancelled));
}

grpc::health::v1::HealthCheckResponse::ServingStatus Health(int port) {
  auto stub = grpc::health::v1::Health::NewStub(
      grpc::CreateChannel("127.0.0.1:" + std::to_string(port), grpc::InsecureChannelCredentials()));
  grpc::health::v1::HealthCheckRequest req;
  grpc::health::v1::HealthCheckResponse reply;
  grpc::ClientContext ctx;
  ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(10)));
  const grpc::Status s = stub->Check(&ctx, req, &reply);
  EXPECT_TRUE(s.ok()) << s.error_message();
  return reply.status();
}

TEST(PsServerTest, HealthIsServingWhileTheJobRunsAndNotServingOnceItIsOver) {
  // One worker trains a one-epoch job by hand over gRPC and does not leave, so the server
  // lingers after the job: the health service says SERVING during the job and NOT_SERVING after.
  ServerConfig c = SmallConfig();
  c.job.scheduler.expected_workers = 1;
  c.linger = absl::Seconds(60);
  const RealClock clock;
  absl::StatusOr<std::unique_ptr<PsServer>> server = PsServer::Start(c, &clock);
  ASSERT_THAT(server, IsOk());
  const int port = (*server)->port();
  EXPECT_EQ(Health(port), grpc::health::v1::HealthCheckResponse::SERVING);
  std::ostringstream out;
  absl::Status result;
  std::thread runner([&] { result = (*server)->Run(out); });
  HandWorker w;
  w.Join(port, 2);
  const v1::EpochPlan& plan = w.plan;
  auto* sched = w.sched.get();
  auto signed_ctx = [&w](grpc::ClientContext* ctx, const std::string&) { w.Sign(ctx); };
  const v1::RegisterWorkerReply& joined = w.joined;
  EXPECT_EQ(Health(port), grpc::health::v1::HealthCheckResponse::SERVING);
  for (int step = 0; step < plan.num_steps(); ++step) {
    v1::PushGradientRequest push;
    push.set_step(step);
    push.set_num_samples(step + 1 < plan.num_steps() ? plan.batch_size() : plan.final_batch_size());
    push.set_gradient(std::string(8, '\0'));  // two fp32 zeros
    v1::PushGradientReply reply;
    ASSERT_THAT(w.Push(push, &reply), IsOk());
    // The reply the server assembles from shared bytes is an ordinary message.
    EXPECT_EQ(reply.values().version(), step + 1);
    EXPECT_EQ(reply.values().values().size(), 8u);
  }
  {
    v1::EpochReport report;
    report.set_samples(16);
    report.set_compute_seconds(1.0);
    report.set_test_samples(4);
    v1::EpochReportReply reply;
    grpc::ClientContext ctx;
    signed_ctx(&ctx, joined.token());
    ASSERT_THAT(sched->ReportEpoch(&ctx, report, &reply), IsOk());
  }
  // The job is over; the worker has not left, so the server lingers, no longer serving.
  grpc::health::v1::HealthCheckResponse::ServingStatus status =
      grpc::health::v1::HealthCheckResponse::SERVING;
  for (int i = 0; i < 400 && status == grpc::health::v1::HealthCheckResponse::SERVING; ++i) {
    absl::SleepFor(absl::Milliseconds(25));
    status = Health(port);
  }
  EXPECT_EQ(status, grpc::health::v1::HealthCheckResponse::NOT_SERVING);
  {
    v1::LeaveRequest leave;
    v1::LeaveReply reply;
    grpc::ClientContext ctx;
    signed_ctx(&ctx, joined.token());
    EXPECT_THAT(sched->Leave(&ctx, leave, &reply), IsOk());
  }
  runner.join();
  EXPECT_THAT(result, IsOk());
}

TEST(PsServerTest, AReportOfMissingPushesComesOnlyFromTheFollowerItself) {
  ServerConfig c = SmallConfig();
  c.num_shards = 2;
  c.job_token = "the-job-secret";
  const RealClock clock;
  absl::StatusOr<std::unique_ptr<PsServer>> leader = PsServer::Start(c, &clock);
  ASSERT_THAT(leader, IsOk());
  auto stub = v1::ShardService::NewStub(grpc::CreateChannel(
      "127.0.0.1:" + std::to_string((*leader)->port()), grpc::InsecureChannelCredentials()));
  v1::MissingPushes req;
  req.set_shard(1);
  req.set_epoch(0);
  req.set_step(0);
  req.add_workers(0);
  auto report = [&](const std::string& secret) {
    grpc::ClientContext ctx;
    if (!secret.empty()) ctx.AddMetadata(kJobTokenKey, secret);
    v1::MissingPushesReply reply;
    return FromGrpcStatus(stub->ReportMissing(&ctx, req, &reply));
  };
  EXPECT_THAT(report(""),
              StatusIs(absl::StatusCode::kUnauthenticated, HasSubstr("needs the job's secret")));
  EXPECT_THAT(report("a-guess"), StatusIs(absl::StatusCode::kUnauthenticated, ::testing::_));
  EXPECT_THAT(report(c.job_token), StatusIs(absl::StatusCode::kPermissionDenied,
                                            HasSubstr("comes only from shard 1 itself")));
  ServerConfig f = c;
  f.shard = 1;
  f.leader = "127.0.0.1:" + std::to_string((*leader)->port());
  absl::StatusOr<std::unique_ptr<PsServer>> follower = PsServer::Start(f, &clock);
  ASSERT_THAT(follower, IsOk());
  // Once the follower follows (the leader's log has a reader), a worker's call with the secret
  // is still not the follower's.
  for (int i = 0; i < 3000 && !(*leader)->shard_log()->Admit().ok(); ++i) {
    absl::SleepFor(absl::Milliseconds(10));  // the follower connects on a thread of its own
  }
  ASSERT_THAT((*leader)->shard_log()->Admit(), IsOk());
  EXPECT_THAT(report(c.job_token), StatusIs(absl::StatusCode::kPermissionDenied,
                                            HasSubstr("comes only from shard 1 itself")));
  EXPECT_EQ((*leader)->job()->aggregator()->Progress().epoch, -1);
  (*follower)->Stop(absl::CancelledError("test over"));
  (*leader)->Stop(absl::CancelledError("test over"));
}

TEST(MemoryQuotaShortfallTest, AQuotaMustHoldEveryWorkersPushAndTheHeadroom) {
  ServerConfig c = SmallConfig();
  c.job.scheduler.expected_workers = 4;
  c.job.wire_dtype = WireDtype::kFp32;
  // 10M fp32 values: 4 x 38.1 MiB + 16 = 168.6 MiB.
  c.memory_quota_mb = 168;
  const std::optional<std::string> short_by = MemoryQuotaShortfall(c, 10'000'000);
  ASSERT_TRUE(short_by.has_value());
  EXPECT_THAT(*short_by, HasSubstr("--memory_quota_mb=168"));
  EXPECT_THAT(*short_by, HasSubstr("4 workers x 38.1 MiB (10000000 values in fp32) + 16 MiB"));
  EXPECT_THAT(*short_by, HasSubstr("raise --memory_quota_mb to 169"));
  c.memory_quota_mb = 169;
  EXPECT_EQ(MemoryQuotaShortfall(c, 10'000'000), std::nullopt);
  // bf16 on the wire halves the pushes.
  c.job.wire_dtype = WireDtype::kBf16;
  c.memory_quota_mb = 93;
  EXPECT_EQ(MemoryQuotaShortfall(c, 10'000'000), std::nullopt);
  c.memory_quota_mb = 92;
  EXPECT_TRUE(MemoryQuotaShortfall(c, 10'000'000).has_value());
  // The default quota holds a 25M model's pushes from 40 workers.
  c.job.wire_dtype = WireDtype::kFp32;
  c.job.scheduler.expected_workers = 40;
  c.memory_quota_mb = ServerConfig().memory_quota_mb;
  EXPECT_EQ(MemoryQuotaShortfall(c, 25'000'000), std::nullopt);
}

TEST(PsServerTest, APushAndItsAnswerOfSeveralMiBAreExact) {
  // A model, push and answer of 3 MiB each, each one message.
  ServerConfig c = SmallConfig();
  OneWorkerServer server(c);
  ASSERT_THAT(server.status(), IsOk());
  constexpr int kValues = 3 << 18;  // under the client's 4 MiB default largest message
  HandWorker w;
  w.Join(server.port(), kValues);
  std::vector<float> gradient(kValues);
  for (int i = 0; i < kValues; ++i) gradient[i] = static_cast<float>(i % 1000) / 8;
  v1::PushGradientRequest push;
  push.set_num_samples(w.plan.batch_size());
  push.set_gradient(std::string(reinterpret_cast<const char*>(gradient.data()), 4u * kValues));
  v1::PushGradientReply reply;
  ASSERT_THAT(w.Push(push, &reply), IsOk());
  EXPECT_EQ(reply.global_samples(), w.plan.batch_size());
  ASSERT_EQ(reply.values().values().size(), 4u * kValues);
  std::vector<float> got(kValues);
  std::memcpy(got.data(), reply.values().values().data(), 4u * kValues);
  for (int i = 0; i < kValues; ++i) {
    ASSERT_EQ(got[i], -gradient[i]) << "value " << i;  // lr 1 from zeros: minus the gradient
  }
}

TEST(PsServerTest, APortInUseIsAClearError) {
  const RealClock clock;
  absl::StatusOr<std::unique_ptr<PsServer>> first = PsServer::Start(SmallConfig(), &clock);
  ASSERT_THAT(first, IsOk());
  ServerConfig c = SmallConfig();
  c.port = (*first)->port();
  EXPECT_THAT(PsServer::Start(c, &clock),
              StatusIs(absl::StatusCode::kUnavailable, HasSubstr("cannot listen on 127.0.0.1:")));
}

TEST(PsServerTest, RestoreIfPresentStartsANewJobWithoutACheckpoint) {
  ServerConfig c = SmallConfig();
  c.restore_if_present = true;
  c.job.checkpoint_dir = ::testing::TempDir() + "/ps_server_test_if_present";
  const RealClock clock;
  absl::StatusOr<std::unique_ptr<PsServer>> server = PsServer::Start(c, &clock);
  EXPECT_THAT(server, IsOk());
}

TEST(PsServerTest, RestoreWithoutACheckpointSaysSo) {
  ServerConfig c = SmallConfig();
  c.restore = true;
  c.job.checkpoint_dir = ::testing::TempDir() + "/ps_server_test_empty_dir";
  const RealClock clock;
  EXPECT_THAT(PsServer::Start(c, &clock), ::testing::Not(IsOk()));
}

}  // namespace
}  // namespace dbs
