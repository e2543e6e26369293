// For tests that drive dbs_ps by hand: one push on a push session of its own.
#ifndef DBS_TESTS_PUSH_ONCE_H_
#define DBS_TESTS_PUSH_ONCE_H_

#include "grpcpp/grpcpp.h"
#include "proto/dbs.grpc.pb.h"

namespace dbs {

// Pushes `push` on a new PushGradientSession of `ctx` and reads its answer into `reply`; then
// closes the session. OK only with an answer; otherwise how the session ended.
inline grpc::Status PushOnce(v1::ParameterService::Stub* stub, grpc::ClientContext* ctx,
                             const v1::PushGradientRequest& push, v1::PushGradientReply* reply) {
  auto session = stub->PushGradientSession(ctx);
  if (session->Write(push) && session->Read(reply)) {
    session->WritesDone();
    return session->Finish();
  }
  const grpc::Status ended = session->Finish();
  return ended.ok() ? grpc::Status(grpc::StatusCode::UNKNOWN, "the session ended without an answer")
                    : ended;
}

}  // namespace dbs

#endif  // DBS_TESTS_PUSH_ONCE_H_
