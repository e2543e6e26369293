#include "worker/model.h"

#include <torch/script.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <functional>
#include <map>
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

// An empty TorchScript module of class `name`, with the `training` flag a module made in
// Python has (PyTorch's eval() and train() set it).
torch::jit::Module NewModule(const std::string& name) {
  torch::jit::Module m(name);
  m.register_attribute("training", c10::BoolType::get(), false);
  return m;
}

// The forward of a built-in as TorchScript: `ScriptModule` gives it submodules named as the
// layers that hold parameters (conv1, fc1, ...), each with its weight and bias.
constexpr char kMlpForward[] = R"(
def forward(self, x):
    x = torch.flatten(x, 1)
    x = torch.relu(torch.linear(x, self.fc1.weight, self.fc1.bias))
    x = torch.relu(torch.linear(x, self.fc2.weight, self.fc2.bias))
    return torch.linear(x, self.fc3.weight, self.fc3.bias)
)";
constexpr char kCnnForward[] = R"(
def forward(self, x):
    x = x.reshape(SHAPE)
    x = torch.max_pool2d(torch.relu(torch.conv2d(x, self.conv1.weight, self.conv1.bias)), [2, 2])
    x = torch.max_pool2d(torch.relu(torch.conv2d(x, self.conv2.weight, self.conv2.bias)), [2, 2])
    x = torch.flatten(x, 1)
    x = torch.relu(torch.linear(x, self.fc1.weight, self.fc1.bias))
    return torch.linear(x, self.fc2.weight, self.fc2.bias)
)";

class BuiltinNet : public Net {
 public:
  // `kind`: "mlp" or "cnn". `input_shape`: [-1, C, H, W] to view a batch as images, empty to
  // take it as it comes.
  BuiltinNet(std::string kind, nn::Sequential model, std::vector<int64_t> input_shape,
             std::string loss)
      : kind_(std::move(kind)),
        model_(std::move(model)),
        input_shape_(std::move(input_shape)),
        loss_(std::move(loss)) {
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

 protected:
  // The same network in TorchScript: a submodule per layer with parameters, named as in the
  // Sequential, so that its state_dict() is the Sequential's (docs/models.md).
  torch::jit::Module ScriptModule() override {
    torch::jit::Module core = NewModule(absl::StrCat("__torch__.dbs.builtin.", kind_));
    std::map<std::string, torch::jit::Module> layers;
    std::vector<std::string> order;
    for (const auto& item : model_->named_parameters()) {
      const std::string& key = item.key();
      const std::string layer = key.substr(0, key.find('.'));
      auto [it, added] = layers.try_emplace(
          layer, NewModule(absl::StrCat("__torch__.dbs.builtin.", kind_, ".", layer)));
      if (added) order.push_back(layer);
      // Trainable, as the module's are, so that the export trains on as --model.
      it->second.register_parameter(
          key.substr(key.find('.') + 1),
          item.value().detach().to(torch::kCPU).clone().requires_grad_(true),
          /*is_buffer=*/false);
    }
    for (const std::string& layer : order) core.register_module(layer, layers.at(layer));
    std::string forward = kind_ == "cnn" ? kCnnForward : kMlpForward;
    const size_t at = forward.find("SHAPE");
    if (at != std::string::npos) {
      forward.replace(at, 5, absl::StrCat("[", absl::StrJoin(input_shape_, ", "), "]"));
    }
    core.define(forward);
    return core;
  }

 private:
  const std::string kind_;
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

 protected:
  // A copy of the module with its current values, on the CPU.
  torch::jit::Module ScriptModule() override {
    torch::jit::Module copy = module_.deepcopy();
    copy.to(torch::kCPU);
    return copy;
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

namespace {

// The export (Net::Export): `core` behind a forward that makes raw inputs what the network was
// trained on, as PrepareInputs does.
torch::jit::Module ExportModule(torch::jit::Module core, const InputTransform& t) {
  torch::jit::Module m = NewModule("__torch__.dbs.Export");
  m.register_module("model", std::move(core));
  const auto as_tensor = [&](const std::vector<double>& v, double none) {
    if (v.empty()) return torch::tensor(none, torch::kFloat32);
    torch::Tensor x = torch::tensor(v, torch::kFloat64).to(torch::kFloat32);
    return v.size() == 1 ? x.reshape({}) : x.reshape(t.shape);
  };
  // Buffers, so that .to(device) moves them with the model.
  m.register_buffer("input_mean", as_tensor(t.mean, 0.0));
  m.register_buffer("input_std", as_tensor(t.std, 1.0));
  m.register_attribute("mean", c10::ListType::ofFloats(), c10::List<double>(t.mean));
  m.register_attribute("std", c10::ListType::ofFloats(), c10::List<double>(t.std));
  m.register_attribute("num_classes", c10::IntType::get(), t.num_classes);
  m.register_attribute(kExportMarker, c10::StringType::get(),
                       std::string("uint8 inputs are scaled to [0, 1], then every input x becomes "
                                   "(x - mean[c]) / std[c] for its channel c (dim 1), then "
                                   "goes through the submodule model"));
  m.define(R"(
def forward(self, x):
    if x.is_floating_point():
        x = x.float()
    else:
        x = x.float() / 255.0
    return self.model.forward((x - self.input_mean) / self.input_std)
)");
  m.eval();
  return m;
}

}  // namespace

absl::Status Net::Export(const std::string& path, const InputTransform& inputs) {
  torch::jit::Module m;
  try {
    m = ExportModule(ScriptModule(), inputs);
  } catch (const std::exception& e) {
    const std::string what = e.what();
    return absl::InternalError(absl::StrCat("cannot make the export of the model: ",
                                            what.substr(0, std::min<size_t>(what.size(), 2000))));
  }
  // Saved through a stream: a file name would be written into the archive, and the same model
  // exported under two names would differ.
  return WriteAtomically(path, [&m](const std::string& tmp) {
    std::ofstream out(tmp, std::ios::binary);
    m.save(out);
    out.close();
    if (!out) throw std::runtime_error("write failed");
  });
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
    return std::make_unique<BuiltinNet>(name,
                                        nn::Sequential({{"flatten", nn::Flatten()},
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
        name,
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
  // A model dbs exported trains as the network inside it (the export's forward would normalise
  // inputs the worker normalises already).
  if (module.hasattr(kExportMarker) && module.hasattr("model")) {
    module = module.attr("model").toModule();
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
    // Images stored channels last ([N, H, W, C], as NumPy and TensorFlow keep them) where the
    // model wants them channels first.
    std::string hint;
    if (inputs.dim() == 4 && (inputs.size(3) == 1 || inputs.size(3) == 3) && inputs.size(1) > 4 &&
        inputs.size(2) > 4) {
      hint = absl::StrCat(". The samples look channels-last ([H, W, C] = [", inputs.size(1), ", ",
                          inputs.size(2), ", ", inputs.size(3),
                          "]); PyTorch models take [C, H, W]: save the array transposed, "
                          "e.g. np.ascontiguousarray(x.transpose(0, 3, 1, 2))");
    }
    return absl::InvalidArgumentError(
        absl::StrCat("the model cannot take the data's inputs (a batch of shape ", shape(inputs),
                     "): ", TorchErrorLine(e.what()), hint));
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
    // Real-valued targets: one value per output. Class labels saved as floats land here.
    std::string hint;
    if (output.dim() == 2 && output.size(0) == n && targets.numel() == n) {
      hint = absl::StrCat(
          ". Float targets are read as real values to regress (one per output); if they are "
          "class labels, save them as integers (e.g. y.astype(np.int64)) and the model's ",
          output.size(1), " outputs are its classes");
    }
    return absl::InvalidArgumentError(absl::StrCat("the model outputs ", shape(output),
                                                   " but the targets of that batch are ",
                                                   shape(targets), hint));
  }
  return absl::OkStatus();
}

}  // namespace dbs
