#include "server/scheduler_service.h"

#include "common/plan_codec.h"
#include "common/rpc/grpc_status.h"
#include "common/rpc/raw_call.h"
#include "common/secrets.h"
#include "glog/logging.h"

namespace dbs {

grpc::ServerUnaryReactor* SchedulerServiceImpl::RegisterWorker(grpc::CallbackServerContext* ctx,
                                                               const grpc::ByteBuffer* in,
                                                               grpc::ByteBuffer* out) {
  return ServeRaw<v1::RegisterWorkerRequest, v1::RegisterWorkerReply>(
      ctx, in, out, "RegisterWorker", hooks_,
      [this](auto* c, const auto& req, auto* reply, WaitingReactor* r) {
        DoRegisterWorker(c, req, reply, r);
      });
}

grpc::ServerUnaryReactor* SchedulerServiceImpl::Leave(grpc::CallbackServerContext* ctx,
                                                      const grpc::ByteBuffer* in,
                                                      grpc::ByteBuffer* out) {
  return ServeRaw<v1::LeaveRequest, v1::LeaveReply>(
      ctx, in, out, "Leave", hooks_,
      [this](auto* c, const auto& req, auto*, WaitingReactor* r) { DoLeave(c, req, r); });
}

grpc::ServerUnaryReactor* SchedulerServiceImpl::ReportEpoch(grpc::CallbackServerContext* ctx,
                                                            const grpc::ByteBuffer* in,
                                                            grpc::ByteBuffer* out) {
  return ServeRaw<v1::EpochReport, v1::EpochReportReply>(
      ctx, in, out, "ReportEpoch", hooks_,
      [this](auto* c, const auto& req, auto*, WaitingReactor* r) { DoReportEpoch(c, req, r); });
}

grpc::ServerUnaryReactor* SchedulerServiceImpl::GetEpochPlan(grpc::CallbackServerContext* ctx,
                                                             const grpc::ByteBuffer* in,
                                                             grpc::ByteBuffer* out) {
  return ServeRaw<v1::GetEpochPlanRequest, v1::EpochPlan>(
      ctx, in, out, "GetEpochPlan", hooks_,
      [this](auto* c, const auto& req, auto* reply, WaitingReactor* r) {
        DoGetEpochPlan(c, req, reply, r);
      });
}

void SchedulerServiceImpl::DoRegisterWorker(grpc::CallbackServerContext* ctx,
                                            const v1::RegisterWorkerRequest& req,
                                            v1::RegisterWorkerReply* reply,
                                            WaitingReactor* reactor) {
  if (!job_token_.empty()) {
    const std::string given = ClientMetadata(ctx, kJobTokenKey);
    if (given.empty() || !ConstantTimeEquals(given, job_token_)) {
      LogRefusedSecret(ctx->peer(), given.empty());
      return Answer(
          reactor,
          absl::UnauthenticatedError(
              given.empty() ? "this job needs its secret and the worker sent none: give the "
                              "worker --job_token or --job_token_file (DBS_JOB_TOKEN_FILE)"
                            : "the secret the worker sent is not this job's: give dbs_ps and "
                              "every worker the same --job_token or --job_token_file"));
    }
  }
  WorkerRegistration registration = FromProto(req);
  registration.source = PeerHost(ctx->peer());
  registration.identity = ClientIdentity(ctx);
  absl::StatusOr<RegistrationResult> r = scheduler_->Register(registration);
  if (r.ok()) {
    ToProto(*r, reply);
    reply->set_wire_dtype(static_cast<v1::WireDtype>(wire_dtype_));
  }
  Answer(reactor, r.status());
}

void SchedulerServiceImpl::LogRefusedSecret(const std::string& peer, bool missing) {
  absl::MutexLock lock(&log_mu_);
  const absl::Time now = absl::Now();
  if (now - last_refusal_logged_ < absl::Seconds(1)) {
    ++refusals_not_logged_;
    return;
  }
  LOG(WARNING) << "refused a worker from " << peer << ": "
               << (missing ? "it sent no job secret" : "its job secret is not this job's")
               << (refusals_not_logged_ > 0
                       ? absl::StrCat(" (and ", refusals_not_logged_, " more since the last line)")
                       : "");
  last_refusal_logged_ = now;
  refusals_not_logged_ = 0;
}

void SchedulerServiceImpl::DoLeave(grpc::CallbackServerContext* ctx, const v1::LeaveRequest& req,
                                   WaitingReactor* reactor) {
  absl::Status allowed = scheduler_->Authenticate(
      req.worker_id(), ClientMetadata(ctx, kWorkerTokenKey), ClientIdentity(ctx));
  if (!allowed.ok()) return Answer(reactor, allowed);
  Answer(reactor, scheduler_->Leave(req.worker_id()));
}

void SchedulerServiceImpl::DoReportEpoch(grpc::CallbackServerContext* ctx,
                                         const v1::EpochReport& req, WaitingReactor* reactor) {
  absl::Status allowed = scheduler_->Authenticate(
      req.worker_id(), ClientMetadata(ctx, kWorkerTokenKey), ClientIdentity(ctx));
  if (!allowed.ok()) return Answer(reactor, allowed);
  Answer(reactor, scheduler_->Report(FromProto(req)));
}

void SchedulerServiceImpl::DoGetEpochPlan(grpc::CallbackServerContext* ctx,
                                          const v1::GetEpochPlanRequest& req, v1::EpochPlan* reply,
                                          WaitingReactor* reactor) {
  absl::Status allowed = scheduler_->Authenticate(
      req.worker_id(), ClientMetadata(ctx, kWorkerTokenKey), ClientIdentity(ctx));
  if (!allowed.ok()) return Answer(reactor, allowed);
  // `reply` and the reactor stay valid until the answer; the scheduler always calls back (with
  // an error on abort or shutdown) unless the client went away and the wait was withdrawn.
  const uint64_t wait = scheduler_->AwaitPlan(
      req.worker_id(), req.epoch(), [reactor, reply](const absl::StatusOr<WorkerPlan>& plan) {
        if (plan.ok()) ToProto(*plan, reply);
        Answer(reactor, plan.status());
      });
  if (wait != 0) {
    reactor->SetWithdraw([s = scheduler_, wait] { return s->CancelAwait(wait); });
  }
}

}  // namespace dbs
