// SchedulerService adapter: parses dbs.v1 scheduler requests, calls the Scheduler, maps statuses.
// Plan requests use the callback API: no thread waits while a worker waits for its plan.
#ifndef DBS_SERVER_SCHEDULER_SERVICE_H_
#define DBS_SERVER_SCHEDULER_SERVICE_H_

#include <string>

#include "proto/dbs.grpc.pb.h"
#include "server/scheduler.h"

namespace dbs {

class SchedulerServiceImpl final : public v1::SchedulerService::CallbackService {
 public:
  // `scheduler` must outlive the service. With a `job_token`, RegisterWorker requires it.
  explicit SchedulerServiceImpl(Scheduler* scheduler, std::string job_token = "")
      : scheduler_(scheduler), job_token_(std::move(job_token)) {}

  grpc::ServerUnaryReactor* RegisterWorker(grpc::CallbackServerContext* ctx,
                                           const v1::RegisterWorkerRequest* req,
                                           v1::RegisterWorkerReply* reply) override;
  grpc::ServerUnaryReactor* Leave(grpc::CallbackServerContext* ctx, const v1::LeaveRequest* req,
                                  v1::LeaveReply* reply) override;
  grpc::ServerUnaryReactor* ReportEpoch(grpc::CallbackServerContext* ctx,
                                        const v1::EpochReport* req,
                                        v1::EpochReportReply* reply) override;
  grpc::ServerUnaryReactor* GetEpochPlan(grpc::CallbackServerContext* ctx,
                                         const v1::GetEpochPlanRequest* req,
                                         v1::EpochPlan* reply) override;

 private:
  Scheduler* const scheduler_;
  const std::string job_token_;
};

}  // namespace dbs

#endif  // DBS_SERVER_SCHEDULER_SERVICE_H_
