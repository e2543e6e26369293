// Conversion between the plan/report structs of common/plan.h and their dbs.v1 messages.
#ifndef DBS_COMMON_PLAN_CODEC_H_
#define DBS_COMMON_PLAN_CODEC_H_

#include "common/plan.h"
#include "proto/dbs.pb.h"

namespace dbs {

void ToProto(const WorkerPlan& plan, v1::EpochPlan* out);
WorkerPlan FromProto(const v1::EpochPlan& msg);

void ToProto(const PlanRevision& revision, v1::PlanRevision* out);
PlanRevision FromProto(const v1::PlanRevision& msg);

void ToProto(const EpochTiming& timing, v1::EpochReport* out);
EpochTiming FromProto(const v1::EpochReport& msg);

void ToProto(const WorkerRegistration& registration, v1::RegisterWorkerRequest* out);
WorkerRegistration FromProto(const v1::RegisterWorkerRequest& msg);

void ToProto(const RegistrationResult& result, v1::RegisterWorkerReply* out);
RegistrationResult FromProto(const v1::RegisterWorkerReply& msg);

}  // namespace dbs

#endif  // DBS_COMMON_PLAN_CODEC_H_
