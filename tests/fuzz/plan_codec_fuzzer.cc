// Fuzz target: an epoch plan, a plan revision and a resume reply as a worker receives them, and
// what the worker's loop does with them first (checking a plan, then expanding it into steps).
#include <cstdint>

#include "common/plan.h"
#include "common/plan_codec.h"
#include "proto/dbs.pb.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  dbs::v1::ResumeReply reply;
  if (!reply.ParseFromArray(data, static_cast<int>(size))) return 0;
  const dbs::WorkerPlan plan = dbs::FromProto(reply.plan());
  constexpr int64_t kTrain = 60000, kTest = 10000;
  if (!plan.finished && dbs::ValidatePlan(plan, kTrain, kTest).ok()) (void)dbs::ExpandSteps(plan);
  (void)dbs::ValidateRevision(dbs::FromProto(reply.schedule()), kTrain, kTest);
  dbs::v1::EpochPlan back;
  dbs::ToProto(plan, &back);
  return 0;
}
