// SchedulerService adapter: parses dbs.v1 scheduler requests, calls the Scheduler, maps statuses.
// Plan requests use the callback API: no thread waits while a worker waits for its plan, and a
// request whose client went away gives its wait back. Requests are parsed here (raw methods,
// common/rpc/raw_call.h), so bytes that are not the method's message get INVALID_ARGUMENT.
#ifndef DBS_SERVER_SCHEDULER_SERVICE_H_
#define DBS_SERVER_SCHEDULER_SERVICE_H_

#include <cstdint>
#include <string>

#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/rpc/raw_call.h"
#include "common/rpc/waiting_reactor.h"
#include "common/wire_values.h"
#include "proto/dbs.grpc.pb.h"
#include "server/scheduler.h"

namespace dbs {

using SchedulerRawService = v1::SchedulerService::WithRawCallbackMethod_RegisterWorker<
    v1::SchedulerService::WithRawCallbackMethod_Leave<
        v1::SchedulerService::WithRawCallbackMethod_ReportEpoch<
            v1::SchedulerService::WithRawCallbackMethod_GetEpochPlan<
                v1::SchedulerService::Service>>>>;

class SchedulerServiceImpl final : public SchedulerRawService {
 public:
  // `scheduler` (and what `hooks` point to) must outlive the service. With a `job_token`,
  // RegisterWorker requires it.
  // Registering workers learn the job's `wire_dtype`.
  explicit SchedulerServiceImpl(Scheduler* scheduler, std::string job_token = "",
                                CallHooks hooks = {}, WireDtype wire_dtype = WireDtype::kFp32)
      : scheduler_(scheduler),
        job_token_(std::move(job_token)),
        hooks_(hooks),
        wire_dtype_(wire_dtype) {}

  grpc::ServerUnaryReactor* RegisterWorker(grpc::CallbackServerContext* ctx,
                                           const grpc::ByteBuffer* in,
                                           grpc::ByteBuffer* out) override;
  grpc::ServerUnaryReactor* Leave(grpc::CallbackServerContext* ctx, const grpc::ByteBuffer* in,
                                  grpc::ByteBuffer* out) override;
  grpc::ServerUnaryReactor* ReportEpoch(grpc::CallbackServerContext* ctx,
                                        const grpc::ByteBuffer* in, grpc::ByteBuffer* out) override;
  grpc::ServerUnaryReactor* GetEpochPlan(grpc::CallbackServerContext* ctx,
                                         const grpc::ByteBuffer* in,
                                         grpc::ByteBuffer* out) override;

 private:
  void DoRegisterWorker(grpc::CallbackServerContext* ctx, const v1::RegisterWorkerRequest& req,
                        v1::RegisterWorkerReply* reply, WaitingReactor* reactor);
  void DoLeave(grpc::CallbackServerContext* ctx, const v1::LeaveRequest& req,
               WaitingReactor* reactor);
  void DoReportEpoch(grpc::CallbackServerContext* ctx, const v1::EpochReport& req,
                     WaitingReactor* reactor);
  void DoGetEpochPlan(grpc::CallbackServerContext* ctx, const v1::GetEpochPlanRequest& req,
                      v1::EpochPlan* reply, WaitingReactor* reactor);
  // Logs a registration refused for its job secret, with the peer's address: at most one line
  // a second (a flood of refused calls counts into the next line).
  void LogRefusedSecret(const std::string& peer, bool missing);

  Scheduler* const scheduler_;
  const std::string job_token_;
  const CallHooks hooks_;
  const WireDtype wire_dtype_;
  absl::Mutex log_mu_;
  absl::Time last_refusal_logged_ ABSL_GUARDED_BY(log_mu_) = absl::InfinitePast();
  int64_t refusals_not_logged_ ABSL_GUARDED_BY(log_mu_) = 0;
};

}  // namespace dbs

#endif  // DBS_SERVER_SCHEDULER_SERVICE_H_
