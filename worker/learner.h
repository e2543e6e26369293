// Learner: the model side of a worker as plain C++ (no libtorch types), so the training loop can
// run against the real model (TorchLearner) or a fake one in tests.
//
// Sample indices are dataset positions; the loop maps permutation positions to them.
// Not thread-safe: one learner per training loop.
#ifndef DBS_WORKER_LEARNER_H_
#define DBS_WORKER_LEARNER_H_

#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "common/tensor.h"

namespace dbs {

struct EvalResult {
  int64_t samples = 0;
  int64_t correct = 0;
  double loss_sum = 0.0;
  bool classified = true;  // false for real-valued targets: `correct` means nothing
};

class Learner {
 public:
  virtual ~Learner() = default;

  virtual int64_t train_size() const = 0;
  virtual int64_t test_size() const = 0;
  // Where the model runs, e.g. "cpu" or "cuda:0".
  virtual std::string device() const = 0;
  // One line on the data and how it is fed to the model, for the log.
  virtual std::string DescribeData() const { return ""; }
  // Names and shapes of the model's parameters, in the order of the flat buffers below.
  virtual const ModelLayout& layout() const = 0;

  // The model's parameters now (TotalElements(layout()) floats).
  virtual void GetParameters(absl::Span<float> out) = 0;
  // Overwrites the model's parameters.
  virtual void SetParameters(absl::Span<const float> values) = 0;
  // Forward and backward over the training samples `indices` (at least one): writes their mean
  // gradient into `grad` and returns the summed loss. FAILED_PRECONDITION when the model cannot
  // train on this batch (BatchNorm1d on one sample, say), with the model's reason.
  virtual absl::StatusOr<double> ComputeGradient(absl::Span<const int64_t> indices,
                                                 absl::Span<float> grad) = 0;
  // Evaluates test samples [begin, end), which lie within [0, test_size()].
  virtual EvalResult Evaluate(int64_t begin, int64_t end) = 0;
  // Writes the model with its current values where PyTorch loads it.
  virtual absl::Status Export(const std::string& path) {
    return absl::UnimplementedError("this learner cannot export its model");
  }
};

}  // namespace dbs

#endif  // DBS_WORKER_LEARNER_H_
