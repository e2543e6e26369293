// The networks dbs_worker trains, and the bridge between libtorch and the flat float buffers
// the parameter server exchanges. This is the only header that includes libtorch.
//
// A Net is either a built-in (--model=cnn|mlp) or a TorchScript module saved from Python
// (--model=PATH.pt). Its layout lists the trained parameters (those that require grad), then
// its floating-point buffers (BatchNorm's running statistics) marked as buffers: a worker
// pushes their values after each step, and the server sets them to the sample-weighted mean
// of the pushed values, so every worker holds the same buffers (docs/models.md).
#ifndef DBS_WORKER_MODEL_H_
#define DBS_WORKER_MODEL_H_

#include <torch/torch.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "common/tensor.h"
#include "worker/fashion_mnist.h"
#include "worker/learner.h"

namespace dbs {

class Net {
 public:
  virtual ~Net() = default;
  // Parameters, then buffers (TensorSpec::buffer), in the order of Tensors().
  const ModelLayout& layout() const { return layout_; }
  // The live tensors of layout(), in order.
  virtual std::vector<torch::Tensor> Tensors() = 0;
  virtual torch::Tensor Forward(const torch::Tensor& input) = 0;
  // The batch's mean loss.
  virtual torch::Tensor Loss(const torch::Tensor& output, const torch::Tensor& target) = 0;
  virtual void SetTraining(bool on) = 0;
  virtual void To(const torch::Device& device) = 0;
  // Writes the network with its current values where PyTorch loads it (docs/models.md).
  virtual absl::Status Export(const std::string& path) = 0;

  // The trained parameters (the first entries of Tensors()).
  std::vector<torch::Tensor> Parameters();

 protected:
  ModelLayout layout_;
};

// "mlp" (784-256-128-10) or "cnn" (two 5x5 conv layers with max-pooling, then 512-64-10), with
// named layers so parameter names read "conv1.weight"; cross-entropy loss. INVALID_ARGUMENT for
// another name.
absl::StatusOr<std::unique_ptr<Net>> MakeBuiltinNet(const std::string& name);

// A TorchScript module saved from Python (torch.jit.script or torch.jit.trace, then .save).
// `loss`: "cross_entropy", "nll", "mse", or "auto" (the module's own `loss(output, target)`
// method when it has one, else cross-entropy). Errors name the file and what is wrong.
absl::StatusOr<std::unique_ptr<Net>> LoadScriptNet(const std::string& path,
                                                   const std::string& loss);

// Copies every tensor of the layout into `out` (TotalElements(layout) floats).
void CopyParametersTo(Net& net, absl::Span<float> out);

// Overwrites every tensor of the layout with `values` (flat, layout order).
void LoadParameters(Net& net, absl::Span<const float> values);

// Forward and backward on one batch (training mode): writes the mean gradient of each parameter
// and the value of each buffer after the step (flat, layout order) into `out` and returns the
// summed loss over the batch.
double ComputeGradient(Net& net, const torch::Tensor& inputs, const torch::Tensor& targets,
                       absl::Span<float> out);

// Images as a float tensor [N, 1, rows, cols], scaled to [0, 1] and normalised with the
// Fashion-MNIST mean and standard deviation; labels as int64 [N].
torch::Tensor ImagesTensor(const ImageDataset& data);
torch::Tensor LabelsTensor(const ImageDataset& data);

// Evaluates rows [begin, end) in chunks, in evaluation mode, without gradients. `correct`
// counts argmax hits when the targets are class labels (int64).
EvalResult Evaluate(Net& net, const torch::Tensor& inputs, const torch::Tensor& targets,
                    int64_t begin, int64_t end);

}  // namespace dbs

#endif  // DBS_WORKER_MODEL_H_
