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
#include "absl/strings/str_join.h"

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

// `kind`: "cross_entropy", "nll", "mse", or "by_target" (mse for real-valued targets, else
// cross-entropy). mse compares values, so an output of the target's size is viewed in its shape
// ([B, 1] against [B]).
torch::Tensor LossOf(const std::string& kind, const torch::Tensor& output,
                     const torch::Tensor& target) {
  if (kind == "mse" || (kind == "by_target" && target.is_floating_point())) {
    const bool same = output.sizes() == target.sizes() || output.numel() != target.numel();
    return nn::functional::mse_loss(same ? output : output.reshape(target.sizes()), target);
  }
  if (kind == "nll") return nn::functional::nll_loss(output, target);
  return nn::functional::cross_entropy(output, target);
}

std::string ChosenLoss(const std::string& loss) { return loss == "auto" ? "by_target" : loss; }

class BuiltinNet : public Net {
 public:
  // `input_shape`: [-1, C, H, W] to view a batch as images, empty to take it as it comes.
  BuiltinNet(nn::Sequential model, std::vector<int64_t> input_shape, std::string loss)
      : model_(std::move(model)), input_shape_(std::move(input_shape)), loss_(std::move(loss)) {
    for (const auto& item : model_->named_parameters()) {
      layout_.push_back(TensorSpec{item.key(), item.value().sizes().vec()});
    }
  }
  std::vector<torch::Tensor> Tensors() override { return model_->parameters(); }
  torch::Tensor Forward(const torch::Tensor& input) override {
    return model_->forward(input_shape_.empty() ? input : input.reshape(input_shape_));
  }
  torch::Tensor Loss(const torch::Tensor& output, const torch::Tensor& target) override {
    return LossOf(loss_, output, target);
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
  const std::vector<int64_t> input_shape_;
  const std::string loss_;
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
    return LossOf(loss_, output, target);
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

std::string TorchErrorLine(const std::string& what) {
  const size_t at = what.rfind("Error: ");
  if (at != std::string::npos) {
    const size_t begin = what.rfind('\n', at);
    const std::string line = what.substr(begin == std::string::npos ? 0 : begin + 1);
    return line.substr(0, line.find('\n'));
  }
  return what.substr(0, what.find('\n'));
}

std::vector<torch::Tensor> Net::Parameters() {
  std::vector<torch::Tensor> all = Tensors();
  std::vector<torch::Tensor> params;
  for (size_t i = 0; i < all.size(); ++i) {
    if (!layout_[i].buffer) params.push_back(all[i]);
  }
  return params;
}

absl::StatusOr<std::unique_ptr<Net>> MakeBuiltinNet(const std::string& name,
                                                    const std::vector<int64_t>& row_shape,
                                                    int64_t outputs, const std::string& loss) {
  if (loss != "auto" && loss != "cross_entropy" && loss != "mse") {
    return absl::InvalidArgumentError(absl::StrCat("--loss=", loss, " does not suit the built-in ",
                                                   name, "; use auto, cross_entropy or mse"));
  }
  if (outputs < 1) return absl::InvalidArgumentError("the model needs at least one output");
  int64_t features = 1;
  for (int64_t d : row_shape) features *= d;
  if (name == "mlp") {
    return std::make_unique<BuiltinNet>(nn::Sequential({{"flatten", nn::Flatten()},
                                                        {"fc1", nn::Linear(features, 256)},
                                                        {"relu1", nn::ReLU()},
                                                        {"fc2", nn::Linear(256, 128)},
                                                        {"relu2", nn::ReLU()},
                                                        {"fc3", nn::Linear(128, outputs)}}),
                                        std::vector<int64_t>{}, ChosenLoss(loss));
  }
  if (name == "cnn") {
    const bool image = row_shape.size() == 3 || row_shape.size() == 2;
    const int64_t c = row_shape.size() == 3 ? row_shape[0] : 1;
    const int64_t h = image ? row_shape[row_shape.size() - 2] : 0;
    const int64_t w = image ? row_shape.back() : 0;
    if (!image || h < 16 || w < 16 || c < 1) {
      return absl::InvalidArgumentError(absl::StrCat(
          "the built-in cnn takes image samples [C, H, W] or [H, W] of at least 16x16; these are [",
          absl::StrJoin(row_shape, ", "), "] (use --model=mlp or a TorchScript model)"));
    }
    // Two valid 5x5 convolutions, each followed by 2x2 max-pooling.
    const int64_t fh = ((h - 4) / 2 - 4) / 2, fw = ((w - 4) / 2 - 4) / 2;
    return std::make_unique<BuiltinNet>(
        nn::Sequential({{"conv1", nn::Conv2d(nn::Conv2dOptions(c, 16, 5))},
                        {"relu1", nn::ReLU()},
                        {"pool1", nn::MaxPool2d(2)},
                        {"conv2", nn::Conv2d(nn::Conv2dOptions(16, 32, 5))},
                        {"relu2", nn::ReLU()},
                        {"pool2", nn::MaxPool2d(2)},
                        {"flatten", nn::Flatten()},
                        {"fc1", nn::Linear(32 * fh * fw, 64)},
                        {"relu3", nn::ReLU()},
                        {"fc2", nn::Linear(64, outputs)}}),
        std::vector<int64_t>{-1, c, h, w}, ChosenLoss(loss));
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
  if (loss == "auto") chosen = module.find_method("loss").has_value() ? "module" : "by_target";
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
    const size_t n = static_cast<size_t>(t.numel());
    if (t.device().is_cpu() && t.scalar_type() == torch::kFloat32 && t.is_contiguous()) {
      // Straight into the tensor's memory: Tensor::copy_ costs ~8,000 instructions a tensor in
      // dispatch and TensorIterator set-up, more than the CNN's smaller tensors' bytes. The
      // version counter is bumped as copy_ would.
      if (n > 0) std::memcpy(t.data_ptr<float>(), values.data() + offset, n * sizeof(float));
      t.unsafeGetTensorImpl()->bump_version();
    } else {
      t.copy_(
          torch::from_blob(const_cast<float*>(values.data() + offset), t.sizes(), torch::kFloat32));
    }
    offset += n;
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

torch::Tensor ArrayTensor(const Array& array) {
  torch::ScalarType type = torch::kFloat32;
  switch (array.dtype()) {
    case DType::kUint8:
      type = torch::kUInt8;
      break;
    case DType::kInt64:
      type = torch::kInt64;
      break;
    case DType::kFloat32:
      type = torch::kFloat32;
      break;
    default:
      throw std::invalid_argument("ArrayTensor: unconverted element type");
  }
  return torch::from_blob(const_cast<void*>(array.data()), array.shape(), type);
}

torch::Tensor PrepareInputs(const torch::Tensor& raw, const Normalization& norm,
                            const torch::Tensor& mean, const torch::Tensor& std) {
  torch::Tensor x = raw.to(torch::kFloat32);
  if (raw.scalar_type() == torch::kUInt8) x = x.div(255.0);
  if (norm.mean.size() == 1) return (x - norm.mean[0]) / norm.std[0];
  if (norm.mean.empty()) return x;
  return (x - mean) / std;
}

void EvaluateBatch(Net& net, const torch::Tensor& inputs, const torch::Tensor& targets,
                   EvalResult* result) {
  torch::NoGradGuard no_grad;
  net.SetTraining(false);
  const int64_t n = inputs.size(0);
  torch::Tensor output = net.Forward(inputs);
  result->loss_sum += net.Loss(output, targets).item<double>() * static_cast<double>(n);
  result->classified = targets.scalar_type() == torch::kInt64;
  if (result->classified) result->correct += output.argmax(1).eq(targets).sum().item<int64_t>();
  result->samples += n;
}

absl::Status CheckModelFitsData(Net& net, const torch::Tensor& inputs, const torch::Tensor& targets,
                                int64_t num_classes) {
  torch::NoGradGuard no_grad;
  net.SetTraining(false);
  const auto shape = [](const torch::Tensor& t) {
    return absl::StrCat("[", absl::StrJoin(t.sizes(), ", "), "]");
  };
  torch::Tensor output;
  try {
    output = net.Forward(inputs);
  } catch (const std::exception& e) {
    return absl::InvalidArgumentError(
        absl::StrCat("the model cannot take the data's inputs (a batch of shape ", shape(inputs),
                     "): ", TorchErrorLine(e.what())));
  }
  const int64_t n = inputs.size(0);
  if (num_classes > 0) {
    if (output.dim() != 2 || output.size(0) != n) {
      return absl::InvalidArgumentError(absl::StrCat("the model outputs ", shape(output),
                                                     " for a batch of ", n,
                                                     "; class labels need [batch, classes]"));
    }
    if (output.size(1) < num_classes) {
      return absl::InvalidArgumentError(
          absl::StrCat("the data's labels go up to ", num_classes - 1, " (", num_classes,
                       " classes) but the model gives ", output.size(1), " outputs per sample"));
    }
  } else if (output.numel() != targets.numel()) {
    return absl::InvalidArgumentError(absl::StrCat("the model outputs ", shape(output),
                                                   " but the targets of that batch are ",
                                                   shape(targets)));
  }
  return absl::OkStatus();
}

}  // namespace dbs
