#include "worker/model.h"

#include <torch/script.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <functional>
#include <utility>

#include "absl/strings/str_cat.h"

namespace dbs {
namespace {

namespace nn = torch::nn;

// Writes `path` through a temporary file (`write` fills it), so a reader never sees half a
// file.
absl::Status WriteAtomically(const std::string& path,
                             const std::function<void(const std::string&)>& write) {
  const std::string tmp = absl::StrCat(path, ".tmp.", getpid());
  try {
    write(tmp);
  } catch (const std::exception& e) {
    std::remove(tmp.c_str());
    return absl::UnavailableError(absl::StrCat("cannot write ", path, ": ", e.what()));
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    std::remove(tmp.c_str());
    return absl::UnavailableError(absl::StrCat("cannot write ", path));
  }
  return absl::OkStatus();
}

class BuiltinNet : public Net {
 public:
  explicit BuiltinNet(nn::Sequential model) : model_(std::move(model)) {
    for (const auto& item : model_->named_parameters()) {
      layout_.push_back(TensorSpec{item.key(), item.value().sizes().vec()});
    }
  }
  std::vector<torch::Tensor> Tensors() override { return model_->parameters(); }
  torch::Tensor Forward(const torch::Tensor& input) override { return model_->forward(input); }
  torch::Tensor Loss(const torch::Tensor& output, const torch::Tensor& target) override {
    return nn::functional::cross_entropy(output, target);
  }
  void SetTraining(bool on) override { model_->train(on); }
  void To(const torch::Device& device) override { model_->to(device); }
  // A dict of name -> tensor that Python's torch.load reads (docs/models.md has the module).
  absl::Status Export(const std::string& path) override {
    c10::Dict<std::string, torch::Tensor> state;
    for (const auto& item : model_->named_parameters()) {
      state.insert(item.key(), item.value().detach().to(torch::kCPU).clone());
    }
    const std::vector<char> bytes = torch::pickle_save(state);
    return WriteAtomically(path, [&bytes](const std::string& tmp) {
      std::ofstream out(tmp, std::ios::binary);
      out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
      out.close();
      if (!out) throw std::runtime_error("write failed");
    });
  }

 private:
  nn::Sequential model_;
};

class ScriptNet : public Net {
 public:
  ScriptNet(torch::jit::Module module, std::string loss)
      : module_(std::move(module)), loss_(std::move(loss)) {
    for (const auto& p : module_.named_parameters(/*recurse=*/true)) {
      if (!p.value.requires_grad()) continue;
      layout_.push_back(TensorSpec{p.name, p.value.sizes().vec()});
      tensors_.push_back(p.value);
    }
    for (const auto& b : module_.named_buffers(/*recurse=*/true)) {
      // Integer buffers (BatchNorm's num_batches_tracked) stay each worker's own.
      if (!b.value.is_floating_point()) continue;
      layout_.push_back(TensorSpec{b.name, b.value.sizes().vec(), /*buffer=*/true});
      tensors_.push_back(b.value);
    }
  }
  std::vector<torch::Tensor> Tensors() override { return tensors_; }
  torch::Tensor Forward(const torch::Tensor& input) override {
    return module_.forward({input}).toTensor();
  }
  torch::Tensor Loss(const torch::Tensor& output, const torch::Tensor& target) override {
    if (loss_ == "module") return module_.run_method("loss", output, target).toTensor();
    if (loss_ == "mse") return nn::functional::mse_loss(output, target);
    if (loss_ == "nll") return nn::functional::nll_loss(output, target);
    return nn::functional::cross_entropy(output, target);
  }
  void SetTraining(bool on) override { module_.train(on); }
  void To(const torch::Device& device) override {
    module_.to(device);
    // Moving replaced the tensors; take them again, in the same order.
    std::vector<torch::Tensor> moved;
    for (const auto& p : module_.named_parameters(true)) {
      if (p.value.requires_grad()) moved.push_back(p.value);
    }
    for (const auto& b : module_.named_buffers(true)) {
      if (b.value.is_floating_point()) moved.push_back(b.value);
    }
    tensors_ = std::move(moved);
  }
  // The same module with the current values: torch.jit.load reads it.
  absl::Status Export(const std::string& path) override {
    return WriteAtomically(path, [this](const std::string& tmp) { module_.save(tmp); });
  }

 private:
  torch::jit::Module module_;
  const std::string loss_;
  std::vector<torch::Tensor> tensors_;
};

void CopyInto(const torch::Tensor& t, float* out) {
  torch::Tensor cpu = t.detach().to(torch::kCPU, torch::kFloat32).contiguous();
  std::memcpy(out, cpu.data_ptr<float>(), cpu.numel() * sizeof(float));
}

}  // namespace

std::vector<torch::Tensor> Net::Parameters() {
  std::vector<torch::Tensor> all = Tensors();
  std::vector<torch::Tensor> params;
  for (size_t i = 0; i < all.size(); ++i) {
    if (!layout_[i].buffer) params.push_back(all[i]);
  }
  return params;
}

absl::StatusOr<std::unique_ptr<Net>> MakeBuiltinNet(const std::string& name) {
  if (name == "mlp") {
    return std::make_unique<BuiltinNet>(nn::Sequential({{"flatten", nn::Flatten()},
                                                        {"fc1", nn::Linear(784, 256)},
                                                        {"relu1", nn::ReLU()},
                                                        {"fc2", nn::Linear(256, 128)},
                                                        {"relu2", nn::ReLU()},
                                                        {"fc3", nn::Linear(128, 10)}}));
  }
  if (name == "cnn") {
    return std::make_unique<BuiltinNet>(
        nn::Sequential({{"conv1", nn::Conv2d(nn::Conv2dOptions(1, 16, 5))},
                        {"relu1", nn::ReLU()},
                        {"pool1", nn::MaxPool2d(2)},
                        {"conv2", nn::Conv2d(nn::Conv2dOptions(16, 32, 5))},
                        {"relu2", nn::ReLU()},
                        {"pool2", nn::MaxPool2d(2)},
                        {"flatten", nn::Flatten()},
                        {"fc1", nn::Linear(32 * 4 * 4, 64)},
                        {"relu3", nn::ReLU()},
                        {"fc2", nn::Linear(64, 10)}}));
  }
  return absl::InvalidArgumentError(
      absl::StrCat("unknown model '", name, "'; use mlp, cnn or the path of a TorchScript file"));
}

absl::StatusOr<std::unique_ptr<Net>> LoadScriptNet(const std::string& path,
                                                   const std::string& loss) {
  if (loss != "auto" && loss != "cross_entropy" && loss != "nll" && loss != "mse") {
    return absl::InvalidArgumentError(
        absl::StrCat("unknown loss '", loss, "'; use auto, cross_entropy, nll or mse"));
  }
  torch::jit::Module module;
  try {
    module = torch::jit::load(path);
  } catch (const std::exception& e) {
    std::string what = e.what();
    what = what.substr(0, what.find('\n'));
    return absl::InvalidArgumentError(absl::StrCat("cannot load the TorchScript model ", path,
                                                   " (save it from Python with "
                                                   "torch.jit.script(model).save(path)): ",
                                                   what));
  }
  std::string chosen = loss;
  if (loss == "auto") chosen = module.find_method("loss").has_value() ? "module" : "cross_entropy";
  auto net = std::make_unique<ScriptNet>(std::move(module), chosen);
  if (net->layout().empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("the TorchScript model ", path, " has no parameter that requires grad"));
  }
  return net;
}

void CopyParametersTo(Net& net, absl::Span<float> out) {
  size_t offset = 0;
  for (const torch::Tensor& t : net.Tensors()) {
    CopyInto(t, out.data() + offset);
    offset += static_cast<size_t>(t.numel());
  }
}

void LoadParameters(Net& net, absl::Span<const float> values) {
  torch::NoGradGuard no_grad;
  size_t offset = 0;
  for (torch::Tensor& t : net.Tensors()) {
    torch::Tensor src =
        torch::from_blob(const_cast<float*>(values.data() + offset), t.sizes(), torch::kFloat32);
    t.copy_(src);
    offset += static_cast<size_t>(t.numel());
  }
}

double ComputeGradient(Net& net, const torch::Tensor& inputs, const torch::Tensor& targets,
                       absl::Span<float> out) {
  net.SetTraining(true);
  const std::vector<torch::Tensor> tensors = net.Tensors();
  for (const torch::Tensor& t : tensors) {
    if (t.grad().defined()) t.mutable_grad().zero_();
  }
  torch::Tensor loss = net.Loss(net.Forward(inputs), targets);
  loss.backward();
  size_t offset = 0;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const torch::Tensor& t = tensors[i];
    if (net.layout()[i].buffer) {
      CopyInto(t, out.data() + offset);  // its value after this step's forward
    } else if (t.grad().defined()) {
      CopyInto(t.grad(), out.data() + offset);
    } else {  // not reached by this loss: a zero gradient
      std::fill(out.begin() + offset, out.begin() + offset + t.numel(), 0.0f);
    }
    offset += static_cast<size_t>(t.numel());
  }
  return loss.item<double>() * static_cast<double>(inputs.size(0));
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

EvalResult Evaluate(Net& net, const torch::Tensor& inputs, const torch::Tensor& targets,
                    int64_t begin, int64_t end) {
  torch::NoGradGuard no_grad;
  net.SetTraining(false);
  EvalResult r;
  constexpr int64_t kChunk = 1000;
  const bool labels = targets.scalar_type() == torch::kInt64;
  for (int64_t b = begin; b < end; b += kChunk) {
    const int64_t e = std::min(end, b + kChunk);
    torch::Tensor output = net.Forward(inputs.slice(0, b, e));
    torch::Tensor y = targets.slice(0, b, e);
    r.loss_sum += net.Loss(output, y).item<double>() * static_cast<double>(e - b);
    if (labels) r.correct += output.argmax(1).eq(y).sum().item<int64_t>();
    r.samples += e - b;
  }
  return r;
}

}  // namespace dbs
