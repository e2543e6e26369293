// hostile_client: a peer on the network without the job's secret or any worker's token that
// sends dbs_ps every kind of bad call it can: random bytes to every method, malformed,
// overflowing and oversized tensors, wrong steps and epochs, unknown and forged ids, floods of
// registrations and of waiting calls, Leave for others. Every call must be refused with a
// clear code; one that is accepted, hangs past its deadline, or ends in UNKNOWN or code 12
// is a finding. After each round it prints one JSON line (calls by method and code, findings)
// and flushes it; it runs --rounds rounds (0: until killed). Used by tests/hostile_test.py.
//
// With --replay_name it is instead a worker with the job's secret under mutual TLS that lends
// its token to another connection: it registers --replay_name with one certificate, then calls
// with that token over a connection with another certificate of the same CA, and registers the
// name again from there. It prints one JSON line of the codes (tests/security_test.py).
//
// With --insider it is a worker with the job's secret that joins a running job and then
// misbehaves: reports an epoch it was not in, asks the others to leave, pushes a loss of
// 1e308, floods registrations from its host, and never trains. It prints one JSON line of the
// codes it got (tests/hostile_test.py).
#include <unistd.h>

#include <cmath>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <map>
#include <memory>
#include <mutex>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "grpcpp/generic/generic_stub.h"
#include "grpcpp/grpcpp.h"
#include "nlohmann/json.hpp"
#include "proto/dbs.grpc.pb.h"
#include "tests/push_once.h"

ABSL_FLAG(std::string, server, "127.0.0.1:50051", "dbs_ps address.");
ABSL_FLAG(int, rounds, 1, "Rounds of attacks; 0: until killed.");
ABSL_FLAG(int, big_mb, 80, "Size of the oversized pushes, in MiB.");
ABSL_FLAG(std::string, replay_name, "", "Replay mode (see above): the worker name to register.");
ABSL_FLAG(std::string, job_token, "", "Replay mode: the job's secret.");
ABSL_FLAG(std::string, tls_ca, "", "Replay mode: PEM file of the CA that signed dbs_ps.");
ABSL_FLAG(std::string, tls_cert, "", "Replay mode: PEM certificate the name registers with.");
ABSL_FLAG(std::string, tls_key, "", "Replay mode: its key.");
ABSL_FLAG(std::string, tls_cert2, "", "Replay mode: the other connection's certificate.");
ABSL_FLAG(std::string, tls_key2, "", "Replay mode: its key.");
ABSL_FLAG(bool, insider, false, "Insider mode (see above), with --job_token.");
ABSL_FLAG(bool, follower, false,
          "The server is a follower shard (dbs_ps --shard=i/k, i > 0), which serves only "
          "ParameterService: UNIMPLEMENTED is its clear answer to SchedulerService calls.");

namespace {

using grpc::StatusCode;

const char* const kMethods[] = {
    "/dbs.v1.SchedulerService/RegisterWorker",
    "/dbs.v1.SchedulerService/Leave",
    "/dbs.v1.SchedulerService/ReportEpoch",
    "/dbs.v1.SchedulerService/GetEpochPlan",
    "/dbs.v1.ParameterService/RegisterModel",
    "/dbs.v1.ParameterService/PullParameters",
    "/dbs.v1.ParameterService/Resume",
    "/dbs.v1.ParameterService/PushGradientSession",
    "/dbs.v1.ParameterService/AttachSharedMemory",
};
const int kForgedIds[] = {-1, 0, 1, 2, 9999, 2147483647};

class Attacker {
 public:
  explicit Attacker(const std::string& server) : rng_(12345) {
    grpc::ChannelArguments args;
    args.SetMaxSendMessageSize(-1);
    args.SetMaxReceiveMessageSize(-1);
    channel_ = grpc::CreateCustomChannel(server, grpc::InsecureChannelCredentials(), args);
    sched_ = dbs::v1::SchedulerService::NewStub(channel_);
    params_ = dbs::v1::ParameterService::NewStub(channel_);
    generic_ = std::make_unique<grpc::GenericStub>(channel_);
  }

  void Round() {
    RandomBytes();
    RegistrationFlood();
    ForgedCalls();
    MalformedTensors();
    WaitingFlood();
    Oversized();
    SessionAbuse();
  }

  nlohmann::json Record(int round) {
    std::lock_guard<std::mutex> lock(mu_);
    nlohmann::json j;
    j["round"] = round;
    j["calls"] = calls_;
    j["unreachable"] = unreachable_;
    j["by_method"] = by_method_;
    j["findings"] = findings_;
    return j;
  }

 private:
  static bool SchedulerMethod(const std::string& method) {
    for (const char* name : {"RegisterWorker", "Leave", "ReportEpoch", "GetEpochPlan"}) {
      if (method.find(name) != std::string::npos) return true;
    }
    return false;
  }

  // A refusal the server may give to a call from a stranger; anything else is a finding.
  static bool Refusal(StatusCode c) {
    switch (c) {
      case StatusCode::INVALID_ARGUMENT:
      case StatusCode::UNAUTHENTICATED:
      case StatusCode::PERMISSION_DENIED:
      case StatusCode::NOT_FOUND:
      case StatusCode::FAILED_PRECONDITION:
      case StatusCode::RESOURCE_EXHAUSTED:
      case StatusCode::OUT_OF_RANGE:
      case StatusCode::INTERNAL:  // gRPC's own answer to bytes that do not parse
        return true;
      default:
        return false;
    }
  }

  // `transport_refusal`: the server may also refuse a call by cancelling it or closing the
  // connection (gRPC's memory quota does so under pressure from oversized messages).
  void Note(const std::string& method, const grpc::Status& s, const std::string& what,
            bool transport_refusal = false) {
    std::lock_guard<std::mutex> lock(mu_);
    // The server is gone (the job ended and dbs_ps exited before this process was stopped):
    // not an answer of the server's, and its exit status is checked by the test.
    if (s.error_code() == StatusCode::UNAVAILABLE &&
        s.error_message().find("failed to connect") != std::string::npos) {
      ++unreachable_;
      return;
    }
    // Nor is a call the server had not yet handed to a handler when it shut down: gRPC core
    // ends those with a bare CANCELLED (grpc/grpc#41785), where every refusal of dbs_ps's own
    // says why. Seen once in CI, at the end of the job, on a forged push.
    if (s.error_code() == StatusCode::CANCELLED && s.error_message() == "CANCELLED") {
      ++unreachable_;
      return;
    }
    ++calls_;
    const int code = static_cast<int>(s.error_code());
    ++by_method_[method.substr(method.rfind('/') + 1)][std::to_string(code)];
    const bool refused =
        Refusal(s.error_code()) ||
        (follower_ && s.error_code() == StatusCode::UNIMPLEMENTED && SchedulerMethod(method)) ||
        (transport_refusal &&
         (s.error_code() == StatusCode::CANCELLED || s.error_code() == StatusCode::UNAVAILABLE));
    if (!refused && findings_.size() < 50) {
      findings_.push_back(
          {{"method", method}, {"what", what}, {"code", code}, {"message", s.error_message()}});
    }
  }

  void Deadline(grpc::ClientContext* ctx, absl::Duration d = absl::Seconds(20)) {
    ctx->set_deadline(absl::ToChronoTime(absl::Now() + d));
  }

  void Forge(grpc::ClientContext* ctx) {
    std::lock_guard<std::mutex> lock(mu_);
    ctx->AddMetadata("x-dbs-token", absl::StrCat(rng_(), rng_()));
    ctx->AddMetadata("x-dbs-job-token", "guess");
  }

  std::string Bytes(size_t n) {
    std::lock_guard<std::mutex> lock(mu_);
    std::string s(n, '\0');
    for (char& c : s) c = static_cast<char>(rng_() & 0xff);
    return s;
  }

  void RandomBytes() {
    for (const char* method : kMethods) {
      for (size_t n :
           {size_t{0}, size_t{1}, size_t{7}, size_t{64}, size_t{4096}, size_t{1} << 20}) {
        grpc::ClientContext ctx;
        Deadline(&ctx);
        if (n % 2 == 0) Forge(&ctx);
        const std::string payload = Bytes(n);
        grpc::Slice slice(payload.data(), payload.size());
        grpc::ByteBuffer request(&slice, 1), response;
        std::mutex m;
        std::condition_variable cv;
        bool done = false;
        grpc::Status status;
        generic_->UnaryCall(&ctx, method, grpc::StubOptions(), &request, &response,
                            [&](grpc::Status s) {
                              std::lock_guard<std::mutex> lock(m);
                              status = s;
                              done = true;
                              cv.notify_one();
                            });
        std::unique_lock<std::mutex> lock(m);
        cv.wait(lock, [&] { return done; });
        Note(method, status, absl::StrCat(n, " random bytes"));
      }
    }
  }

  void RegistrationFlood() {
    for (int i = 0; i < 200; ++i) {
      dbs::v1::RegisterWorkerRequest req;
      req.set_name(i % 10 == 0 ? std::string(65536, 'n') : absl::StrCat("intruder-", i));
      req.set_train_samples(i % 3 == 0 ? -1 : (int64_t{1} << 40));
      req.set_test_samples(10000);
      req.set_incarnation(absl::StrCat(i));
      dbs::v1::RegisterWorkerReply reply;
      grpc::ClientContext ctx;
      Deadline(&ctx);
      if (i % 2 == 0) Forge(&ctx);
      Note("/RegisterWorker", sched_->RegisterWorker(&ctx, req, &reply), "registration flood");
    }
  }

  void ForgedCalls() {
    for (int id : kForgedIds) {
      for (bool forge : {false, true}) {
        {
          dbs::v1::LeaveRequest req;
          req.set_worker_id(id);
          dbs::v1::LeaveReply reply;
          grpc::ClientContext ctx;
          Deadline(&ctx);
          if (forge) Forge(&ctx);
          Note("/Leave", sched_->Leave(&ctx, req, &reply), absl::StrCat("Leave for ", id));
        }
        for (int epoch : {-1, 0, 1, 1000000000}) {
          dbs::v1::EpochReport req;
          req.set_worker_id(id);
          req.set_epoch(epoch);
          req.set_samples(1 << 30);
          req.set_compute_seconds(-1);
          dbs::v1::EpochReportReply reply;
          grpc::ClientContext ctx;
          Deadline(&ctx);
          if (forge) Forge(&ctx);
          Note("/ReportEpoch", sched_->ReportEpoch(&ctx, req, &reply), "forged report");
          dbs::v1::GetEpochPlanRequest preq;
          preq.set_worker_id(id);
          preq.set_epoch(epoch);
          dbs::v1::EpochPlan plan;
          grpc::ClientContext pctx;
          Deadline(&pctx);
          if (forge) Forge(&pctx);
          Note("/GetEpochPlan", sched_->GetEpochPlan(&pctx, preq, &plan), "forged plan request");
        }
        {
          dbs::v1::PullParametersRequest req;
          req.set_worker_id(id);
          dbs::v1::Parameters reply;
          grpc::ClientContext ctx;
          Deadline(&ctx);
          if (forge) Forge(&ctx);
          Note("/PullParameters", params_->PullParameters(&ctx, req, &reply), "forged pull");
        }
        {
          dbs::v1::ResumeRequest req;
          req.set_worker_id(id);
          dbs::v1::ResumeReply reply;
          grpc::ClientContext ctx;
          Deadline(&ctx);
          if (forge) Forge(&ctx);
          Note("/Resume", params_->Resume(&ctx, req, &reply), "forged resume");
        }
        // Shared memory that names anything: another process's descriptors, this one's
        // standard input, absurd sizes.
        for (const auto& [pid, fd, bytes] :
             std::vector<std::tuple<int64_t, int64_t, uint64_t>>{{-1, -1, 0},
                                                                 {1, 0, 12},
                                                                 {getpid(), 0, 4},
                                                                 {getpid(), 2, uint64_t{1} << 62},
                                                                 {2147483648, 3, 12}}) {
          dbs::v1::AttachSharedMemoryRequest req;
          req.set_worker_id(id);
          req.mutable_gradient()->set_pid(pid);
          req.mutable_gradient()->set_fd(fd);
          req.mutable_gradient()->set_bytes(bytes);
          dbs::v1::AttachSharedMemoryReply reply;
          grpc::ClientContext ctx;
          Deadline(&ctx);
          if (forge) Forge(&ctx);
          Note("/AttachSharedMemory", params_->AttachSharedMemory(&ctx, req, &reply),
               "forged shared memory");
        }
      }
    }
  }

  // Tensors that lie about their size, overflow, hold NaN, or mismatch the model.
  std::vector<dbs::v1::Tensor> BadTensors() {
    std::vector<dbs::v1::Tensor> out;
    auto add = [&](std::vector<int64_t> shape, size_t bytes, float fill) {
      dbs::v1::Tensor t;
      t.set_name(out.size() % 2 ? "fc1.weight" : std::string(5000, 'x'));
      for (int64_t d : shape) t.add_shape(d);
      std::string data(bytes, '\0');
      for (size_t i = 0; i + 4 <= bytes; i += 4) std::memcpy(&data[i], &fill, 4);
      t.set_data(data);
      out.push_back(t);
    };
    add({int64_t{1} << 31, int64_t{1} << 31}, 0, 0);
    add({-4, 4}, 64, 1);
    add({0}, 0, 0);
    add({4}, 3, 1);
    add({4}, 16, std::nanf(""));
    add({1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1}, 4, 1);
    add({int64_t{1} << 62, 4}, 16, 1e38f);
    return out;
  }

  void MalformedTensors() {
    for (const dbs::v1::Tensor& bad : BadTensors()) {
      for (int id : kForgedIds) {
        dbs::v1::RegisterModelRequest reg;
        reg.set_worker_id(id);
        *reg.add_parameters() = bad;
        dbs::v1::Parameters params;
        grpc::ClientContext rctx;
        Deadline(&rctx);
        Forge(&rctx);
        Note("/RegisterModel", params_->RegisterModel(&rctx, reg, &params), "malformed model");
        for (int step : {-1, 0, 1, 1 << 30}) {
          dbs::v1::PushGradientRequest push;
          push.set_worker_id(id);
          push.set_epoch(step == 0 ? 0 : -step);
          push.set_step(step);
          push.set_num_samples(step == 1 ? -5 : 16);
          push.set_loss_sum(step == -1 ? 1e308 * 10 : 1.0);
          push.set_gradient(bad.data());
          // Every dtype, and one that does not exist.
          push.set_wire_dtype(static_cast<dbs::v1::WireDtype>((step + 4) % 4));
          dbs::v1::PushGradientReply reply;
          grpc::ClientContext ctx;
          Deadline(&ctx);
          if (step != 0) Forge(&ctx);
          Note("/PushGradientSession", dbs::PushOnce(params_.get(), &ctx, push, &reply),
               "malformed push");
        }
      }
    }
  }

  // Many waiting-kind calls at once, most abandoned by a short deadline.
  void WaitingFlood() {
    std::vector<std::thread> threads;
    for (int t = 0; t < 8; ++t) {
      threads.emplace_back([this, t] {
        for (int i = 0; i < 60; ++i) {
          dbs::v1::GetEpochPlanRequest req;
          req.set_worker_id(i % 3);
          req.set_epoch(i % 4);
          dbs::v1::EpochPlan plan;
          grpc::ClientContext ctx;
          Deadline(&ctx, absl::Milliseconds(i % 2 ? 5 : 20000));
          if ((i + t) % 2) Forge(&ctx);
          const grpc::Status s = sched_->GetEpochPlan(&ctx, req, &plan);
          // A 5 ms deadline may expire on the client before any answer: that is ours, not the
          // server's; every call with a long deadline must be refused.
          if (i % 2 == 1 && s.error_code() == StatusCode::DEADLINE_EXCEEDED) continue;
          Note("/GetEpochPlan", s, "waiting flood");
        }
      });
    }
    for (std::thread& t : threads) t.join();
  }

  // Pushes far larger than any model, several at once.
  void Oversized() {
    const std::string big = Bytes(static_cast<size_t>(absl::GetFlag(FLAGS_big_mb)) << 20);
    std::vector<std::thread> threads;
    for (int t = 0; t < 4; ++t) {
      threads.emplace_back([this, t, &big] {
        dbs::v1::PushGradientRequest push;
        push.set_worker_id(t % 2);
        push.set_num_samples(16);
        push.set_gradient(big);
        dbs::v1::PushGradientReply reply;
        grpc::ClientContext ctx;
        Deadline(&ctx);
        Forge(&ctx);
        Note("/PushGradientSession", dbs::PushOnce(params_.get(), &ctx, push, &reply),
             "oversized push",
             /*transport_refusal=*/true);
      });
    }
    for (std::thread& t : threads) t.join();
  }

  // Push sessions with forged tokens: pushes of one id after another on one stream, pushes
  // written without reading the answers, and sessions walked away from.
  void SessionAbuse() {
    const std::string piece = Bytes(4096);
    for (int shape = 0; shape < 3; ++shape) {
      grpc::ClientContext ctx;
      Deadline(&ctx);
      Forge(&ctx);
      auto session = params_->PushGradientSession(&ctx);
      dbs::v1::PushGradientRequest push;
      push.set_num_samples(16);
      push.set_gradient(piece);
      for (int id : kForgedIds) {
        push.set_worker_id(id);
        if (!session->Write(push)) break;
        if (shape == 1) continue;  // writes without reading the answers
      }
      if (shape == 2) {
        ctx.TryCancel();
        (void)session->Finish();
        continue;
      }
      session->WritesDone();
      dbs::v1::PushGradientReply reply;
      while (session->Read(&reply)) {
      }
      Note("/PushGradientSession", session->Finish(), "forged push session");
    }
  }

  const bool follower_ = absl::GetFlag(FLAGS_follower);
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<dbs::v1::SchedulerService::Stub> sched_;
  std::unique_ptr<dbs::v1::ParameterService::Stub> params_;
  std::unique_ptr<grpc::GenericStub> generic_;
  std::mutex mu_;
  std::mt19937_64 rng_;
  int64_t calls_ = 0;
  int64_t unreachable_ = 0;  // calls made after dbs_ps had exited or while it shut down
  std::map<std::string, std::map<std::string, int64_t>> by_method_;
  nlohmann::json findings_ = nlohmann::json::array();
};

std::string ReadFile(const std::string& path) {
  std::ifstream in(path);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

std::shared_ptr<grpc::Channel> TlsChannel(const std::string& cert, const std::string& key) {
  grpc::SslCredentialsOptions tls;
  tls.pem_root_certs = ReadFile(absl::GetFlag(FLAGS_tls_ca));
  tls.pem_cert_chain = ReadFile(cert);
  tls.pem_private_key = ReadFile(key);
  return grpc::CreateChannel(absl::GetFlag(FLAGS_server), grpc::SslCredentials(tls));
}

int Replay() {
  auto own = TlsChannel(absl::GetFlag(FLAGS_tls_cert), absl::GetFlag(FLAGS_tls_key));
  auto other = TlsChannel(absl::GetFlag(FLAGS_tls_cert2), absl::GetFlag(FLAGS_tls_key2));
  dbs::v1::RegisterWorkerRequest req;
  req.set_name(absl::GetFlag(FLAGS_replay_name));
  req.set_train_samples(600);
  req.set_test_samples(200);
  req.set_device("cpu");
  req.set_incarnation("replay");
  auto register_over = [&](const std::shared_ptr<grpc::Channel>& channel,
                           dbs::v1::RegisterWorkerReply* reply) {
    grpc::ClientContext ctx;
    ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(60)));
    ctx.AddMetadata("x-dbs-job-token", absl::GetFlag(FLAGS_job_token));
    return dbs::v1::SchedulerService::NewStub(channel)->RegisterWorker(&ctx, req, reply);
  };
  dbs::v1::RegisterWorkerReply reply;
  const grpc::Status registered = register_over(own, &reply);
  auto pull_over = [&](const std::shared_ptr<grpc::Channel>& channel) {
    grpc::ClientContext ctx;
    ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(60)));
    ctx.AddMetadata("x-dbs-token", reply.token());
    dbs::v1::PullParametersRequest pull;
    pull.set_worker_id(reply.worker_id());
    dbs::v1::Parameters params;
    return dbs::v1::ParameterService::NewStub(channel)->PullParameters(&ctx, pull, &params);
  };
  const grpc::Status own_pull = pull_over(own);
  const grpc::Status replayed = pull_over(other);
  dbs::v1::RegisterWorkerReply again;
  const grpc::Status reregistered = register_over(other, &again);
  nlohmann::json j = {{"registered", registered.error_code()},
                      {"own", own_pull.error_code()},
                      {"replayed", replayed.error_code()},
                      {"replayed_message", replayed.error_message()},
                      {"reregistered", reregistered.error_code()},
                      {"reregistered_message", reregistered.error_message()}};
  std::printf("%s\n", j.dump().c_str());
  return 0;
}

int Insider() {
  auto channel =
      grpc::CreateChannel(absl::GetFlag(FLAGS_server), grpc::InsecureChannelCredentials());
  auto sched = dbs::v1::SchedulerService::NewStub(channel);
  auto params = dbs::v1::ParameterService::NewStub(channel);
  auto context = [](grpc::ClientContext* ctx, const std::string& token) {
    ctx->set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(30)));
    ctx->AddMetadata("x-dbs-job-token", absl::GetFlag(FLAGS_job_token));
    if (!token.empty()) ctx->AddMetadata("x-dbs-token", token);
  };
  auto registration = [](const std::string& name) {
    dbs::v1::RegisterWorkerRequest req;
    req.set_name(name);
    req.set_train_samples(3000);
    req.set_test_samples(1000);
    req.set_device("cpu");
    req.set_incarnation(name);
    return req;
  };
  // Join once the job runs (a member of the first epoch would be one of the expected workers):
  // a registration before the start is withdrawn and made again later.
  dbs::v1::RegisterWorkerReply me;
  for (int attempt = 0;; ++attempt) {
    grpc::ClientContext ctx;
    context(&ctx, "");
    const grpc::Status s =
        sched->RegisterWorker(&ctx, registration(absl::StrCat("insider-", attempt)), &me);
    if (s.ok() && me.start_epoch() > 0) break;
    if (s.ok()) {
      grpc::ClientContext leave_ctx;
      context(&leave_ctx, me.token());
      dbs::v1::LeaveRequest leave;
      leave.set_worker_id(me.worker_id());
      dbs::v1::LeaveReply left;
      sched->Leave(&leave_ctx, leave, &left);
    }
    if (attempt > 600) return 1;
    usleep(200 * 1000);
  }
  nlohmann::json codes;
  {
    grpc::ClientContext ctx;
    context(&ctx, me.token());
    dbs::v1::EpochReport report;
    report.set_worker_id(me.worker_id());
    report.set_epoch(0);
    report.set_samples(1500);
    report.set_compute_seconds(1e-6);
    report.set_test_samples(500);
    report.set_test_correct(500);
    dbs::v1::EpochReportReply reply;
    codes["report_unplanned"] = sched->ReportEpoch(&ctx, report, &reply).error_code();
  }
  std::map<std::string, int> leaves;  // by code
  for (int id = 0; id < me.worker_id(); ++id) {
    grpc::ClientContext ctx;
    context(&ctx, me.token());
    dbs::v1::LeaveRequest leave;
    leave.set_worker_id(id);
    dbs::v1::LeaveReply reply;
    ++leaves[std::to_string(sched->Leave(&ctx, leave, &reply).error_code())];
  }
  codes["leave_for_others"] = leaves;
  {
    grpc::ClientContext ctx;
    context(&ctx, me.token());
    dbs::v1::PushGradientRequest push;
    push.set_worker_id(me.worker_id());
    push.set_num_samples(1);
    push.set_loss_sum(1e308);
    dbs::v1::PushGradientReply reply;
    codes["push_huge_loss"] = dbs::PushOnce(params.get(), &ctx, push, &reply).error_code();
  }
  std::map<std::string, int> flood;
  for (int i = 0; i < 100; ++i) {
    grpc::ClientContext ctx;
    context(&ctx, "");
    dbs::v1::RegisterWorkerReply reply;
    ++flood[std::to_string(
        sched->RegisterWorker(&ctx, registration(absl::StrCat("flood-", i)), &reply).error_code())];
  }
  codes["flood"] = flood;
  codes["worker_id"] = me.worker_id();
  std::printf("%s\n", codes.dump().c_str());
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  if (!absl::GetFlag(FLAGS_replay_name).empty()) return Replay();
  if (absl::GetFlag(FLAGS_insider)) return Insider();
  Attacker attacker(absl::GetFlag(FLAGS_server));
  const int rounds = absl::GetFlag(FLAGS_rounds);
  for (int r = 1; rounds == 0 || r <= rounds; ++r) {
    attacker.Round();
    std::printf("%s\n", attacker.Record(r).dump().c_str());
    std::fflush(stdout);
  }
  return 0;
}
