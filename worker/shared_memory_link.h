// SharedMemoryLink: a worker's side of the memory it shares with dbs_ps on the same host
// (--shared_memory). Its own region holds each step's encoded gradient, which the server reads;
// the server's parameter slots hold each step's answer, which the worker reads. Tried at the
// first push and again after the server forgot it (a restart); off for good once refused. Free
// of gRPC: the attach exchange with the server is the caller's. Not thread-safe (one worker's
// pushes).
#ifndef DBS_WORKER_SHARED_MEMORY_LINK_H_
#define DBS_WORKER_SHARED_MEMORY_LINK_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "common/shared_memory.h"
#include "common/wire_values.h"

namespace dbs {

class SharedMemoryLink {
 public:
  // `server`: the server's address, for what the link says on stderr.
  explicit SharedMemoryLink(std::string server) : server_(std::move(server)) {}

  // Asks the server to read `mine` (this worker's gradient region); the location of the
  // server's parameter slots, or why not. UNAVAILABLE, DEADLINE_EXCEEDED and CANCELLED are
  // trouble on the way, not a refusal: the next push tries again.
  using Exchange = std::function<absl::StatusOr<RegionLocation>(const RegionLocation& mine)>;
  // Attaches for a model of `values` values pushed as `dtype`, unless attached, refused before
  // or tried already since the last Forget.
  void MaybeAttach(size_t values, WireDtype dtype, const Exchange& exchange);
  bool attached() const { return slots_ != nullptr; }
  // The server no longer knows this worker's memory (it restarted): detached, the next push
  // attaches again.
  void Forget();

  // Attached only: encodes `gradient` into the worker's region; the server reads it until it
  // answers, and a retry pushes the same bytes.
  void Write(absl::Span<const float> gradient, WireDtype dtype);
  // Attached only: the parameters of `version` from the server's slots (rounded as `dtype`'s
  // answers over the socket are); false when that slot moved on or was never written.
  bool Read(int64_t version, absl::Span<float> params, WireDtype dtype) const;

 private:
  void Detach();

  const std::string server_;
  bool tried_ = false;
  bool told_ = false;  // the first attach says so on stderr
  std::unique_ptr<SharedRegion> gradient_;
  std::unique_ptr<SharedRegion> params_;
  std::unique_ptr<ParameterSlots> slots_;
};

}  // namespace dbs

#endif  // DBS_WORKER_SHARED_MEMORY_LINK_H_
