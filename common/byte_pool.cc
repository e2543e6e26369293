#include "common/byte_pool.h"

#include <algorithm>

namespace dbs {

std::shared_ptr<BytePool> BytePool::Create(size_t max_free) {
  return std::shared_ptr<BytePool>(new BytePool(max_free));
}

BytePool::~BytePool() {
  for (Buffer* b : free_) delete b;
}

std::shared_ptr<uint8_t> BytePool::Acquire(size_t bytes) {
  Buffer* buffer = nullptr;
  {
    absl::MutexLock lock(&mu_);
    // The smallest free buffer that fits and is not far too large.
    auto best = free_.end();
    for (auto it = free_.begin(); it != free_.end(); ++it) {
      if ((*it)->capacity >= bytes && (*it)->capacity <= 2 * bytes + 4096 &&
          (best == free_.end() || (*it)->capacity < (*best)->capacity)) {
        best = it;
      }
    }
    if (best != free_.end()) {
      buffer = *best;
      free_.erase(best);
    } else {
      ++allocations_;
    }
  }
  if (buffer == nullptr) {
    buffer = new Buffer;
    buffer->capacity = std::max<size_t>(bytes, 1);
    buffer->data.reset(new uint8_t[buffer->capacity]);
  }
  // While lent out, the buffer holds the pool: it outlives its buffers.
  return std::shared_ptr<uint8_t>(
      buffer->data.get(), [pool = shared_from_this(), buffer](uint8_t*) { pool->Release(buffer); });
}

void BytePool::Release(Buffer* buffer) {
  {
    absl::MutexLock lock(&mu_);
    if (free_.size() < max_free_) {
      free_.push_back(buffer);
      return;
    }
  }
  delete buffer;
}

size_t BytePool::DropFree() {
  std::vector<Buffer*> free;
  {
    absl::MutexLock lock(&mu_);
    free.swap(free_);
  }
  for (Buffer* b : free) delete b;
  return free.size();
}

int64_t BytePool::allocations() const {
  absl::MutexLock lock(&mu_);
  return allocations_;
}

}  // namespace dbs
