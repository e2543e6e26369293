// GrpcPsClient: PsClient over gRPC (one channel to dbs_ps for both services).
//
// RegisterWorker retries with exponential backoff while the server is unreachable and, when
// `connect_timeout` runs out, fails with a message naming the address and the attempts made.
// A step's push and its answer travel as raw bytes (common/step_wire.h): the gradient is encoded
// once into a reused buffer, and the parameters are decoded from the received message straight
// into the caller's storage.
// Not thread-safe: one client per worker loop.
#ifndef DBS_WORKER_GRPC_PS_CLIENT_H_
#define DBS_WORKER_GRPC_PS_CLIENT_H_

#include <memory>
#include <string>

#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/backoff.h"
#include "common/rpc/byte_stream.h"
#include "common/rpc/grpc_step_wire.h"
#include "proto/dbs.grpc.pb.h"
#include "worker/ps_client.h"
#include "worker/shared_memory_link.h"

namespace dbs {

struct GrpcClientConfig {
  std::string address = "127.0.0.1:50051";
  absl::Duration connect_timeout = absl::Seconds(60);
  // Every call has a deadline. A call that answers at once (register, pull, report, resume)
  // gets `call_timeout` per attempt and is retried, within `connect_timeout`, when it runs out.
  // A call that waits on the other workers (a step's push, the next epoch's plan) may wait
  // legitimately for long: each attempt gets `call_timeout` and is then re-issued (both are
  // idempotent and the server drops the abandoned one), for at most `max_wait` in all (zero:
  // no limit; the server's own worker and stall timeouts end a job that cannot go on).
  absl::Duration call_timeout = absl::Seconds(60);
  absl::Duration max_wait = absl::ZeroDuration();
  BackoffConfig backoff;
  // The largest message sent or accepted: every call carries the whole model at most once
  // (the registration and a resume in fp32, a push and its answer in the wire dtype).
  int max_message_mb = 512;
  // A worker on dbs_ps's own host shares memory with it (AttachSharedMemory, at its first
  // push): each step's gradient and answer pass through memory both map instead of the
  // socket. Where the server cannot open this process's memory (another host, user or PID
  // namespace) or serves none, pushes go over gRPC as without it.
  bool shared_memory = true;
  std::string job_token;  // the job's secret, sent with RegisterWorker ('' : none)
  // TLS (PEM contents): the CA that signed the server's certificate turns TLS on; a certificate
  // and key of this worker's, signed by the CA the server trusts, make it mutual TLS.
  std::string tls_ca_pem;
  std::string tls_cert_pem;
  std::string tls_key_pem;
};

class GrpcPsClient : public PsClient {
 public:
  explicit GrpcPsClient(const GrpcClientConfig& config);
  ~GrpcPsClient() override;

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
  void Interrupt() override;

  // For a shard of a sharded job that follows the server this worker registered with: the
  // credential and wire dtype that registration gave, instead of registering here.
  void AdoptRegistration(std::string token, WireDtype wire_dtype) {
    token_ = std::move(token);
    wire_dtype_ = wire_dtype;
  }
  const std::string& token() const { return token_; }
  // How many push sessions this client has opened (one for many steps, unless one ended or
  // half the call timeout passed).
  int sessions_opened() const { return sessions_opened_; }
  // Whether pushes travel in shared memory now (after the first push).
  bool shares_memory() const { return shm_.attached(); }
  WireDtype wire_dtype() const { return wire_dtype_; }
  // Whether a call is in progress (Abandon or Interrupt would cancel its context); false
  // between calls, however the last one ended.
  bool in_call() const;

  // From another thread: ends the call in flight, and any retry of it, with CANCELLED
  // ("abandoned"), and every later call at once, until ResumeCalls(). A sharded client
  // abandons the other shards' part of a step once one shard has refused it: a follower may
  // hold a push for the next step until its leader has done the step this worker must redo.
  void Abandon();
  void ResumeCalls();

 private:
  // Runs `rpc` (a call on a fresh context with the deadline above), retrying with backoff while
  // the server is unavailable or an attempt timed out, for at most `connect_timeout`; a waiting
  // call (`waits`) is re-issued after each timed-out attempt for at most `max_wait`. Every call
  // here is idempotent.
  template <typename Rpc>
  grpc::Status WithRetry(Rpc rpc, bool waits = false);

  // Adds the server's address to an error so the user knows which peer failed.
  absl::Status Annotate(const grpc::Status& s, const char* what) const;

  const GrpcClientConfig config_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::SchedulerService::Stub> scheduler_;
  std::unique_ptr<v1::ParameterService::Stub> parameters_;
  // The push session: pushes of many steps, as raw bytes (common/step_wire.h), on one stream, each
  // written and then its answer read on this thread. It gets a deadline of `call_timeout` when it
  // opens and is replaced, between pushes, once half of that has passed (a waiting push still gets
  // at least half a timeout before it is re-issued) or when the credential changes. Any failure
  // ends it.
  struct PushSession {
    grpc::ClientContext ctx;
    std::unique_ptr<ByteStream> stream;
    absl::Time opened;
    std::string token;
  };
  std::unique_ptr<PushSession> session_;
  // The retry-after (kRetryAfterMsKey) of the session that ended the last push attempt, if any.
  int session_retry_after_ms_ = 0;
  int sessions_opened_ = 0;
  // One attempt of a push on the session (opened if needed); `ctx` is the attempt's own.
  grpc::Status PushAttempt(grpc::ClientContext* ctx, const grpc::ByteBuffer& request);
  // Ends the session between pushes (cancels it: the server takes that as its end).
  // `attempt`: the context of the push attempt in progress (nullptr outside one).
  void CloseSession(grpc::ClientContext* attempt);
  // Destroys the session once ended, pointing Interrupt and Abandon at `attempt` first.
  void ForgetSession(grpc::ClientContext* attempt);
  // Waits for gRPC to let go of a pushed gradient's memory.
  static absl::Status AwaitGradientReturned(const GradientOnWire& bytes, absl::string_view call);
  static StepOutcome OutcomeOf(const v1::PushGradientReply& reply, int64_t version);
  // Shared memory with the server (GrpcClientConfig::shared_memory).
  SharedMemoryLink shm_{config_.address};
  void MaybeAttach(int worker_id);
  // A push through shared memory: the gradient encoded into this worker's region, the answer's
  // parameters read from the server's slots (pulled over gRPC if a read is refused).
  absl::StatusOr<StepOutcome> PushShared(const v1::PushGradientRequest& head,
                                         absl::Span<const float> gradient,
                                         absl::Span<float> params);
  ModelLayout layout_;
  WireDtype wire_dtype_ = WireDtype::kFp32;  // the job's, from RegisterWorker
  std::shared_ptr<BytePool> pool_ = BytePool::Create(2);
  grpc::ByteBuffer push_reply_;
  std::vector<grpc::Slice> reply_slices_;
  bool reconnected_ = false;
  const std::string incarnation_;  // this process's, for every registration
  std::string token_;              // from RegisterWorker, sent with every later call
  // The call in progress, for Interrupt (from another thread).
  mutable absl::Mutex interrupt_mu_;
  grpc::ClientContext* current_ ABSL_GUARDED_BY(interrupt_mu_) = nullptr;
  bool interrupted_ ABSL_GUARDED_BY(interrupt_mu_) = false;
  bool abandoned_ ABSL_GUARDED_BY(interrupt_mu_) = false;
  // Registers `ctx` as the call in progress; false, registering nothing, if interrupted or
  // abandoned already.
  bool Begin(grpc::ClientContext* ctx);
  // Makes `ctx` the call in progress instead (the push session's); false as Begin.
  bool Retarget(grpc::ClientContext* ctx);
  // Ends the call in progress; true if interrupted or abandoned meanwhile.
  bool End();
  // Waits `delay` between attempts; true if interrupted or abandoned meanwhile.
  bool Pause(absl::Duration delay);
  // Why a call ended without an answer: "interrupted" or "abandoned ...".
  std::string StopReason();
};

}  // namespace dbs

#endif  // DBS_WORKER_GRPC_PS_CLIENT_H_
