#include "server/scheduler_service.h"

#include "common/grpc_status.h"
#include "common/plan_codec.h"
#include "common/raw_call.h"
#include "common/secrets.h"

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
  if (!job_token_.empty() && !ConstantTimeEquals(ClientMetadata(ctx, kJobTokenKey), job_token_)) {
    return Answer(reactor, absl::UnauthenticatedError(
                               "RegisterWorker needs the job's secret (dbs_worker --job_token)"));
  }
  absl::StatusOr<RegistrationResult> r = scheduler_->Register(FromProto(req));
  if (r.ok()) {
    ToProto(*r, reply);
    reply->set_wire_dtype(static_cast<v1::WireDtype>(wire_dtype_));
  }
  Answer(reactor, r.status());
}

void SchedulerServiceImpl::DoLeave(grpc::CallbackServerContext* ctx, const v1::LeaveRequest& req,
                                   WaitingReactor* reactor) {
  absl::Status allowed =
      scheduler_->Authenticate(req.worker_id(), ClientMetadata(ctx, kWorkerTokenKey));
  if (!allowed.ok()) return Answer(reactor, allowed);
  Answer(reactor, scheduler_->Leave(req.worker_id()));
}

void SchedulerServiceImpl::DoReportEpoch(grpc::CallbackServerContext* ctx,
                                         const v1::EpochReport& req, WaitingReactor* reactor) {
  absl::Status allowed =
      scheduler_->Authenticate(req.worker_id(), ClientMetadata(ctx, kWorkerTokenKey));
  if (!allowed.ok()) return Answer(reactor, allowed);
  Answer(reactor, scheduler_->Report(FromProto(req)));
}

void SchedulerServiceImpl::DoGetEpochPlan(grpc::CallbackServerContext* ctx,
                                          const v1::GetEpochPlanRequest& req, v1::EpochPlan* reply,
                                          WaitingReactor* reactor) {
  absl::Status allowed =
      scheduler_->Authenticate(req.worker_id(), ClientMetadata(ctx, kWorkerTokenKey));
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
