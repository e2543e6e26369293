// ValueBuffer: a model's values in one contiguous buffer of floats, of a fixed size. Its memory
// is its own (the heap), or memory something else owns and keeps alive for as long as the
// buffer lives: the parameter store's snapshots lie in dbs_ps's shared-memory slots that way
// (docs/dataplane.md#shared-memory), so the workers on its host read the very buffer the update
// wrote. Thread-compatible.
#ifndef DBS_COMMON_VALUE_BUFFER_H_
#define DBS_COMMON_VALUE_BUFFER_H_

#include <algorithm>
#include <cstddef>
#include <memory>
#include <vector>

namespace dbs {

class ValueBuffer {
 public:
  using value_type = float;
  using iterator = float*;
  using const_iterator = const float*;
  using size_type = size_t;

  // `size` zeroes of its own.
  explicit ValueBuffer(size_t size) : owned_(size), data_(owned_.data()), size_(size) {}
  // `size` values at `data`, which `owner` keeps valid.
  ValueBuffer(float* data, size_t size, std::shared_ptr<const void> owner)
      : data_(data), size_(size), owner_(std::move(owner)) {}
  ValueBuffer(const ValueBuffer&) = delete;
  ValueBuffer& operator=(const ValueBuffer&) = delete;

  float* data() { return data_; }
  const float* data() const { return data_; }
  size_t size() const { return size_; }
  bool empty() const { return size_ == 0; }
  float* begin() { return data_; }
  float* end() { return data_ + size_; }
  const float* begin() const { return data_; }
  const float* end() const { return data_ + size_; }
  float& operator[](size_t i) { return data_[i]; }
  const float& operator[](size_t i) const { return data_[i]; }
  // Whether the memory is the buffer's own (not another owner's).
  bool owns_memory() const { return owner_ == nullptr; }

  // A copy of the values.
  operator std::vector<float>() const { return std::vector<float>(begin(), end()); }  // NOLINT

  friend bool operator==(const ValueBuffer& a, const ValueBuffer& b) {
    return std::equal(a.begin(), a.end(), b.begin(), b.end());
  }
  friend bool operator==(const ValueBuffer& a, const std::vector<float>& b) {
    return std::equal(a.begin(), a.end(), b.begin(), b.end());
  }
  friend bool operator==(const std::vector<float>& a, const ValueBuffer& b) { return b == a; }
  friend bool operator!=(const ValueBuffer& a, const ValueBuffer& b) { return !(a == b); }
  friend bool operator!=(const ValueBuffer& a, const std::vector<float>& b) { return !(a == b); }
  friend bool operator!=(const std::vector<float>& a, const ValueBuffer& b) { return !(a == b); }

 private:
  std::vector<float> owned_;
  float* data_;
  size_t size_;
  std::shared_ptr<const void> owner_;
};

}  // namespace dbs

#endif  // DBS_COMMON_VALUE_BUFFER_H_
