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

#include <torch/script.h>
#include <torch/torch.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "common/tensor.h"
#include "worker/dataset.h"
#include "worker/learner.h"

namespace dbs {

// What the worker makes of the data's inputs before the network sees them (PrepareInputs), kept
// in an export so that it takes inputs as the data set holds them.
struct InputTransform {
  std::vector<double> mean, std;  // per channel (one: every value); empty: no standardisation
  std::vector<int64_t> shape;     // mean and std's shape against a batch (dim 1 onwards)
  int64_t num_classes = 0;        // class labels in [0, num_classes); 0: real-valued targets
};

// The name of the string attribute an export carries (what it does to its inputs), by which
// LoadScriptNet knows one and trains the network inside it.
inline constexpr char kExportMarker[] = "dbs_input_transform";

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
  // Writes a TorchScript module that torch.jit.load reads (docs/models.md#trained-weights-out):
  // the network with its current values (submodule `model`), in evaluation mode, behind a
  // forward that applies `inputs` first, so it takes raw inputs (bytes or floats as the data
  // set holds them); attributes `mean`, `std` and `num_classes`.
  absl::Status Export(const std::string& path, const InputTransform& inputs);

  // The trained parameters (the first entries of Tensors()).
  std::vector<torch::Tensor> Parameters();

 protected:
  // The network as a TorchScript module of its own, holding copies of its current values.
  virtual torch::jit::Module ScriptModule() = 0;

  ModelLayout layout_;
};

// "mlp" (inputs flattened, then 256-128-outputs) or "cnn" (two 5x5 conv layers with
// max-pooling, then 64-outputs; image samples [C, H, W] or [H, W] of at least 16x16), with named
// layers so parameter names read "conv1.weight". `row_shape` is one sample's input shape;
// `outputs` the number of classes, or of target values. `loss` as for LoadScriptNet, without
// "nll". INVALID_ARGUMENT for another name or a shape the network cannot take. The defaults are
// Fashion-MNIST's.
absl::StatusOr<std::unique_ptr<Net>> MakeBuiltinNet(
    const std::string& name, const std::vector<int64_t>& row_shape = {1, 28, 28},
    int64_t outputs = 10, const std::string& loss = "auto");

// A TorchScript module saved from Python (torch.jit.script or torch.jit.trace, then .save).
// `loss`: "cross_entropy", "nll", "mse", or "auto" (the module's own `loss(output, target)`
// method when it has one, else cross-entropy for class labels and mse for real-valued targets).
// Errors name the file and what is wrong.
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

// The line of a libtorch error that says what went wrong: a TorchScript error puts the Python
// exception ("RuntimeError: ...") after a traceback; a plain one says it first.
std::string TorchErrorLine(const std::string& what);

// A CPU tensor viewing `array`'s storage (no copy; `array` must outlive it).
torch::Tensor ArrayTensor(const Array& array);

// Inputs ready for the network: float32, bytes scaled to [0, 1], standardised per channel
// (dim 1) by `norm`. `mean` and `std` are norm's figures as tensors shaped to broadcast (unused
// with one channel, where the scalars are applied as they always were).
torch::Tensor PrepareInputs(const torch::Tensor& raw, const Normalization& norm,
                            const torch::Tensor& mean, const torch::Tensor& std);

// Adds one batch's evaluation (evaluation mode, no gradients) to `result`: `correct` counts
// argmax hits when the targets are class labels (int64).
void EvaluateBatch(Net& net, const torch::Tensor& inputs, const torch::Tensor& targets,
                   EvalResult* result);

// Checks on a couple of samples that `net` takes `data`'s inputs and that its outputs fit the
// targets: as many classes as the labels need, or as many values as each target has.
// INVALID_ARGUMENT names the mismatch.
absl::Status CheckModelFitsData(Net& net, const torch::Tensor& inputs, const torch::Tensor& targets,
                                int64_t num_classes);

}  // namespace dbs

#endif  // DBS_WORKER_MODEL_H_
