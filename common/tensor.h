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

  int64_t NumElements() const;
  std::string ShapeString() const;  // "[32, 1, 5, 5]"
  bool operator==(const TensorSpec& other) const {
    return name == other.name && shape == other.shape;
  }
};

using ModelLayout = std::vector<TensorSpec>;

// Total number of floats in a layout.
int64_t TotalElements(const ModelLayout& layout);

// Checks names are non-empty and unique and dimensions positive; INVALID_ARGUMENT otherwise.
absl::Status ValidateLayout(const ModelLayout& layout);

// OK when `actual` has the same names and shapes in the same order as `expected`; otherwise
// INVALID_ARGUMENT naming the first difference. `what` prefixes the message ("gradient").
absl::Status CheckSameLayout(const ModelLayout& expected, const ModelLayout& actual,
                             const std::string& what);

}  // namespace dbs

#endif  // DBS_COMMON_TENSOR_H_
