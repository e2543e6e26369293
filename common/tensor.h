// Plain descriptions of a model's tensors, shared by the server and the worker.
//
// A model is a list of named float32 tensors (its layout). Both sides keep values as one flat
// buffer: tensor i occupies [Offset(i), Offset(i) + NumElements(i)).
#ifndef DBS_COMMON_TENSOR_H_
#define DBS_COMMON_TENSOR_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"

namespace dbs {

struct TensorSpec {
  std::string name;
  std::vector<int64_t> shape;
  // A buffer (BatchNorm's running statistics): averaged across workers, not trained.
  bool buffer = false;

  int64_t NumElements() const;
  std::string ShapeString() const;  // "[32, 1, 5, 5]"
  bool operator==(const TensorSpec& other) const {
    return name == other.name && shape == other.shape && buffer == other.buffer;
  }
};

using ModelLayout = std::vector<TensorSpec>;

// Total number of floats in a layout.
int64_t TotalElements(const ModelLayout& layout);

// Limits on what a peer may declare (checked by ValidateLayout).
inline constexpr int64_t kMaxModelElements = int64_t{1} << 29;  // 2 GiB of float32
inline constexpr size_t kMaxTensors = 100000;
inline constexpr size_t kMaxTensorRank = 8;
inline constexpr size_t kMaxTensorNameLength = 1024;

// Checks names are non-empty, unique and not too long, dimensions positive, and the sizes within
// the limits above (with checked multiplication); INVALID_ARGUMENT otherwise.
absl::Status ValidateLayout(const ModelLayout& layout);

// OK when `actual` has the same names and shapes in the same order as `expected`; otherwise
// INVALID_ARGUMENT naming the first difference, each side by its name ("this worker's model has
// 47 tensors where the job's model has 8").
absl::Status CheckSameLayout(const ModelLayout& expected, const ModelLayout& actual,
                             const std::string& expected_name, const std::string& actual_name);

}  // namespace dbs

#endif  // DBS_COMMON_TENSOR_H_
