// SharedMemoryHost: dbs_ps's side of the memory it shares with the workers on its host
// (docs/dataplane.md#shared-memory). The parameter slots are the store's two snapshot buffers
// (SnapshotMemory): made when the store first holds a model of that size, stamped as the store
// publishes a version there and marked empty before it writes one again, so that the workers
// read the parameters where the update wrote them and the server keeps no second copy. Each
// attached worker's gradient region is read in place as its push's payload. Free of gRPC;
// thread-safe.
#ifndef DBS_SERVER_SHARED_MEMORY_HOST_H_
#define DBS_SERVER_SHARED_MEMORY_HOST_H_

#include <array>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <set>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "common/shared_memory.h"
#include "common/wire_values.h"
#include "server/parameter_store.h"

namespace dbs {

class SharedMemoryHost : public SnapshotMemory {
 public:
  // Gradients arrive in `wire_dtype` (the job's). `on_workers` (may be empty) is told how many
  // workers share memory after each attach or removal.
  SharedMemoryHost(WireDtype wire_dtype, std::function<void(int workers)> on_workers)
      : wire_dtype_(wire_dtype), on_workers_(std::move(on_workers)) {}

  // Opens `worker`'s gradient region at `where`, for a model of `count` values, replacing the
  // one it had; returns where the parameter slots lie. FAILED_PRECONDITION when there are no
  // slots for a model of that size (the answers go over gRPC), INVALID_ARGUMENT when the
  // region's size is not the model's in the job's wire dtype.
  absl::StatusOr<RegionLocation> Attach(int worker, const RegionLocation& where, size_t count);
  // Lets go of `workers`' regions: their memory is freed once no push still waiting to be
  // summed holds it.
  void Drop(const std::set<int>& workers);
  // Workers whose pushes may travel in shared memory now.
  int workers() const;
  // Whether the slots exist and some worker is attached.
  bool sharing() const;
  // The gradient of `worker`'s push of `samples` samples in `dtype` that lies in its region
  // (the region itself as the payload: no copy, writable by its sender); `carried_bytes` are
  // what the push carried besides, which must be none.
  absl::StatusOr<std::shared_ptr<const WirePayload>> Gradient(int worker, int samples,
                                                              WireDtype dtype,
                                                              size_t carried_bytes) const;
  // Whether `worker` is attached and `version` lies in its slot.
  bool SharesSlotOf(int64_t version, int worker) const;

  // SnapshotMemory. Where the slots cannot be made (no shared memory, or floats that are not
  // little-endian), the snapshots stay on the heap and every answer goes over gRPC.
  std::array<std::shared_ptr<ValueBuffer>, 2> CreateSnapshotBuffers(size_t count) override;
  void SnapshotWriting(int index) override;
  void SnapshotPublished(int index, int64_t version) override;

 private:
  void TellWorkersLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const WireDtype wire_dtype_;
  const std::function<void(int)> on_workers_;
  mutable absl::Mutex mu_;
  std::shared_ptr<SharedRegion> slots_region_ ABSL_GUARDED_BY(mu_);
  std::unique_ptr<ParameterSlots> slots_ ABSL_GUARDED_BY(mu_);
  std::string no_slots_ ABSL_GUARDED_BY(mu_) = "no model registered yet";
  // A push's payload holds its region, so a replaced one stays mapped until summed.
  std::map<int, std::shared_ptr<const SharedRegion>> gradients_ ABSL_GUARDED_BY(mu_);
};

}  // namespace dbs

#endif  // DBS_SERVER_SHARED_MEMORY_HOST_H_
