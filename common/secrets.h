// Secrets: random tokens, comparing them, and worker tokens signed with the job's secret.
#ifndef DBS_COMMON_SECRETS_H_
#define DBS_COMMON_SECRETS_H_

#include <string>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"

namespace dbs {

// 128 random bits from the kernel (getrandom), as 32 hex digits.
std::string RandomToken();

// Compares secrets without an early exit (OpenSSL's CRYPTO_memcmp), so timing does not tell how
// much of a guess was right.
bool ConstantTimeEquals(absl::string_view a, absl::string_view b);

// Worker tokens that every shard of a server can check by itself, before it has heard of the
// worker: 128 random bits and an HMAC-SHA256 (OpenSSL) of the worker id and those bits under a
// key derived from the job's secret, as 64 hex digits. Only a holder of the secret can make one
// that passes IsIssuedWorkerToken; the server still compares a call's token with the one it
// issued to that worker.
std::string TokenKeyFromSecret(absl::string_view job_secret);

// OK unless worker `worker_id`'s token is bound to client certificate `bound` (its identity:
// Sha256Hex of it; "" for none) and the call comes with another, `identity`: PERMISSION_DENIED.
absl::Status CheckIdentity(int worker_id, absl::string_view bound, absl::string_view identity);

// SHA-256 of `bytes`, as 64 hex digits (a client certificate's identity: ClientIdentity,
// common/rpc/grpc_status.h).
std::string Sha256Hex(absl::string_view bytes);
std::string IssueWorkerToken(absl::string_view key, int worker_id);
bool IsIssuedWorkerToken(absl::string_view key, int worker_id, absl::string_view token);

}  // namespace dbs

#endif  // DBS_COMMON_SECRETS_H_
