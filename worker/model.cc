#include "worker/model.h"

#include <cstring>

#include "absl/strings/str_cat.h"

namespace dbs {
namespace nn = torch::nn;

absl::StatusOr<nn::Sequential> MakeModel(const std::string& name) {
  if (name == "mlp") {
    return nn::Sequential({{"flatten", nn::Flatten()},
                           {"fc1", nn::Linear(784, 256)},
                           {"relu1", nn::ReLU()},
                           {"fc2", nn::Linear(256, 128)},
                           {"relu2", nn::ReLU()},
                           {"fc3", nn::Linear(128, 10)}});
  }
  if (name == "cnn") {
    return nn::Sequential({{"conv1", nn::Conv2d(nn::Conv2dOptions(1, 16, 5))},
                           {"relu1", nn::ReLU()},
                           {"pool1", nn::MaxPool2d(2)},
                           {"conv2", nn::Conv2d(nn::Conv2dOptions(16, 32, 5))},
                           {"relu2", nn::ReLU()},
                           {"pool2", nn::MaxPool2d(2)},
                           {"flatten", nn::Flatten()},
                           {"fc1", nn::Linear(32 * 4 * 4, 64)},
                           {"relu3", nn::ReLU()},
                           {"fc2", nn::Linear(64, 10)}});
  }
  return absl::InvalidArgumentError(absl::StrCat("unknown model '", name, "'; use mlp or cnn"));
}

ModelLayout ModelLayoutOf(nn::Sequential& model) {
  ModelLayout layout;
  for (const auto& item : model->named_parameters()) {
    layout.push_back(TensorSpec{item.key(), item.value().sizes().vec()});
  }
  return layout;
}

void CopyParametersTo(nn::Sequential& model, absl::Span<float> out) {
  size_t offset = 0;
  for (const torch::Tensor& p : model->parameters()) {
    torch::Tensor cpu = p.detach().to(torch::kCPU).contiguous();
    std::memcpy(out.data() + offset, cpu.data_ptr<float>(), cpu.numel() * sizeof(float));
    offset += cpu.numel();
  }
}

void LoadParameters(nn::Sequential& model, absl::Span<const float> values) {
  torch::NoGradGuard no_grad;
  size_t offset = 0;
  for (torch::Tensor& p : model->parameters()) {
    const int64_t n = p.numel();
    torch::Tensor src =
        torch::from_blob(const_cast<float*>(values.data() + offset), p.sizes(), torch::kFloat32);
    p.copy_(src);
    offset += n;
  }
}

double ComputeGradient(nn::Sequential& model, const torch::Tensor& images,
                       const torch::Tensor& labels, absl::Span<float> grad) {
  model->zero_grad();
  torch::Tensor logits = model->forward(images);
  torch::Tensor loss = torch::nn::functional::cross_entropy(logits, labels);
  loss.backward();
  size_t offset = 0;
  for (const torch::Tensor& p : model->parameters()) {
    torch::Tensor g = p.grad().to(torch::kCPU).contiguous();
    std::memcpy(grad.data() + offset, g.data_ptr<float>(), g.numel() * sizeof(float));
    offset += g.numel();
  }
  return loss.item<double>() * static_cast<double>(images.size(0));
}

torch::Tensor ImagesTensor(const ImageDataset& data) {
  constexpr double kMean = 0.2860, kStd = 0.3530;  // Fashion-MNIST training set statistics
  torch::Tensor bytes = torch::from_blob(const_cast<uint8_t*>(data.images.data()),
                                         {data.size, 1, data.rows, data.cols}, torch::kUInt8);
  return (bytes.to(torch::kFloat32).div(255.0) - kMean) / kStd;
}

torch::Tensor LabelsTensor(const ImageDataset& data) {
  return torch::from_blob(const_cast<uint8_t*>(data.labels.data()), {data.size}, torch::kUInt8)
      .to(torch::kInt64);
}

EvalResult Evaluate(nn::Sequential& model, const torch::Tensor& images, const torch::Tensor& labels,
                    int64_t begin, int64_t end) {
  torch::NoGradGuard no_grad;
  EvalResult r;
  constexpr int64_t kChunk = 1000;
  for (int64_t b = begin; b < end; b += kChunk) {
    const int64_t e = std::min(end, b + kChunk);
    torch::Tensor logits = model->forward(images.slice(0, b, e));
    torch::Tensor y = labels.slice(0, b, e);
    r.loss_sum +=
        torch::nn::functional::cross_entropy(
            logits, y, torch::nn::functional::CrossEntropyFuncOptions().reduction(torch::kSum))
            .item<double>();
    r.correct += logits.argmax(1).eq(y).sum().item<int64_t>();
    r.samples += e - b;
  }
  return r;
}

}  // namespace dbs
