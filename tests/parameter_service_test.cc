// The gRPC adapters with a real in-process server on a loopback port picked at run time:
// bad input is refused with the right code and leaves the step unaffected.
#include "server/parameter_service.h"

#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/synchronization/notification.h"
#include "common/call_observer.h"
#include "common/clock.h"
#include "common/rpc/grpc_status.h"
#include "common/rpc/grpc_step_wire.h"
#include "common/shared_memory.h"
#include "common/step_wire.h"
#include "common/tensor_codec.h"
#include "common/tsan.h"
#include "gmock/gmock.h"
#include "grpcpp/generic/generic_stub.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "server/scheduler_service.h"
#include "server/training_job.h"
#include "tests/loopback_server.h"
#include "tests/push_once.h"
#include "tests/status_matchers.h"
#include "tests/values_field.h"

namespace dbs {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

const ModelLayout kLayout = {{"w", {2}}, {"b", {1}}};

// What the service tells its observer of shared memory.
class SharingObserver : public CallObserver {
 public:
  void OnCall(const char*, size_t, size_t, int) override {}
  void OnSharedMemoryWorkers(int workers) override { workers_ = workers; }
  void OnSharedAnswerOverGrpc() override { ++over_grpc_; }
  int workers() const { return workers_; }
  int over_grpc() const { return over_grpc_; }

 private:
  std::atomic<int> workers_{-1};  // -1: never told
  std::atomic<int> over_grpc_{0};
};

class ServiceTest : public ::testing::Test {
 protected:
  void SetUp() override {
    JobConfig config;
    config.scheduler.expected_workers = 2;
    config.scheduler.epochs = 1;
    config.scheduler.global_batch = 4;
    config.policy = PolicyKind::kDbs;
    config.optimizer.name = "sgd";
    config.optimizer.sgd = SgdConfig{0.5, 0.0, 0.0, false};
    // Bad input is refused and its worker kept: the adapter's refusals, as a job with
    // --faulty_gradients=off gives them (quarantine: hardening_test, faulty_worker_test).
    config.screen.mode = FaultyGradients::kOff;
    job_ = *TrainingJob::Create(config, &clock_);
    scheduler_service_ = std::make_unique<SchedulerServiceImpl>(job_->scheduler());
    Scheduler* s = job_->scheduler();
    parameter_service_ = std::make_unique<ParameterServiceImpl>(
        job_->store(), job_->aggregator(),
        [s](int id, absl::string_view token, absl::string_view identity) {
          return s->Authenticate(id, token, identity);
        },
        nullptr, CallHooks{&sharing_, nullptr}, wire_dtype_);
    parameter_service_->SetFreedMemoryHook([this] { ++freed_memory_hooks_; });
    parameter_service_->ServeSharedMemory(serve_shared_memory_);
    grpc::ServerBuilder builder;
    int port = 0;
    builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
    builder.RegisterService(scheduler_service_.get());
    builder.RegisterService(parameter_service_.get());
    server_ = builder.BuildAndStart();
    ASSERT_NE(port, 0);
    channel_ = grpc::CreateChannel("127.0.0.1:" + std::to_string(port),
                                   grpc::InsecureChannelCredentials());
    sched_ = v1::SchedulerService::NewStub(channel_);
    params_ = v1::ParameterService::NewStub(channel_);

    // Two workers on an 8-sample data set: 2 steps of batch 2 + 2.
    for (const char* name : {"w0", "w1"}) {
      v1::RegisterWorkerRequest req;
      req.set_name(name);
      req.set_train_samples(train_samples_);
      req.set_test_samples(2);
      v1::RegisterWorkerReply reply;
      grpc::ClientContext ctx;
      ASSERT_THAT(sched_->RegisterWorker(&ctx, req, &reply), IsOk());
      tokens_.push_back(reply.token());
    }
    for (int id = 0; id < 2; ++id) {
      v1::RegisterModelRequest req;
      req.set_worker_id(id);
      // Worker 1's initial values differ: the first registration wins.
      std::vector<float> init = id == 0 ? std::vector<float>{1, 2, 3} : std::vector<float>{9, 9, 9};
      EncodeTensors(kLayout, init, req.mutable_parameters());
      v1::Parameters reply;
      grpc::ClientContext ctx;
      Sign(&ctx, req.worker_id());
      ASSERT_THAT(params_->RegisterModel(&ctx, req, &reply), IsOk());
      std::vector<float> got(3);
      ASSERT_THAT(DecodeParameters(reply, kLayout, absl::MakeSpan(got)), IsOk());
      EXPECT_EQ(got, (std::vector<float>{1, 2, 3}));
    }
    // Once, for the registration that stored the values (main releases freed memory there).
    EXPECT_EQ(freed_memory_hooks_.load(), 1);
  }

  void TearDown() override {
    job_->Abort(absl::CancelledError("test over"));
    server_->Shutdown();
  }

  v1::PushGradientRequest Push(int id, int step, const std::vector<float>& g) {
    v1::PushGradientRequest req;
    req.set_worker_id(id);
    req.set_epoch(0);
    req.set_step(step);
    req.set_num_samples(2);
    req.set_loss_sum(1.0);
    req.set_wire_dtype(static_cast<v1::WireDtype>(wire_dtype_));
    std::string bytes(g.size() * BytesPerValue(wire_dtype_), '\0');
    EncodeValues(g, wire_dtype_, reinterpret_cast<uint8_t*>(bytes.data()));
    req.set_gradient(bytes);
    return req;
  }

  // The values an answer carries, decoded from the job's wire dtype.
  std::vector<float> Carried(const v1::PushGradientReply& reply) {
    std::vector<float> values(reply.values().values().size() / BytesPerValue(wire_dtype_));
    DecodeValues(reinterpret_cast<const uint8_t*>(reply.values().values().data()), wire_dtype_,
                 absl::MakeSpan(values));
    return values;
  }

  // Adds the credential of `worker_id` (the one from its registration; none for unknown ids).
  void Sign(grpc::ClientContext* ctx, int worker_id) {
    if (worker_id >= 0 && worker_id < static_cast<int>(tokens_.size())) {
      ctx->AddMetadata(kWorkerTokenKey, tokens_[worker_id]);
    }
  }

  grpc::Status Send(const v1::PushGradientRequest& req, v1::PushGradientReply* reply) {
    grpc::ClientContext ctx;
    Sign(&ctx, req.worker_id());
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(20));
    return PushOnce(params_.get(), &ctx, req, reply);
  }

  // AttachSharedMemory for worker `id`'s gradient region at `where` (signed unless `sign` is
  // false).
  grpc::Status Attach(int id, const RegionLocation& where, v1::AttachSharedMemoryReply* reply,
                      bool sign = true) {
    v1::AttachSharedMemoryRequest req;
    req.set_worker_id(id);
    req.mutable_gradient()->set_pid(where.pid);
    req.mutable_gradient()->set_fd(where.fd);
    req.mutable_gradient()->set_bytes(where.bytes);
    grpc::ClientContext ctx;
    if (sign) Sign(&ctx, id);
    return params_->AttachSharedMemory(&ctx, req, reply);
  }

  // The server's parameter slots an attach answered with, opened as a worker opens them.
  static absl::StatusOr<std::unique_ptr<SharedRegion>> OpenSlots(
      const v1::AttachSharedMemoryReply& reply) {
    return SharedRegion::Open(RegionLocation{reply.parameters().pid(), reply.parameters().fd(),
                                             reply.parameters().bytes()},
                              "dbs-parameters");
  }

  // Worker `id`'s push of `step` with its gradient in its region and its answer in the slots.
  v1::PushGradientRequest SharedPush(int id, int step) {
    v1::PushGradientRequest req = Push(id, step, {});
    req.clear_gradient();
    req.set_gradient_in_shared_memory(true);
    req.set_answer_in_shared_memory(true);
    return req;
  }

  // Step `step` with worker 0's gradient `g0` in its attached `region` and worker 1's `g1`
  // carried.
  void SharedStep(int step, SharedRegion* region, const std::vector<float>& g0,
                  const std::vector<float>& g1, v1::PushGradientReply* r0,
                  v1::PushGradientReply* r1) {
    EncodeValues(g0, wire_dtype_, region->data());
    grpc::Status s0;
    std::thread t([&]() { s0 = Send(SharedPush(0, step), r0); });
    EXPECT_THAT(Send(Push(1, step, g1), r1), IsOk());
    t.join();
    EXPECT_THAT(s0, IsOk()) << s0.error_message();
  }

  std::vector<float> Current(int64_t* version) {
    v1::PullParametersRequest req;
    req.set_worker_id(0);
    v1::Parameters reply;
    grpc::ClientContext ctx;
    Sign(&ctx, req.worker_id());
    EXPECT_THAT(params_->PullParameters(&ctx, req, &reply), IsOk());
    std::vector<float> got(3);
    EXPECT_THAT(DecodeParameters(reply, kLayout, absl::MakeSpan(got)), IsOk());
    *version = reply.version();
    return got;
  }

  // Runs step 0 with both workers' correct gradients; returns worker 0's reply (and worker 1's
  // in `*r1_out` unless null).
  v1::PushGradientReply GoodStep(v1::PushGradientReply* r1_out = nullptr) {
    v1::PushGradientReply r0, r1;
    grpc::Status s0;
    std::thread t([&]() { s0 = Send(Push(0, 0, {2, 0, 4}), &r0); });
    EXPECT_THAT(Send(Push(1, 0, {0, 2, 0}), &r1), IsOk());
    t.join();
    EXPECT_THAT(s0, IsOk()) << s0.error_message();
    if (r1_out != nullptr) *r1_out = r1;
    return r0;
  }

  SharingObserver sharing_;                  // the service's observer
  WireDtype wire_dtype_ = WireDtype::kFp32;  // the job's (set before SetUp)
  bool serve_shared_memory_ = true;          // dbs_ps --shared_memory (set before SetUp)
  FakeClock clock_;
  std::unique_ptr<TrainingJob> job_;
  std::unique_ptr<SchedulerServiceImpl> scheduler_service_;
  std::unique_ptr<ParameterServiceImpl> parameter_service_;
  std::unique_ptr<grpc::Server> server_;
  std::vector<std::string> tokens_;         // by worker id
  int train_samples_ = 8;                   // each worker's (set before SetUp): 2 steps an epoch
  std::atomic<int> freed_memory_hooks_{0};  // calls of the service's freed-memory hook
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::SchedulerService::Stub> sched_;
  std::unique_ptr<v1::ParameterService::Stub> params_;
};

// A one-epoch job of one worker.
std::unique_ptr<TrainingJob> OneWorkerJob(FakeClock* clock, int global_batch) {
  JobConfig config;
  config.scheduler.expected_workers = 1;
  config.scheduler.epochs = 1;
  config.scheduler.global_batch = global_batch;
  return *TrainingJob::Create(config, clock);
}

// `service` alone on a loopback port picked at run time, and a stub that calls it.
struct Served {
  std::unique_ptr<grpc::Server> server;
  std::unique_ptr<v1::ParameterService::Stub> stub;
};
Served Serve(ParameterServiceImpl* service) {
  LoopbackServer s = ServeOnLoopback(service);
  Served served;
  served.stub = v1::ParameterService::NewStub(
      grpc::CreateChannel(s.address(), grpc::InsecureChannelCredentials()));
  served.server = std::move(s.server);
  return served;
}

// The field's bytes, head and values.
std::string Bytes(const ValuesField& f) {
  std::string out(reinterpret_cast<const char*>(f.head.begin()), f.head.size());
  out.append(reinterpret_cast<const char*>(f.body.begin()), f.body.size());
  return out;
}

std::string Expected(const ParameterSnapshot& snap, WireDtype dtype) {
  return ValuesFieldBytes(snap.version, dtype, *snap.values);
}

// fp32 answers send the parameters from the store's snapshot itself: only the field's head is
// written, and every answer of the version shares it.
// Where a registration came from is the connection's, never the request's: it bounds how many
// workers one host may register (dbs_ps --max_workers_per_host).
TEST_F(ServiceTest, ARegistrationsSourceIsThePeersHost) {
  for (const WorkerRegistration& w : job_->scheduler()->Workers()) EXPECT_EQ(w.source, "127.0.0.1");
  EXPECT_EQ(PeerHost("ipv4:10.0.0.5:41234"), "10.0.0.5");
  EXPECT_EQ(PeerHost("ipv6:[::1]:41234"), "[::1]");
  EXPECT_EQ(PeerHost("ipv6:%5B::1%5D:41234"), "%5B::1%5D");
  EXPECT_EQ(PeerHost("unix:/tmp/socket"), "unix:/tmp/socket");
  EXPECT_EQ(PeerHost(""), "");
}

TEST_F(ServiceTest, Fp32AnswersAreTheSnapshotItself) {
  GoodStep();
  const ParameterSnapshot snap = *job_->store()->Snapshot();
  ASSERT_EQ(snap.version, 1);
  const ValuesField field = parameter_service_->ValuesOf(snap);
  EXPECT_EQ(Bytes(field), Expected(snap, WireDtype::kFp32));
  if (Fp32IsWireOrder()) {
    EXPECT_EQ(static_cast<const void*>(field.body.begin()),
              static_cast<const void*>(snap.values->data()));
  }
  EXPECT_EQ(parameter_service_->ValuesOf(snap).body.begin(), field.body.begin());
  // What a pull receives is that field.
  int64_t version = 0;
  EXPECT_EQ(Current(&version), *snap.values);
  EXPECT_EQ(version, 1);
}

// In 16 bits the values are encoded once into a buffer of their own.
TEST(ServiceWireTest, Bf16AnswersAreEncodedOnceIntoABufferOfTheirOwn) {
  FakeClock clock;
  std::unique_ptr<TrainingJob> job = OneWorkerJob(&clock, 1);
  ParameterServiceImpl service(
      job->store(), job->aggregator(),
      [](int, absl::string_view, absl::string_view) { return absl::OkStatus(); }, nullptr, {},
      WireDtype::kBf16);
  // Large enough that gRPC does not inline the slices (it copies those of a few bytes).
  std::vector<float> init(100);
  for (int i = 0; i < 100; ++i) init[i] = 0.25f * static_cast<float>(i - 50);
  ASSERT_THAT(job->store()->Register({{"w", {100}}}, init), IsOk());
  const ParameterSnapshot snap = *job->store()->Snapshot();
  const ValuesField field = service.ValuesOf(snap);
  EXPECT_EQ(Bytes(field), Expected(snap, WireDtype::kBf16));
  EXPECT_EQ(field.body.size(), 100u * 2u);
  EXPECT_EQ(service.ValuesOf(snap).body.begin(), field.body.begin());
  job->Abort(absl::CancelledError("test over"));
}

TEST_F(ServiceTest, BadGradientsAreRefusedAndTheStepIsUnaffected) {
  v1::PushGradientReply reply;
  v1::PushGradientRequest too_long = Push(0, 0, {1, 1, 1});
  too_long.mutable_gradient()->append("xxxx");
  grpc::Status refused = Send(too_long, &reply);
  EXPECT_EQ(refused.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(refused.error_message(), ::testing::HasSubstr("16 bytes (fp32); the model needs 3"));
  v1::PushGradientRequest split_value = Push(0, 0, {1, 1, 1});
  split_value.mutable_gradient()->push_back('x');
  EXPECT_EQ(Send(split_value, &reply).error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  v1::PushGradientRequest missing = Push(0, 0, {1, 1, 1});
  missing.mutable_gradient()->resize(8);
  EXPECT_EQ(Send(missing, &reply).error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  v1::PushGradientRequest nan = Push(0, 0, {1, std::nanf(""), 1});
  refused = Send(nan, &reply);
  EXPECT_EQ(refused.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(refused.error_message(), ::testing::HasSubstr("element 1 is nan"));
  v1::PushGradientRequest huge = Push(0, 0, {1, 1, 3e30f});
  EXPECT_EQ(Send(huge, &reply).error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  for (double loss : {1e308, -1e308, 3e30, std::numeric_limits<double>::infinity()}) {
    v1::PushGradientRequest absurd_loss = Push(0, 0, {1, 1, 1});
    absurd_loss.set_loss_sum(loss);
    refused = Send(absurd_loss, &reply);
    EXPECT_EQ(refused.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << loss;
    EXPECT_THAT(refused.error_message(), ::testing::HasSubstr("loss_sum")) << loss;
  }
  v1::PushGradientRequest other_dtype = Push(0, 0, {1, 1, 1});
  other_dtype.set_wire_dtype(v1::WIRE_BF16);
  refused = Send(other_dtype, &reply);
  EXPECT_EQ(refused.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(refused.error_message(), ::testing::HasSubstr("this job's wire dtype is fp32"));
  v1::PushGradientRequest unknown_dtype = Push(0, 0, {1, 1, 1});
  unknown_dtype.set_wire_dtype(static_cast<v1::WireDtype>(7));
  EXPECT_EQ(Send(unknown_dtype, &reply).error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  v1::PushGradientRequest wrong_count = Push(0, 0, {1, 1, 1});
  wrong_count.set_num_samples(3);
  EXPECT_EQ(Send(wrong_count, &reply).error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(Send(Push(0, 1, {1, 1, 1}), &reply).error_code(),
            grpc::StatusCode::FAILED_PRECONDITION);  // a step that has not started
  EXPECT_EQ(Send(Push(9, 0, {1, 1, 1}), &reply).error_code(), grpc::StatusCode::NOT_FOUND);

  int64_t version = -1;
  EXPECT_EQ(Current(&version), (std::vector<float>{1, 2, 3}));
  EXPECT_EQ(version, 0);

  // The step then completes exactly as if the bad pushes had never happened:
  // g = (2*[2,0,4] + 2*[0,2,0]) / 4 = [1, 1, 2]; p = [1,2,3] - 0.5 * g.
  const v1::PushGradientReply r = GoodStep();
  EXPECT_EQ(r.global_samples(), 4);
  EXPECT_EQ(r.values().version(), 1);
  EXPECT_EQ(Current(&version), (std::vector<float>{0.5f, 1.5f, 2.0f}));

  // A stale push (step 0 again, from a worker with a different gradient) is answered as a retry
  // and changes nothing.
  EXPECT_THAT(Send(Push(1, 0, {100, 100, 100}), &reply), IsOk());
  EXPECT_EQ(reply.values().version(), 1);
  EXPECT_EQ(Current(&version), (std::vector<float>{0.5f, 1.5f, 2.0f}));
  EXPECT_EQ(version, 1);
}

// Shared memory (a worker on the server's host): an attach is checked before anything changes;
// a push whose gradient lies in the worker's region is checked like one that carries it, and
// its answer names the version, whose values the server's slots hold. A worker that did not
// attach is answered as always, in the same step.
TEST_F(ServiceTest, SharedMemoryIsAttachedCheckedAndAnsweredFromTheSlots) {
  auto region = SharedRegion::Create("dbs-gradient", 12);  // the model's 3 values in fp32
  ASSERT_THAT(region, IsOk());
  v1::AttachSharedMemoryReply slots_at;
  EXPECT_EQ(Attach(0, (*region)->location(), &slots_at, false).error_code(),
            grpc::StatusCode::UNAUTHENTICATED);
  auto misnamed = SharedRegion::Create("secrets", 12);
  ASSERT_THAT(misnamed, IsOk());
  grpc::Status refused = Attach(0, (*misnamed)->location(), &slots_at);
  EXPECT_EQ(refused.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(refused.error_message(), HasSubstr("not a memory file named \"dbs-gradient\""));
  RegionLocation wrong = (*region)->location();
  wrong.bytes = 16;
  refused = Attach(0, wrong, &slots_at);
  EXPECT_EQ(refused.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(refused.error_message(), HasSubstr("the model's 3 values in fp32 take 12"));
  wrong = (*region)->location();
  wrong.fd = 100000;  // what a worker on another host would name
  EXPECT_EQ(Attach(0, wrong, &slots_at).error_code(), grpc::StatusCode::FAILED_PRECONDITION);

  // Not attached yet: a push that says its gradient is in shared memory is refused.
  v1::PushGradientRequest shared = SharedPush(0, 0);
  v1::PushGradientReply reply;
  refused = Send(shared, &reply);
  EXPECT_EQ(refused.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_THAT(refused.error_message(), HasSubstr("no shared memory attached"));
  EXPECT_EQ(parameter_service_->shared_memory_workers(), 0);

  ASSERT_THAT(Attach(0, (*region)->location(), &slots_at), IsOk());
  EXPECT_EQ(parameter_service_->shared_memory_workers(), 1);
  EXPECT_EQ(sharing_.workers(), 1) << "the observer (dbs_shared_memory_workers) is told";
  EXPECT_EQ(slots_at.parameters().bytes(), ParameterSlots::RegionBytes(3));
  auto slots_region = OpenSlots(slots_at);
  ASSERT_THAT(slots_region, IsOk());
  const ParameterSlots slots(slots_region->get(), 3);

  // The region's values are checked as carried ones are; the bytes and the region not both.
  float* g = reinterpret_cast<float*>((*region)->data());
  g[0] = 2;
  g[1] = std::nanf("");
  g[2] = 4;
  refused = Send(shared, &reply);
  EXPECT_EQ(refused.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(refused.error_message(), HasSubstr("element 1 is nan"));
  g[1] = 0;
  v1::PushGradientRequest both = shared;
  both.set_gradient(std::string(12, '\0'));
  refused = Send(both, &reply);
  EXPECT_EQ(refused.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(refused.error_message(), HasSubstr("carries no gradient bytes"));
  int64_t version = -1;
  EXPECT_EQ(Current(&version), (std::vector<float>{1, 2, 3}));

  // Worker 0 through shared memory, worker 1 over the socket: the step of GoodStep.
  v1::PushGradientReply r0, r1;
  grpc::Status s0;
  std::thread t([&]() { s0 = Send(shared, &r0); });
  EXPECT_THAT(Send(Push(1, 0, {0, 2, 0}), &r1), IsOk());
  t.join();
  ASSERT_THAT(s0, IsOk()) << s0.error_message();
  EXPECT_TRUE(r0.values().in_shared_memory());
  EXPECT_TRUE(r0.values().values().empty());
  EXPECT_EQ(r0.values().version(), 1);
  EXPECT_EQ(r0.global_samples(), 4);
  std::vector<float> from_slots(3);
  ASSERT_TRUE(slots.Read(1, absl::MakeSpan(from_slots)));
  EXPECT_EQ(from_slots, (std::vector<float>{0.5f, 1.5f, 2.0f}));
  EXPECT_FALSE(r1.values().in_shared_memory());
  std::vector<float> carried(3);
  std::memcpy(carried.data(), r1.values().values().data(), 12);
  EXPECT_EQ(carried, from_slots);
  EXPECT_EQ(Current(&version), from_slots);
  // A retry of the push is answered from the slots again.
  ASSERT_THAT(Send(shared, &r0), IsOk());
  EXPECT_EQ(r0.values().version(), 1);
  EXPECT_TRUE(r0.values().in_shared_memory());

  // Once the worker is removed from the job its region goes; a push through it is refused.
  parameter_service_->DropSharedMemory({0, 7});
  EXPECT_EQ(parameter_service_->shared_memory_workers(), 0);
  EXPECT_EQ(sharing_.workers(), 0);
  EXPECT_EQ(sharing_.over_grpc(), 0);
  v1::PushGradientRequest next = shared;
  next.set_step(1);
  refused = Send(next, &reply);
  EXPECT_EQ(refused.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_THAT(refused.error_message(), HasSubstr("no shared memory attached"));
}

// In fp32 the parameter slots are the store's snapshots: a worker that shares memory reads the
// values where the update wrote them. A version whose slot someone still held when its update
// began lies elsewhere, and its answer travels over gRPC instead (the server never writes a
// slot the store does not own); the client reads either.
TEST_F(ServiceTest, TheSlotsAreTheStoresSnapshotsAndAHeldSlotsVersionGoesOverGrpc) {
  // Version 0 (slot 0), held here as a slow reader would.
  ParameterSnapshot held = *job_->store()->Snapshot();
  EXPECT_FALSE(held.values->owns_memory()) << "the registered values lie in slot 0";
  auto region = SharedRegion::Create("dbs-gradient", 12);
  ASSERT_THAT(region, IsOk());
  v1::AttachSharedMemoryReply slots_at;
  ASSERT_THAT(Attach(0, (*region)->location(), &slots_at), IsOk());
  auto slots_region = OpenSlots(slots_at);
  ASSERT_THAT(slots_region, IsOk());
  const ParameterSlots slots(slots_region->get(), 3);
  EXPECT_TRUE(slots.Holds(0)) << "the store published version 0 in its slot";

  // Step 0 (version 1, slot 1): worker 0 reads it from the slot, worker 1 gets it carried.
  v1::PushGradientReply r0, r1;
  SharedStep(0, region->get(), {2, 0, 4}, {0, 2, 0}, &r0, &r1);
  EXPECT_TRUE(r0.values().in_shared_memory());
  EXPECT_EQ(r0.values().version(), 1);
  std::vector<float> values(3);
  ASSERT_TRUE(slots.Read(1, absl::MakeSpan(values)));
  EXPECT_EQ(values, (std::vector<float>{0.5f, 1.5f, 2.0f}));
  EXPECT_FALSE(job_->store()->Snapshot()->values->owns_memory());

  // Step 1 (version 2) belongs in slot 0, which is still held: it goes elsewhere, slot 0 is
  // left as it was, and worker 0's answer carries the values.
  SharedStep(1, region->get(), {4, 0, 0}, {0, 0, 4}, &r0, &r1);
  EXPECT_FALSE(r0.values().in_shared_memory());
  EXPECT_EQ(r0.values().version(), 2);
  EXPECT_EQ(sharing_.over_grpc(), 1) << "counted (dbs_shared_memory_answers_over_grpc_total)";
  std::vector<float> carried(3);
  ASSERT_EQ(r0.values().values().size(), 12u);
  std::memcpy(carried.data(), r0.values().values().data(), 12);
  EXPECT_EQ(carried, (std::vector<float>{-0.5f, 1.5f, 1.0f}));
  std::memcpy(carried.data(), r1.values().values().data(), 12);
  EXPECT_EQ(carried, (std::vector<float>{-0.5f, 1.5f, 1.0f}));
  EXPECT_FALSE(slots.Read(2, absl::MakeSpan(values)));
  EXPECT_TRUE(slots.Holds(0));
  EXPECT_THAT(*held.values, ElementsAre(1.0f, 2.0f, 3.0f)) << "what a reader holds stays";
  EXPECT_TRUE(job_->store()->Snapshot()->values->owns_memory());
}

// The same job with bf16 on the wire.
class Bf16ServiceTest : public ServiceTest {
 protected:
  Bf16ServiceTest() { wire_dtype_ = WireDtype::kBf16; }
};

// In 16 bits the parameter slots are the store's fp32 snapshots too (no encoded copy beside
// them): a worker that shares memory reads the values where the update wrote them, rounded as
// the wire rounds them, the same values an answer over gRPC carries.
TEST_F(Bf16ServiceTest, TheSlotsHoldTheFp32SnapshotsAndAReaderRoundsThemAsTheWire) {
  auto region = SharedRegion::Create("dbs-gradient", 6);  // the model's 3 values in bf16
  ASSERT_THAT(region, IsOk());
  v1::AttachSharedMemoryReply slots_at;
  ASSERT_THAT(Attach(0, (*region)->location(), &slots_at), IsOk());
  EXPECT_EQ(slots_at.parameters().bytes(), ParameterSlots::RegionBytes(3));
  auto slots_region = OpenSlots(slots_at);
  ASSERT_THAT(slots_region, IsOk());
  const ParameterSlots slots(slots_region->get(), 3);
  EXPECT_TRUE(slots.Holds(0)) << "the store published version 0 in its slot";
  EXPECT_FALSE(job_->store()->Snapshot()->values->owns_memory());

  // Gradients whose update is no bf16 value: p = [1,2,3] - 0.5 * (2 * [0.2, 0, 0] + 2 * [0,
  // 0.3, 0]) / 4 in fp32, after the gradients' own rounding to bf16 on the wire.
  v1::PushGradientReply r0, r1;
  SharedStep(0, region->get(), {0.2f, 0, 0}, {0, 0.3f, 0}, &r0, &r1);
  EXPECT_TRUE(r0.values().in_shared_memory());
  EXPECT_EQ(r0.values().version(), 1);
  const ParameterSnapshot one = *job_->store()->Snapshot();
  EXPECT_FALSE(one.values->owns_memory()) << "version 1 lies in slot 1";
  std::vector<float> exact(3), rounded(3);
  ASSERT_TRUE(slots.Read(1, absl::MakeSpan(exact)));
  EXPECT_EQ(exact, std::vector<float>(one.values->begin(), one.values->end()))
      << "the fp32 master values";
  ASSERT_TRUE(slots.Read(1, absl::MakeSpan(rounded), WireDtype::kBf16));
  EXPECT_EQ(rounded, Carried(r1)) << "what the answer over gRPC carries";
  EXPECT_NE(rounded[0], exact[0]);
  EXPECT_EQ(rounded[0], Bf16ToFloat(FloatToBf16(exact[0])));
  int64_t version = -1;
  EXPECT_EQ(Current(&version), rounded);
  EXPECT_EQ(version, 1);
  EXPECT_EQ(sharing_.over_grpc(), 0);
}

// A job whose workers all share memory encodes no answer for gRPC: an update lets go of the
// pooled buffer the registrations' answers were encoded into (once gRPC has let go of it) and
// calls the freed-memory hook, where main hands the memory back to the kernel; a pull still
// gets the values, encoded when asked for.
class Bf16LongEpochTest : public Bf16ServiceTest {
 protected:
  Bf16LongEpochTest() { train_samples_ = 80; }  // 20 steps
};

TEST_F(Bf16LongEpochTest, AJobWhoseWorkersAllShareMemoryKeepsNoEncodedCopy) {
  std::unique_ptr<SharedRegion> regions[2];
  v1::AttachSharedMemoryReply slots_at;
  for (int w = 0; w < 2; ++w) {
    auto region = SharedRegion::Create("dbs-gradient", 6);
    ASSERT_THAT(region, IsOk());
    regions[w] = std::move(*region);
    ASSERT_THAT(Attach(w, regions[w]->location(), &slots_at), IsOk());
  }
  auto slots_region = OpenSlots(slots_at);
  ASSERT_THAT(slots_region, IsOk());
  const ParameterSlots slots(slots_region->get(), 3);
  EXPECT_EQ(freed_memory_hooks_.load(), 1) << "the registration's";
  // Twenty steps through shared memory alone: gRPC lets go of the registrations' answers a
  // moment after the workers have them, long before the last.
  for (int step = 0; step < 20; ++step) {
    EncodeValues({0.2f, 0, 0}, wire_dtype_, regions[0]->data());
    EncodeValues({0, 0.3f, 0}, wire_dtype_, regions[1]->data());
    v1::PushGradientReply r0, r1;
    grpc::Status s0;
    std::thread t([&]() { s0 = Send(SharedPush(0, step), &r0); });
    const grpc::Status s1 = Send(SharedPush(1, step), &r1);
    t.join();
    ASSERT_THAT(s0, IsOk()) << s0.error_message();
    ASSERT_THAT(s1, IsOk()) << s1.error_message();
    EXPECT_TRUE(r0.values().in_shared_memory());
    EXPECT_TRUE(r1.values().in_shared_memory());
  }
  EXPECT_EQ(freed_memory_hooks_.load(), 2) << "the pooled buffer let go, once";
  EXPECT_EQ(sharing_.over_grpc(), 0);
  std::vector<float> rounded(3);
  ASSERT_TRUE(slots.Read(20, absl::MakeSpan(rounded), WireDtype::kBf16));
  int64_t version = -1;
  EXPECT_EQ(Current(&version), rounded);
  EXPECT_EQ(version, 20);
}

// Without shared memory a 16-bit update is encoded into a buffer of its own as it runs, and the
// answers carry it, however small the model (gRPC copies a sub-slice of a few bytes when it is
// made, so the encoded values must not be one: with the 6 bytes here they once went out unset).
class Bf16WithoutSharedMemoryTest : public Bf16ServiceTest {
 protected:
  Bf16WithoutSharedMemoryTest() { serve_shared_memory_ = false; }
};

TEST_F(Bf16WithoutSharedMemoryTest, TheAnswersCarryTheUpdateOfATinyModel) {
  v1::PushGradientReply r1;
  const v1::PushGradientReply r0 = GoodStep(&r1);
  EXPECT_EQ(r0.values().version(), 1);
  EXPECT_EQ(Carried(r0), (std::vector<float>{0.5f, 1.5f, 2.0f}));
  EXPECT_EQ(Carried(r1), (std::vector<float>{0.5f, 1.5f, 2.0f}));
}

// A push session carries one worker's pushes of many steps, each answered as PushGradient
// answers it, and ends at the first push PushGradient would refuse, with that status.
TEST_F(ServiceTest, APushSessionCarriesAWorkersStepsAndEndsAtItsFirstRefusal) {
  using Session = grpc::ClientReaderWriter<v1::PushGradientRequest, v1::PushGradientReply>;
  grpc::ClientContext ctx[2];
  std::unique_ptr<Session> session[2];
  for (int w = 0; w < 2; ++w) {
    Sign(&ctx[w], w);
    ctx[w].set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(20));
    session[w] = params_->PushGradientSession(&ctx[w]);
  }
  // Both steps of the epoch on the same two streams:
  // step 0: g = (2*[2,0,4] + 2*[0,2,0]) / 4 = [1, 1, 2]; p = [1,2,3] - 0.5 * g = [0.5, 1.5, 2];
  // step 1: g = (2*[4,0,0] + 2*[0,0,4]) / 4 = [2, 0, 2]; p = [-0.5, 1.5, 1].
  const std::vector<float> gradients[2][2] = {{{2, 0, 4}, {0, 2, 0}}, {{4, 0, 0}, {0, 0, 4}}};
  for (int step = 0; step < 2; ++step) {
    for (int w = 0; w < 2; ++w) ASSERT_TRUE(session[w]->Write(Push(w, step, gradients[step][w])));
    for (int w = 0; w < 2; ++w) {
      v1::PushGradientReply reply;
      ASSERT_TRUE(session[w]->Read(&reply)) << "step " << step << " worker " << w;
      EXPECT_EQ(reply.step(), step);
      EXPECT_EQ(reply.global_samples(), 4);
      EXPECT_EQ(reply.values().version(), step + 1);
    }
  }
  int64_t version = -1;
  EXPECT_EQ(Current(&version), (std::vector<float>{-0.5f, 1.5f, 1.0f}));
  EXPECT_EQ(version, 2);
  // Worker 0's stream cannot carry worker 1's push, even a well-formed one.
  ASSERT_TRUE(session[0]->Write(Push(1, 1, {0, 0, 4})));
  v1::PushGradientReply reply;
  EXPECT_FALSE(session[0]->Read(&reply));
  grpc::Status ended = session[0]->Finish();
  EXPECT_EQ(ended.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(ended.error_message(), ::testing::HasSubstr("one worker's pushes"));
  // A push for a step that does not exist ends the stream with PushGradient's refusal.
  ASSERT_TRUE(session[1]->Write(Push(1, 7, {0, 0, 4})));
  EXPECT_FALSE(session[1]->Read(&reply));
  ended = session[1]->Finish();
  EXPECT_EQ(ended.error_code(), grpc::StatusCode::FAILED_PRECONDITION) << ended.error_message();
  EXPECT_EQ(Current(&version), (std::vector<float>{-0.5f, 1.5f, 1.0f})) << "nothing changed";
  // A stream of bytes that are no push, and one without the worker's credential.
  grpc::ClientContext bad_ctx;
  Sign(&bad_ctx, 0);
  const grpc::internal::RpcMethod method("/dbs.v1.ParameterService/PushGradientSession",
                                         grpc::internal::RpcMethod::BIDI_STREAMING, channel_);
  std::unique_ptr<grpc::ClientReaderWriter<grpc::ByteBuffer, grpc::ByteBuffer>> raw(
      grpc::internal::ClientReaderWriterFactory<grpc::ByteBuffer, grpc::ByteBuffer>::Create(
          channel_.get(), method, &bad_ctx));
  grpc::Slice junk(std::string("\xff\xff\xff", 3));
  ASSERT_TRUE(raw->Write(grpc::ByteBuffer(&junk, 1)));
  grpc::ByteBuffer ignored;
  EXPECT_FALSE(raw->Read(&ignored));
  EXPECT_EQ(raw->Finish().error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  grpc::ClientContext unsigned_ctx;
  std::unique_ptr<Session> stranger = params_->PushGradientSession(&unsigned_ctx);
  ASSERT_TRUE(stranger->Write(Push(0, 1, {1, 1, 1})));
  EXPECT_FALSE(stranger->Read(&reply));
  EXPECT_EQ(stranger->Finish().error_code(), grpc::StatusCode::UNAUTHENTICATED);
}

TEST_F(ServiceTest, ALaterWorkerGetsTheStoredValuesForItsLayoutAlone) {
  v1::RegisterModelRequest req;
  req.set_worker_id(1);
  req.set_layout_only(true);
  EncodeLayout(kLayout, req.mutable_parameters());
  v1::Parameters reply;
  {
    grpc::ClientContext ctx;
    Sign(&ctx, 1);
    ASSERT_THAT(params_->RegisterModel(&ctx, req, &reply), IsOk());
  }
  std::vector<float> got(3);
  ASSERT_THAT(DecodeParameters(reply, kLayout, absl::MakeSpan(got)), IsOk());
  EXPECT_EQ(got, (std::vector<float>{1, 2, 3}));
  // Data in a layout-only request, or another layout, is refused.
  req.mutable_parameters(0)->set_data(std::string(8, '\0'));
  {
    grpc::ClientContext ctx;
    Sign(&ctx, 1);
    EXPECT_EQ(params_->RegisterModel(&ctx, req, &reply).error_code(),
              grpc::StatusCode::INVALID_ARGUMENT);
  }
  req.mutable_parameters(0)->clear_data();
  req.mutable_parameters(0)->set_shape(0, 3);
  {
    grpc::ClientContext ctx;
    Sign(&ctx, 1);
    EXPECT_EQ(params_->RegisterModel(&ctx, req, &reply).error_code(),
              grpc::StatusCode::INVALID_ARGUMENT);
  }
}

TEST(ServiceLayoutOnlyTest, BeforeAnyModelALayoutAloneIsAskedForTheValues) {
  FakeClock clock;
  auto job = OneWorkerJob(&clock, 2);
  auto reg = job->scheduler()->Register({"w0", 8, 2, "cpu"});
  ASSERT_THAT(reg, IsOk());
  Scheduler* s = job->scheduler();
  ParameterServiceImpl service(job->store(), job->aggregator(),
                               [s](int id, absl::string_view token, absl::string_view identity) {
                                 return s->Authenticate(id, token, identity);
                               });
  Served served = Serve(&service);
  auto& server = served.server;
  auto& stub = served.stub;
  v1::RegisterModelRequest req;
  req.set_worker_id(reg->worker_id);
  req.set_layout_only(true);
  EncodeLayout(kLayout, req.mutable_parameters());
  v1::Parameters reply;
  grpc::ClientContext ctx;
  ctx.AddMetadata(kWorkerTokenKey, reg->token);
  const grpc::Status refused = stub->RegisterModel(&ctx, req, &reply);
  EXPECT_EQ(refused.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_THAT(refused.error_message(), ::testing::HasSubstr("send the initial values"));
  EXPECT_FALSE(job->store()->registered()) << "nothing was registered from a layout alone";
  job->Abort(absl::CancelledError("test over"));
  server->Shutdown();
}

// At a job's start every worker registers at once. One is asked for its values; the others are
// told to ask again once it is done, so the server receives one copy of the model, not one per
// worker. A holder that goes silent for the claim's lease loses its turn.
TEST(ServiceRegistrationClaimTest, OneWorkerSendsTheValuesAndTheOthersWaitForThem) {
  FakeClock clock;
  JobConfig config;
  config.scheduler.expected_workers = 3;
  config.scheduler.epochs = 1;
  config.scheduler.global_batch = 3;
  std::unique_ptr<TrainingJob> job = *TrainingJob::Create(config, &clock);
  std::vector<std::string> tokens;
  for (int w = 0; w < 3; ++w) {
    auto reg = job->scheduler()->Register({"w" + std::to_string(w), 8, 2, "cpu"});
    ASSERT_THAT(reg, IsOk());
    ASSERT_EQ(reg->worker_id, w);
    tokens.push_back(reg->token);
  }
  Scheduler* s = job->scheduler();
  ParameterServiceImpl service(
      job->store(), job->aggregator(),
      [s](int id, absl::string_view token, absl::string_view identity) {
        return s->Authenticate(id, token, identity);
      },
      nullptr, {}, WireDtype::kFp32, &clock);
  Served served = Serve(&service);
  auto& server = served.server;
  auto& stub = served.stub;
  // Worker w asks with its layout alone; its values (when the model is registered) in `got`.
  auto ask = [&](int w, std::vector<float>* got = nullptr) {
    v1::RegisterModelRequest req;
    req.set_worker_id(w);
    req.set_layout_only(true);
    EncodeLayout(kLayout, req.mutable_parameters());
    v1::Parameters reply;
    grpc::ClientContext ctx;
    ctx.AddMetadata(kWorkerTokenKey, tokens[w]);
    grpc::Status st = stub->RegisterModel(&ctx, req, &reply);
    if (st.ok() && got != nullptr) {
      got->resize(3);
      EXPECT_THAT(DecodeParameters(reply, kLayout, absl::MakeSpan(*got)), IsOk());
    }
    return st;
  };
  // Worker w sends its values with its layout.
  auto send = [&](int w, const std::vector<float>& values) {
    v1::RegisterModelRequest req;
    req.set_worker_id(w);
    EncodeTensors(kLayout, values, req.mutable_parameters());
    v1::Parameters reply;
    grpc::ClientContext ctx;
    ctx.AddMetadata(kWorkerTokenKey, tokens[w]);
    return stub->RegisterModel(&ctx, req, &reply);
  };
  const grpc::Status first = ask(0);
  EXPECT_EQ(first.error_code(), grpc::StatusCode::FAILED_PRECONDITION) << first.error_message();
  const grpc::Status second = ask(1);
  EXPECT_EQ(second.error_code(), grpc::StatusCode::ABORTED);
  EXPECT_THAT(second.error_message(),
              ::testing::HasSubstr("worker 0 is sending the model's initial values"));
  // Another worker's values, while worker 0 holds the turn, are refused.
  const grpc::Status other = send(2, {7, 8, 9});
  EXPECT_EQ(other.error_code(), grpc::StatusCode::ABORTED) << other.error_message();
  EXPECT_FALSE(job->store()->registered());
  // Worker 0 goes silent for the whole lease: the next to ask takes over, worker 0 waits.
  clock.Advance(RegistrationClaim::kDefaultLease);
  EXPECT_EQ(ask(1).error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  const grpc::Status late = ask(0);
  EXPECT_EQ(late.error_code(), grpc::StatusCode::ABORTED);
  EXPECT_THAT(late.error_message(), ::testing::HasSubstr("worker 1 is sending"));
  // Worker 1's values become the model's; everyone's layout alone then gets them.
  ASSERT_THAT(send(1, {4, 5, 6}), IsOk());
  for (int w = 0; w < 3; ++w) {
    std::vector<float> got;
    ASSERT_THAT(ask(w, &got), IsOk()) << "worker " << w;
    EXPECT_EQ(got, (std::vector<float>{4, 5, 6})) << "worker " << w;
  }
  job->Abort(absl::CancelledError("test over"));
  server->Shutdown();
}

TEST_F(ServiceTest, UnknownWorkersAndMismatchedModelsAreRefused) {
  v1::RegisterModelRequest req;
  req.set_worker_id(5);
  EncodeTensors(kLayout, std::vector<float>{1, 2, 3}, req.mutable_parameters());
  v1::Parameters reply;
  {
    grpc::ClientContext ctx;
    Sign(&ctx, req.worker_id());
    EXPECT_EQ(params_->RegisterModel(&ctx, req, &reply).error_code(), grpc::StatusCode::NOT_FOUND);
  }
  req.set_worker_id(1);
  req.mutable_parameters(0)->set_name("renamed");
  {
    grpc::ClientContext ctx;
    Sign(&ctx, req.worker_id());
    EXPECT_EQ(params_->RegisterModel(&ctx, req, &reply).error_code(),
              grpc::StatusCode::INVALID_ARGUMENT);
  }
  v1::GetEpochPlanRequest plan_req;
  plan_req.set_worker_id(3);
  v1::EpochPlan plan;
  {
    grpc::ClientContext ctx;
    Sign(&ctx, plan_req.worker_id());
    EXPECT_EQ(sched_->GetEpochPlan(&ctx, plan_req, &plan).error_code(),
              grpc::StatusCode::NOT_FOUND);
  }
  v1::RegisterWorkerRequest late;
  late.set_name("w2");
  late.set_train_samples(8);
  late.set_test_samples(2);
  v1::RegisterWorkerReply late_reply;
  {
    grpc::ClientContext ctx;
    ASSERT_THAT(sched_->RegisterWorker(&ctx, late, &late_reply), IsOk());
    EXPECT_EQ(late_reply.start_epoch(), 1) << "a late worker joins from the next epoch";
  }
  late.set_name("w3");
  late.set_train_samples(9);
  {
    grpc::ClientContext ctx;
    EXPECT_EQ(sched_->RegisterWorker(&ctx, late, &late_reply).error_code(),
              grpc::StatusCode::FAILED_PRECONDITION)
        << "a different data set is refused";
  }
}

TEST_F(ServiceTest, MalformedModelsAndBytesAreInvalidArgumentsWithAMessage) {
  // A worker with its valid token sends shapes that lie: each is refused by name.
  auto shaped = [](std::vector<int64_t> shape, size_t bytes) {
    v1::RegisterModelRequest req;
    req.set_worker_id(0);
    v1::Tensor* t = req.add_parameters();
    t->set_name("w");
    for (int64_t d : shape) t->add_shape(d);
    t->set_data(std::string(bytes, '\0'));
    return req;
  };
  const v1::RegisterModelRequest cases[] = {
      shaped({int64_t{1} << 31, int64_t{1} << 31}, 0),  // overflows int64 when multiplied out
      shaped({-2, 1}, 8),
      shaped({0}, 0),
      shaped({2}, 7),
      shaped({1, 1, 1, 1, 1, 1, 1, 1, 1, 1}, 4),
  };
  for (const v1::RegisterModelRequest& req : cases) {
    v1::Parameters reply;
    grpc::ClientContext ctx;
    Sign(&ctx, 0);
    const grpc::Status s = params_->RegisterModel(&ctx, req, &reply);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << req.ShortDebugString();
    EXPECT_FALSE(s.error_message().empty());
  }
  // Bytes that are not the method's message at all: gRPC's callback API would answer
  // code 12 with an empty message; the services parse requests themselves.
  grpc::GenericStub generic(channel_);
  for (const char* method :
       {"/dbs.v1.ParameterService/RegisterModel", "/dbs.v1.ParameterService/PullParameters",
        "/dbs.v1.SchedulerService/RegisterWorker", "/dbs.v1.SchedulerService/GetEpochPlan"}) {
    const std::string garbage = "\x0a\xff\xff\xff\xff\x0f";  // a field longer than the message
    grpc::Slice slice(garbage.data(), garbage.size());
    grpc::ByteBuffer request(&slice, 1), response;
    grpc::ClientContext ctx;
    Sign(&ctx, 0);
    absl::Notification done;
    grpc::Status status;
    // gRPC starts the call before its callback runs, through code TSan does not see.
    tsan::Release(&status);
    generic.UnaryCall(&ctx, method, grpc::StubOptions(), &request, &response, [&](grpc::Status s) {
      tsan::Acquire(&status);
      status = s;
      done.Notify();
    });
    done.WaitForNotification();
    EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << method;
    EXPECT_THAT(status.error_message(), ::testing::HasSubstr("malformed request")) << method;
  }
  // The job is untouched: a correct step still goes through.
  GoodStep();
}

TEST(ServiceGateTest, UntilTheServerServesEveryCallIsUnavailable) {
  // dbs_ps opens its port before restoring a checkpoint; meanwhile calls must not reach the job.
  FakeClock clock;
  JobConfig config;
  config.scheduler.expected_workers = 1;
  config.scheduler.global_batch = 4;
  std::unique_ptr<TrainingJob> job = *TrainingJob::Create(config, &clock);
  std::atomic<bool> serving{false};
  SchedulerServiceImpl service(job->scheduler(), "", CallHooks{nullptr, &serving});
  grpc::ServerBuilder builder;
  int port = 0;
  builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
  builder.RegisterService(&service);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  auto stub = v1::SchedulerService::NewStub(
      grpc::CreateChannel("127.0.0.1:" + std::to_string(port), grpc::InsecureChannelCredentials()));
  v1::RegisterWorkerRequest req;
  req.set_name("w0");
  req.set_train_samples(8);
  req.set_test_samples(2);
  v1::RegisterWorkerReply reply;
  {
    grpc::ClientContext ctx;
    const grpc::Status s = stub->RegisterWorker(&ctx, req, &reply);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAVAILABLE);
    EXPECT_THAT(s.error_message(), ::testing::HasSubstr("starting"));
  }
  EXPECT_EQ(job->scheduler()->active_workers(), 0) << "the job never saw the call";
  serving.store(true);
  {
    grpc::ClientContext ctx;
    EXPECT_THAT(stub->RegisterWorker(&ctx, req, &reply), IsOk());
  }
  job->Abort(absl::CancelledError("test over"));
  server->Shutdown();
}

TEST_F(ServiceTest, PlanIsDeliveredAndRepeatable) {
  v1::GetEpochPlanRequest req;
  req.set_worker_id(1);
  req.set_epoch(0);
  v1::EpochPlan a, b;
  {
    grpc::ClientContext ctx;
    Sign(&ctx, req.worker_id());
    ASSERT_THAT(sched_->GetEpochPlan(&ctx, req, &a), IsOk());
  }
  {
    grpc::ClientContext ctx;
    Sign(&ctx, req.worker_id());
    ASSERT_THAT(sched_->GetEpochPlan(&ctx, req, &b), IsOk());
  }
  EXPECT_EQ(a.SerializeAsString(), b.SerializeAsString());
  EXPECT_EQ(a.batch_size(), 2);
  EXPECT_EQ(a.num_steps(), 2);
  // Worker 1's half of each step's block of 4: positions [2, 4) and [6, 8).
  ASSERT_EQ(a.train_ranges_size(), 2);
  EXPECT_EQ(a.train_ranges(0).begin(), 2);
  EXPECT_EQ(a.train_ranges(0).end(), 4);
  EXPECT_EQ(a.train_ranges(1).begin(), 6);
  EXPECT_EQ(a.train_ranges(1).end(), 8);
}

}  // namespace
}  // namespace dbs
