#include "common/secrets.h"

#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <sys/random.h>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"

namespace dbs {
namespace {

constexpr size_t kNonceBytes = 16;
constexpr size_t kMacBytes = 16;  // HMAC-SHA256 truncated to 128 bits

std::string RandomBytes(size_t size) {
  std::string bytes(size, '\0');
  size_t got = 0;
  while (got < size) {
    const ssize_t n = getrandom(bytes.data() + got, size - got, 0);
    if (n > 0) got += static_cast<size_t>(n);
  }
  return bytes;
}

std::string HmacSha256(absl::string_view key, absl::string_view data) {
  unsigned char mac[EVP_MAX_MD_SIZE];
  unsigned int size = 0;
  HMAC(EVP_sha256(), key.data(), static_cast<int>(key.size()),
       reinterpret_cast<const unsigned char*>(data.data()), data.size(), mac, &size);
  return std::string(reinterpret_cast<const char*>(mac), size);
}

// The MAC of a worker's token, as hex.
std::string TokenMac(absl::string_view key, int worker_id, absl::string_view nonce_hex) {
  const std::string mac =
      HmacSha256(key, absl::StrCat("dbs worker token:", worker_id, ":", nonce_hex));
  return absl::BytesToHexString(absl::string_view(mac).substr(0, kMacBytes));
}

}  // namespace

std::string RandomToken() { return absl::BytesToHexString(RandomBytes(kNonceBytes)); }

bool ConstantTimeEquals(absl::string_view a, absl::string_view b) {
  return a.size() == b.size() && CRYPTO_memcmp(a.data(), b.data(), a.size()) == 0;
}

absl::Status CheckIdentity(int worker_id, absl::string_view bound, absl::string_view identity) {
  if (bound.empty() || identity == bound) return absl::OkStatus();
  return absl::PermissionDeniedError(
      absl::StrCat("worker ", worker_id,
                   "'s token was issued to another client certificate: a worker's name "
                   "and token work only with the certificate it registered with"));
}

std::string Sha256Hex(absl::string_view bytes) {
  unsigned char digest[EVP_MAX_MD_SIZE];
  unsigned int size = 0;
  EVP_Digest(bytes.data(), bytes.size(), digest, &size, EVP_sha256(), nullptr);
  return absl::BytesToHexString(absl::string_view(reinterpret_cast<const char*>(digest), size));
}

std::string TokenKeyFromSecret(absl::string_view job_secret) {
  return HmacSha256(job_secret, "dbs worker token key v1");
}

std::string IssueWorkerToken(absl::string_view key, int worker_id) {
  const std::string nonce = RandomToken();
  return absl::StrCat(nonce, TokenMac(key, worker_id, nonce));
}

bool IsIssuedWorkerToken(absl::string_view key, int worker_id, absl::string_view token) {
  if (token.size() != 2 * (kNonceBytes + kMacBytes)) return false;
  const absl::string_view nonce = token.substr(0, 2 * kNonceBytes);
  return ConstantTimeEquals(token.substr(2 * kNonceBytes), TokenMac(key, worker_id, nonce));
}

}  // namespace dbs
