// Mapping between absl::Status and grpc::Status (the codes match one to one), and finishing
// callback RPCs with a status.
#ifndef DBS_COMMON_GRPC_STATUS_H_
#define DBS_COMMON_GRPC_STATUS_H_

#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/string_view.h"
#include "common/secrets.h"
#include "grpcpp/security/auth_context.h"
#include "grpcpp/server_context.h"
#include "grpcpp/support/server_callback.h"
#include "grpcpp/support/status.h"

namespace dbs {

inline grpc::Status ToGrpcStatus(const absl::Status& s) {
  if (s.ok()) return grpc::Status::OK;
  return grpc::Status(static_cast<grpc::StatusCode>(s.code()), std::string(s.message()));
}

inline absl::Status FromGrpcStatus(const grpc::Status& s) {
  if (s.ok()) return absl::OkStatus();
  return absl::Status(static_cast<absl::StatusCode>(s.error_code()), s.error_message());
}

// gRPC's transport, short of memory under dbs_ps's --memory_quota_mb while other large calls are
// in flight, resets streams with ENHANCE_YOUR_CALM, which arrives as RESOURCE_EXHAUSTED "Received
// RST_STREAM with error code 11": the server is up and takes the call once that memory is freed,
// so it is retried as UNAVAILABLE is. The server's own RESOURCE_EXHAUSTED answers (its limits on
// workers and on waiting calls) and gRPC's message-size refusals say otherwise and are final.
inline grpc::Status AsRetried(grpc::Status s) {
  if (s.error_code() == grpc::StatusCode::RESOURCE_EXHAUSTED &&
      absl::StrContains(s.error_message(), "RST_STREAM")) {
    return grpc::Status(grpc::StatusCode::UNAVAILABLE, s.error_message());
  }
  return s;
}

// Metadata keys of the credentials (see proto/dbs.proto).
inline constexpr char kWorkerTokenKey[] = "x-dbs-token";
inline constexpr char kJobTokenKey[] = "x-dbs-job-token";
// Trailing metadata of an UNAVAILABLE answer from a server that is up but cannot take the call
// yet (a follower shard that has not heard from its leader): retry after this many ms, quietly.
inline constexpr char kRetryAfterMsKey[] = "x-dbs-retry-after-ms";
// A follower shard's key, sent by the leader on the Follow stream (ShardLog::Join).
inline constexpr char kShardKeyKey[] = "x-dbs-shard-key";

// The value of metadata `key` sent by the client ("" when absent).
inline std::string ClientMetadata(const grpc::CallbackServerContext* ctx, const char* key) {
  auto it = ctx->client_metadata().find(key);
  if (it == ctx->client_metadata().end()) return "";
  return std::string(it->second.data(), it->second.size());
}

// The host of a gRPC peer address, without its port: "ipv4:10.0.0.5:41234" -> "10.0.0.5",
// "ipv6:[::1]:41234" -> "[::1]"; any other kind of address (a Unix socket) whole.
inline std::string PeerHost(absl::string_view peer) {
  const size_t scheme = peer.find(':');
  if (scheme == absl::string_view::npos) return std::string(peer);
  const absl::string_view kind = peer.substr(0, scheme);
  if (kind != "ipv4" && kind != "ipv6") return std::string(peer);
  absl::string_view rest = peer.substr(scheme + 1);
  const size_t port = rest.rfind(':');
  return std::string(port == absl::string_view::npos ? rest : rest.substr(0, port));
}

// Who the caller is beyond its address: the SHA-256 (hex) of the certificate it presented under
// mutual TLS, "" without one (plaintext, or TLS without client certificates). A worker's token
// is bound to it (Scheduler::Authenticate).
inline std::string ClientIdentity(const grpc::ServerContextBase* ctx) {
  const std::shared_ptr<const grpc::AuthContext> auth = ctx->auth_context();
  if (auth == nullptr) return "";
  const std::vector<grpc::string_ref> pem = auth->FindPropertyValues("x509_pem_cert");
  if (pem.empty()) return "";
  return Sha256Hex(absl::string_view(pem.front().data(), pem.front().size()));
}

// Finishes a unary callback RPC at once with `s` and returns its reactor.
inline grpc::ServerUnaryReactor* FinishUnary(grpc::CallbackServerContext* ctx,
                                             const absl::Status& s) {
  grpc::ServerUnaryReactor* reactor = ctx->DefaultReactor();
  reactor->Finish(ToGrpcStatus(s));
  return reactor;
}

}  // namespace dbs

#endif  // DBS_COMMON_GRPC_STATUS_H_
