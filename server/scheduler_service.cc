#include "server/scheduler_service.h"

#include "common/grpc_status.h"
#include "common/plan_codec.h"

namespace dbs {

grpc::ServerUnaryReactor* SchedulerServiceImpl::RegisterWorker(
    grpc::CallbackServerContext* ctx, const v1::RegisterWorkerRequest* req,
    v1::RegisterWorkerReply* reply) {
  WorkerRegistration reg{req->name(), req->train_samples(), req->test_samples(), req->device(),
                         req->max_batch()};
  absl::StatusOr<RegistrationResult> r = scheduler_->Register(reg);
  if (r.ok()) {
    reply->set_worker_id(r->worker_id);
    reply->set_expected_workers(r->expected_workers);
    reply->set_epochs(r->epochs);
    reply->set_global_batch(r->global_batch);
    reply->set_policy(r->policy);
    reply->set_start_epoch(r->start_epoch);
  }
  return FinishUnary(ctx, r.status());
}

grpc::ServerUnaryReactor* SchedulerServiceImpl::Leave(grpc::CallbackServerContext* ctx,
                                                      const v1::LeaveRequest* req,
                                                      v1::LeaveReply*) {
  return FinishUnary(ctx, scheduler_->Leave(req->worker_id()));
}

grpc::ServerUnaryReactor* SchedulerServiceImpl::ReportEpoch(grpc::CallbackServerContext* ctx,
                                                            const v1::EpochReport* req,
                                                            v1::EpochReportReply*) {
  return FinishUnary(ctx, scheduler_->Report(FromProto(*req)));
}

grpc::ServerUnaryReactor* SchedulerServiceImpl::GetEpochPlan(grpc::CallbackServerContext* ctx,
                                                             const v1::GetEpochPlanRequest* req,
                                                             v1::EpochPlan* reply) {
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
