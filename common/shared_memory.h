// Shared memory between dbs_ps and the workers on its own host: a step's gradient and its
// answer's parameters pass through memory both processes map, instead of through two kernel
// copies each way on a loopback socket (docs/dataplane.md#shared-memory).
//
// A region is an anonymous memory file (memfd) sealed against shrinking and growing, so the
// process that maps another's region can never fault on a page that went away. A peer opens it
// as /proc/<pid>/fd/<fd>: only a process of the same user on the same host (and in the same
// PID namespace) can, which is what decides whether shared memory is used at all; anything
// else falls back to gRPC. Free of gRPC; thread-compatible.
#ifndef DBS_COMMON_SHARED_MEMORY_H_
#define DBS_COMMON_SHARED_MEMORY_H_

#include <cstddef>
#include <cstdint>
#include <memory>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "common/wire_values.h"

namespace dbs {

// Where a region lies for a peer on the same host: /proc/<pid>/fd/<fd>, `bytes` long.
struct RegionLocation {
  int64_t pid = 0;
  int64_t fd = -1;
  uint64_t bytes = 0;
};

class SharedRegion {
 public:
  // A new zero-filled region of `bytes` bytes, sealed, mapped read-write in this process.
  static absl::StatusOr<std::unique_ptr<SharedRegion>> Create(absl::string_view name, size_t bytes);
  // Maps another process's region read-only. Refuses (INVALID_ARGUMENT or FAILED_PRECONDITION,
  // naming why) anything but a sealed memory file of this user, created with `name`, of
  // exactly `where.bytes`: a peer cannot point the reader at any other file.
  static absl::StatusOr<std::unique_ptr<SharedRegion>> Open(const RegionLocation& where,
                                                            absl::string_view name);
  ~SharedRegion();
  SharedRegion(const SharedRegion&) = delete;
  SharedRegion& operator=(const SharedRegion&) = delete;

  uint8_t* data() { return data_; }
  const uint8_t* data() const { return data_; }
  size_t size() const { return size_; }
  // Where a peer finds it (a created region; an opened one keeps no descriptor).
  RegionLocation location() const;

 private:
  SharedRegion(uint8_t* data, size_t size, int fd) : data_(data), size_(size), fd_(fd) {}
  uint8_t* data_;
  size_t size_;
  int fd_;  // -1 for an opened region
};

// The server's answers in shared memory: two slots of the model's values in fp32, which are
// the server's own two snapshot buffers (Fp32Slot), each stamped with the version it holds;
// version v lies in slot v % 2. The server writes a version there (its running sum lies there
// first) while the workers may still read the one before, in the other slot, and writes into a
// slot only after every worker of the step has pushed, that is, has read the version the slot
// held two versions ago. The values are fp32 whatever the job's wire dtype: a reader of a 16-bit
// job rounds them as the wire would (Read), so it gets what an answer over gRPC carries.
// A reader checks the slot's version before and after its copy (a sequence lock): a copy that
// raced a write is refused, never returned torn.
class ParameterSlots {
 public:
  // The region's size for `count` values.
  static size_t RegionBytes(size_t count);
  // Over `region` (which must be RegionBytes long; it is not owned and must outlive this).
  ParameterSlots(SharedRegion* region, size_t count);

  // Writer (the server): marks every slot empty.
  void Clear();
  // True when `version`'s slot holds it.
  bool Holds(int64_t version) const;
  // The slot `version` lies in.
  static int IndexOf(int64_t version) { return static_cast<int>(version % 2); }
  size_t count() const { return count_; }

  // Slot `index`'s memory (the writer's), marked empty before anything is written there and
  // stamped with the version it holds once that is all written.
  float* Fp32Slot(int index);
  void MarkEmpty(int index);
  void MarkHolds(int64_t version);

  // Reader (a worker): copies `version`'s values into `out` (count values), rounded as
  // `rounded_as` rounds them on the wire; false when its slot does not hold it, before or
  // after the copy.
  bool Read(int64_t version, absl::Span<float> out, WireDtype rounded_as = WireDtype::kFp32) const;

 private:
  const float* SlotAt(int index) const;
  SharedRegion* const region_;
  const size_t count_;
  const size_t slot_bytes_;
};

}  // namespace dbs

#endif  // DBS_COMMON_SHARED_MEMORY_H_
