// ServeRaw: serves a unary method registered as a raw callback (ByteBuffer in, ByteBuffer out)
// with a typed handler, so that the request is parsed here and not by gRPC.
//
// gRPC's callback API answers a request whose bytes do not parse as the method's message with
// status code 12 and an empty message, as if the method did not exist. Parsed here, such a
// request gets INVALID_ARGUMENT naming the message type. The typed handler answers through the
// WaitingReactor it is given (FinishOnce, possibly later from another thread, and SetWithdraw
// for a call that waits); the reply is serialized just before the answer goes out. The parsed
// request lives only while the handler runs.
#ifndef DBS_COMMON_RAW_CALL_H_
#define DBS_COMMON_RAW_CALL_H_

#include <atomic>
#include <memory>
#include <string>
#include <utility>

#include "common/call_observer.h"
#include "common/rpc/grpc_status.h"
#include "common/rpc/waiting_reactor.h"
#include "grpcpp/support/byte_buffer.h"
#include "grpcpp/support/proto_buffer_reader.h"
#include "grpcpp/support/proto_buffer_writer.h"
#include "grpcpp/support/server_callback.h"
#include "grpcpp/support/status.h"

namespace dbs {

// Answers the call with `s`.
inline void Answer(WaitingReactor* reactor, const absl::Status& s) {
  reactor->FinishOnce(ToGrpcStatus(s));
}

// How a raw call's request is parsed and its reply serialized: with the generated code for
// protobuf messages; another type (a message read without copying its payload, a reply that
// shares pre-serialized bytes) provides overloads of these, found by argument-dependent lookup.
template <typename Req>
grpc::Status RawDecode(grpc::ByteBuffer* in, Req* request) {
  if (grpc::SerializationTraits<Req>::Deserialize(in, request).ok()) return grpc::Status::OK;
  return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                      std::string("malformed request: the bytes are not a valid ") +
                          std::string(Req::descriptor()->full_name()));
}

template <typename Resp>
bool RawEncode(const Resp& reply, grpc::ByteBuffer* out) {
  bool own_buffer = false;
  return grpc::SerializationTraits<Resp>::Serialize(reply, out, &own_buffer).ok();
}

// What a service does around every call.
struct CallHooks {
  CallObserver* observer = nullptr;  // hears of every call as it is answered (may be null)
  // While it is false (the server is starting or restoring a checkpoint), every call is
  // answered UNAVAILABLE, which clients retry. Null: always serving.
  const std::atomic<bool>* serving = nullptr;
};

// OK while `hooks` says the server serves; otherwise what every call is answered meanwhile.
inline grpc::Status ServingStatus(const CallHooks& hooks) {
  if (hooks.serving == nullptr || hooks.serving->load()) return grpc::Status::OK;
  return grpc::Status(grpc::StatusCode::UNAVAILABLE,
                      "dbs_ps is starting (restoring its checkpoint); retry");
}

// `handler(ctx, const Req&, Resp*, WaitingReactor*)` must answer exactly once. The call is
// known to `hooks` as `method`.
template <typename Req, typename Resp, typename Handler>
grpc::ServerUnaryReactor* ServeRaw(grpc::CallbackServerContext* ctx, const grpc::ByteBuffer* in,
                                   grpc::ByteBuffer* out, const char* method,
                                   const CallHooks& hooks, Handler&& handler) {
  CallObserver* const observer = hooks.observer;
  auto reply = std::make_shared<Resp>();
  const size_t received = in->Length();
  auto* reactor =
      new WaitingReactor([reply, out, method, observer, received](const grpc::Status& status) {
        grpc::Status answer = status;
        if (status.ok() && !RawEncode(*reply, out)) {
          answer = grpc::Status(grpc::StatusCode::INTERNAL, "cannot serialize the reply");
        }
        if (observer != nullptr) {
          observer->OnCall(method, received, answer.ok() ? out->Length() : 0,
                           static_cast<int>(answer.error_code()));
        }
        return answer;
      });
  Req request;
  grpc::ByteBuffer bytes(*in);  // shares the slices; Deserialize consumes its argument
  if (grpc::Status serving = ServingStatus(hooks); !serving.ok()) {
    reactor->FinishOnce(serving);
  } else if (grpc::Status parsed = RawDecode(&bytes, &request); !parsed.ok()) {
    reactor->FinishOnce(parsed);
  } else {
    handler(ctx, request, reply.get(), reactor);
  }
  reactor->Release();
  return reactor;
}

}  // namespace dbs

#endif  // DBS_COMMON_RAW_CALL_H_
