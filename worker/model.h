// The models dbs_worker trains, and the bridge between libtorch modules and the flat float
// buffers the parameter server exchanges. This is the only header that includes libtorch.
#ifndef DBS_WORKER_MODEL_H_
#define DBS_WORKER_MODEL_H_

#include <torch/torch.h>

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "common/tensor.h"
#include "worker/fashion_mnist.h"
#include "worker/learner.h"

namespace dbs {

// "mlp" (784-256-128-10) or "cnn" (two 5x5 conv layers with max-pooling, then 512-64-10), with
// named layers so parameter names read "conv1.weight". INVALID_ARGUMENT for another name.
absl::StatusOr<torch::nn::Sequential> MakeModel(const std::string& name);

// Names and shapes of the model's parameters, in registration order.
ModelLayout ModelLayoutOf(torch::nn::Sequential& model);

// Copies all parameters into `out` (TotalElements(layout) floats), in layout order.
void CopyParametersTo(torch::nn::Sequential& model, absl::Span<float> out);

// Overwrites the parameters with `values` (flat, layout order).
void LoadParameters(torch::nn::Sequential& model, absl::Span<const float> values);

// Forward and backward on one batch with mean cross-entropy; writes the mean gradient (flat,
// layout order) into `grad` and returns the summed loss over the batch.
double ComputeGradient(torch::nn::Sequential& model, const torch::Tensor& images,
                       const torch::Tensor& labels, absl::Span<float> grad);

// Images as a float tensor [N, 1, rows, cols], scaled to [0, 1] and normalised with the
// Fashion-MNIST mean and standard deviation; labels as int64 [N].
torch::Tensor ImagesTensor(const ImageDataset& data);
torch::Tensor LabelsTensor(const ImageDataset& data);

// Evaluates rows [begin, end) of (images, labels) in chunks, without gradients.
EvalResult Evaluate(torch::nn::Sequential& model, const torch::Tensor& images,
                    const torch::Tensor& labels, int64_t begin, int64_t end);

}  // namespace dbs

#endif  // DBS_WORKER_MODEL_H_
