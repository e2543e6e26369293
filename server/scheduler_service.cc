#include "server/scheduler_service.h"

#include "common/grpc_status.h"
#include "common/plan_codec.h"
#include "common/secrets.h"

namespace dbs {

grpc::ServerUnaryReactor* SchedulerServiceImpl::RegisterWorker(grpc::CallbackServerContext* ctx,
                                                               const v1::RegisterWorkerRequest* req,
                                                               v1::RegisterWorkerReply* reply) {
  if (!job_token_.empty() && !ConstantTimeEquals(ClientMetadata(ctx, kJobTokenKey), job_token_)) {
    return FinishUnary(ctx, absl::UnauthenticatedError(
                                "RegisterWorker needs the job's secret (dbs_worker --job_token)"));
  }
  absl::StatusOr<RegistrationResult> r = scheduler_->Register(FromProto(*req));
  if (r.ok()) ToProto(*r, reply);
  return FinishUnary(ctx, r.status());
}

grpc::ServerUnaryReactor* SchedulerServiceImpl::Leave(grpc::CallbackServerContext* ctx,
                                                      const v1::LeaveRequest* req,
                                                      v1::LeaveReply*) {
  absl::Status allowed =
      scheduler_->Authenticate(req->worker_id(), ClientMetadata(ctx, kWorkerTokenKey));
  if (!allowed.ok()) return FinishUnary(ctx, allowed);
  return FinishUnary(ctx, scheduler_->Leave(req->worker_id()));
}

grpc::ServerUnaryReactor* SchedulerServiceImpl::ReportEpoch(grpc::CallbackServerContext* ctx,
                                                            const v1::EpochReport* req,
                                                            v1::EpochReportReply*) {
  absl::Status allowed =
      scheduler_->Authenticate(req->worker_id(), ClientMetadata(ctx, kWorkerTokenKey));
  if (!allowed.ok()) return FinishUnary(ctx, allowed);
  return FinishUnary(ctx, scheduler_->Report(FromProto(*req)));
}

grpc::ServerUnaryReactor* SchedulerServiceImpl::GetEpochPlan(grpc::CallbackServerContext* ctx,
                                                             const v1::GetEpochPlanRequest* req,
                                                             v1::EpochPlan* reply) {
  absl::Status allowed =
      scheduler_->Authenticate(req->worker_id(), ClientMetadata(ctx, kWorkerTokenKey));
  if (!allowed.ok()) return FinishUnary(ctx, allowed);
  grpc::ServerUnaryReactor* reactor = ctx->DefaultReactor();
  // The reactor and `reply` stay valid until Finish; the scheduler always calls back (with an
  // error on abort or shutdown).
  scheduler_->AwaitPlan(req->worker_id(), req->epoch(),
                        [reactor, reply](const absl::StatusOr<WorkerPlan>& plan) {
                          if (plan.ok()) ToProto(*plan, reply);
                          reactor->Finish(ToGrpcStatus(plan.status()));
                        });
  return reactor;
}

}  // namespace dbs
