// GrpcPsClient against a server that accepts calls and never answers them (a hung or
// livelocked peer): every call ends by its deadline instead of hanging the worker. A call that
// answers at once is retried within --connect_timeout_s; a waiting call (plan, push) is asked
// again each --call_timeout_s, and gives up after --max_wait_s.
#include "worker/grpc_ps_client.h"

#include <atomic>
#include <memory>
#include <string>

#include "common/status_matchers.h"
#include "common/waiting_reactor.h"
#include "gmock/gmock.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "proto/dbs.grpc.pb.h"

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

class GrpcPsClientDeadlineTest : public ::testing::Test {
 protected:
  void SetUp() override {
    grpc::ServerBuilder builder;
    int port = 0;
    builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
    builder.RegisterService(&hole_);
    server_ = builder.BuildAndStart();
    ASSERT_NE(port, 0);
    config_.address = "127.0.0.1:" + std::to_string(port);
    config_.call_timeout = absl::Milliseconds(100);
    config_.connect_timeout = absl::Seconds(1);
    config_.backoff.initial = absl::Milliseconds(10);
    config_.backoff.max = absl::Milliseconds(50);
  }
  void TearDown() override { server_->Shutdown(); }

  BlackHole hole_;
  std::unique_ptr<grpc::Server> server_;
  GrpcClientConfig config_;
};

TEST_F(GrpcPsClientDeadlineTest, ACallThatIsNeverAnsweredIsRetriedThenFails) {
  GrpcPsClient client(config_);
  EpochTiming timing;
  // Returns at all (before this change it waited forever), with the call named.
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

}  // namespace
}  // namespace dbs
