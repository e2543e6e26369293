// BytePool: reusable byte buffers for what is encoded once per step (a worker's 16-bit gradient,
// the server's 16-bit parameters for its answers). A buffer comes back to the pool when the last
// reference to it goes, wherever that is (gRPC lets go of a sent message's bytes on its own
// threads), so the same memory, already mapped, serves every step. Thread-safe; buffers may
// outlive the pool's owner.
#ifndef DBS_COMMON_BYTE_POOL_H_
#define DBS_COMMON_BYTE_POOL_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"

namespace dbs {

class BytePool : public std::enable_shared_from_this<BytePool> {
 public:
  // Keeps at most `max_free` buffers that nobody holds.
  static std::shared_ptr<BytePool> Create(size_t max_free = 4);
  ~BytePool();

  // `bytes` bytes (contents stale), back to the pool when the last copy of the pointer goes.
  std::shared_ptr<uint8_t> Acquire(size_t bytes);

  // Lets go of the free buffers (a caller that will not need them for a while); returns how
  // many.
  size_t DropFree();

  // Buffers allocated so far (for tests: steady state allocates none).
  int64_t allocations() const;

 private:
  struct Buffer {
    std::unique_ptr<uint8_t[]> data;
    size_t capacity = 0;
  };
  explicit BytePool(size_t max_free) : max_free_(max_free) {}
  void Release(Buffer* buffer);

  const size_t max_free_;
  mutable absl::Mutex mu_;
  std::vector<Buffer*> free_ ABSL_GUARDED_BY(mu_);
  int64_t allocations_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace dbs

#endif  // DBS_COMMON_BYTE_POOL_H_
