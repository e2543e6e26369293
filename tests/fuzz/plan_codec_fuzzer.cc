// Fuzz target: an epoch plan, a plan revision and a resume reply as a worker receives them, and
// what the worker's loop does with them first (expanding a plan into steps).
#include <cstdint>

#include "common/plan.h"
#include "common/plan_codec.h"
#include "proto/dbs.pb.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  dbs::v1::ResumeReply reply;
  if (!reply.ParseFromArray(data, static_cast<int>(size))) return 0;
  const dbs::WorkerPlan plan = dbs::FromProto(reply.plan());
  (void)dbs::ExpandSteps(plan);
  (void)dbs::FromProto(reply.schedule());
  dbs::v1::EpochPlan back;
  dbs::ToProto(plan, &back);
  return 0;
}
