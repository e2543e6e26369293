#include "common/tensor.h"

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace dbs {

int64_t TensorSpec::NumElements() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

std::string TensorSpec::ShapeString() const {
  return absl::StrCat("[", absl::StrJoin(shape, ", "), "]");
}

int64_t TotalElements(const ModelLayout& layout) {
  int64_t n = 0;
  for (const TensorSpec& t : layout) n += t.NumElements();
  return n;
}

absl::Status ValidateLayout(const ModelLayout& layout) {
  if (layout.empty()) return absl::InvalidArgumentError("the model has no tensors");
  if (layout.size() > kMaxTensors) {
    return absl::InvalidArgumentError(
        absl::StrCat("the model has ", layout.size(), " tensors; at most ", kMaxTensors));
  }
  absl::flat_hash_set<std::string> names;
  int64_t total = 0;
  for (const TensorSpec& t : layout) {
    if (t.name.empty()) return absl::InvalidArgumentError("a tensor has an empty name");
    if (!names.insert(t.name).second) {
      return absl::InvalidArgumentError(absl::StrCat("tensor name '", t.name, "' appears twice"));
    }
    if (t.name.size() > kMaxTensorNameLength) {
      return absl::InvalidArgumentError(absl::StrCat(
          "a tensor name is ", t.name.size(), " bytes long; at most ", kMaxTensorNameLength));
    }
    if (t.shape.size() > kMaxTensorRank) {
      return absl::InvalidArgumentError(absl::StrCat("tensor '", t.name, "' has ", t.shape.size(),
                                                     " dimensions; at most ", kMaxTensorRank));
    }
    // Checked products: a peer's shape must not overflow into a small size.
    int64_t elements = 1;
    for (int64_t d : t.shape) {
      if (d <= 0 || d > kMaxModelElements / elements) {
        return absl::InvalidArgumentError(
            absl::StrCat("tensor '", t.name, "' has invalid shape ", t.ShapeString(),
                         " (every dimension > 0, at most ", kMaxModelElements, " elements)"));
      }
      elements *= d;
    }
    total += elements;
    if (total > kMaxModelElements) {
      return absl::InvalidArgumentError(
          absl::StrCat("the model has more than ", kMaxModelElements, " elements"));
    }
  }
  return absl::OkStatus();
}

absl::Status CheckSameLayout(const ModelLayout& expected, const ModelLayout& actual,
                             const std::string& expected_name, const std::string& actual_name) {
  if (expected.size() != actual.size()) {
    return absl::InvalidArgumentError(absl::StrCat(actual_name, " has ", actual.size(),
                                                   " tensors where ", expected_name, " has ",
                                                   expected.size()));
  }
  for (size_t i = 0; i < expected.size(); ++i) {
    if (expected[i].name != actual[i].name) {
      return absl::InvalidArgumentError(absl::StrCat(actual_name, "'s tensor ", i, " is '",
                                                     actual[i].name, "' where ", expected_name,
                                                     "'s is '", expected[i].name, "'"));
    }
    if (expected[i].buffer != actual[i].buffer) {
      return absl::InvalidArgumentError(
          absl::StrCat(actual_name, "'s tensor '", actual[i].name, "' is ",
                       actual[i].buffer ? "a buffer" : "a parameter", " where ", expected_name,
                       "'s is ", expected[i].buffer ? "a buffer" : "a parameter"));
    }
    if (expected[i].shape != actual[i].shape) {
      return absl::InvalidArgumentError(absl::StrCat(
          actual_name, "'s tensor '", actual[i].name, "' has shape ", actual[i].ShapeString(),
          " where ", expected_name, "'s has ", expected[i].ShapeString()));
    }
  }
  return absl::OkStatus();
}

}  // namespace dbs
