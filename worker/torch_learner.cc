#include "worker/torch_learner.h"

#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "common/status_macros.h"
#include "worker/dataset.h"
#include "worker/model.h"

namespace dbs {
namespace {

absl::StatusOr<torch::Device> ChooseDevice(const std::string& want) {
  const bool cuda = torch::cuda::is_available();
  if (want == "cpu") return torch::Device(torch::kCPU);
  if (want == "auto") return cuda ? torch::Device(torch::kCUDA, 0) : torch::Device(torch::kCPU);
  if (want == "cuda") {
    if (!cuda) {
      return absl::FailedPreconditionError(
          "--device=cuda, but no CUDA device is usable: either this machine has no GPU or "
          "dbs_worker was built against a CPU-only libtorch (Debian's is). Rebuild with "
          "LIBTORCH_DIR pointing at a CUDA libtorch, or use --device=cpu.");
    }
    return torch::Device(torch::kCUDA, 0);
  }
  return absl::InvalidArgumentError(
      absl::StrCat("unknown device '", want, "'; use auto, cpu or cuda"));
}

// Reads `n` little-endian float32 values written in layout order (e.g. by bench/ddp_baseline.py).
absl::Status ReadRawParams(const std::string& path, absl::Span<float> out) {
  FILE* f = std::fopen(path.c_str(), "rb");
  if (f == nullptr)
    return absl::NotFoundError(absl::StrCat("cannot open the initial parameters ", path));
  const size_t got = std::fread(out.data(), sizeof(float), out.size(), f);
  const bool trailing = std::fgetc(f) != EOF;
  std::fclose(f);
  if (got != out.size() || trailing) {
    return absl::InvalidArgumentError(absl::StrCat(path, " does not hold exactly ", out.size(),
                                                   " float32 values for this model"));
  }
  return absl::OkStatus();
}

// The inputs stay in their stored type (bytes of an image set, or a memory-mapped file); each
// batch is gathered and only then made float and standardised. Bytes go through a table of the
// 256 values each channel can take, computed once with PrepareInputs' own ops, so a batch costs
// one pass and no libtorch call however small it is (a slow worker's batch may be 1 sample).
class TorchLearner : public Learner {
 public:
  TorchLearner(torch::Device device, std::unique_ptr<Net> net, Data data, Normalization norm)
      : device_(device),
        net_(std::move(net)),
        data_(std::move(data)),
        norm_(std::move(norm)),
        train_x_(ArrayTensor(data_.train.inputs)),
        train_y_(ArrayTensor(data_.train.targets)),
        test_x_(ArrayTensor(data_.test.inputs)),
        test_y_(ArrayTensor(data_.test.targets)) {
    net_->To(device_);
    torch::Tensor mean, std;  // on the CPU
    const int64_t rank = static_cast<int64_t>(data_.train.inputs.shape().size());
    inputs_.mean = norm_.mean;
    inputs_.std = norm_.std;
    inputs_.num_classes = data_.num_classes;
    if (norm_.mean.size() > 1) {
      // Shaped to broadcast over dim 1 of a batch: [C] for vectors, [C, 1, ...] for images.
      std::vector<int64_t> shape(std::max<int64_t>(rank - 1, 1), 1);
      shape[0] = static_cast<int64_t>(norm_.mean.size());
      inputs_.shape = shape;
      const auto as_tensor = [&](const std::vector<double>& v) {
        return torch::tensor(v, torch::kFloat64).to(torch::kFloat32).reshape(shape);
      };
      mean = as_tensor(norm_.mean);
      std = as_tensor(norm_.std);
      mean_ = mean.to(device_);
      std_ = std.to(device_);
    }
    if (data_.train.inputs.dtype() == DType::kUint8) {
      // table_[c * 256 + b]: what PrepareInputs makes of byte b in channel c.
      channels_ = std::max<int64_t>(static_cast<int64_t>(norm_.mean.size()), 1);
      std::vector<int64_t> shape(std::max<int64_t>(rank, 2), 1);
      shape[0] = 256;
      shape[1] = channels_;
      const torch::Tensor bytes = torch::arange(256, torch::kInt64)
                                      .to(torch::kUInt8)
                                      .reshape({256, 1})
                                      .expand({256, channels_});
      const torch::Tensor values =
          PrepareInputs(bytes.reshape(shape).contiguous(), norm_, mean, std)
              .reshape({256, channels_})
              .t()
              .contiguous();
      table_.assign(values.data_ptr<float>(), values.data_ptr<float>() + 256 * channels_);
    }
  }

  int64_t train_size() const override { return train_x_.size(0); }
  int64_t test_size() const override { return test_x_.size(0); }
  std::string device() const override { return device_.str(); }
  const ModelLayout& layout() const override { return net_->layout(); }

  std::string DescribeData() const override {
    const Array& x = data_.train.inputs;
    std::string norm = "none";
    if (!norm_.mean.empty()) {
      norm = absl::StrFormat("%s mean [%s] std [%s]", norm_.source,
                             absl::StrJoin(norm_.mean, ", ", FourDigits),
                             absl::StrJoin(norm_.std, ", ", FourDigits));
    }
    return absl::StrCat(
        "data ", data_.spec, ": ", train_size(), " training and ", test_size(), " test samples of ",
        DTypeName(x.dtype()), " [", absl::StrJoin(x.row_shape(), ", "), "], ",
        data_.num_classes > 0
            ? absl::StrCat(data_.num_classes, " classes")
            : absl::StrCat("real-valued targets [",
                           absl::StrJoin(data_.train.targets.row_shape(), ", "), "]"),
        "; normalisation: ", norm);
  }

  void GetParameters(absl::Span<float> out) override { CopyParametersTo(*net_, out); }
  void SetParameters(absl::Span<const float> values) override { LoadParameters(*net_, values); }

  absl::StatusOr<double> ComputeGradient(absl::Span<const int64_t> indices,
                                         absl::Span<float> grad) override {
    const torch::Tensor idx =
        torch::from_blob(const_cast<int64_t*>(indices.data()),
                         {static_cast<int64_t>(indices.size())}, torch::kInt64);
    try {
      return dbs::ComputeGradient(*net_, Inputs(data_.train.inputs, train_x_, indices, 0),
                                  train_y_.index_select(0, idx).to(device_), grad);
    } catch (const std::exception& e) {
      return absl::FailedPreconditionError(absl::StrCat(
          "the model failed on a batch of ", indices.size(), ": ", TorchErrorLine(e.what()),
          indices.size() == 1 ? " (a BatchNorm model cannot train on one sample: start dbs_ps "
                                "with --min_batch=2 or more)"
                              : ""));
    }
  }

  EvalResult Evaluate(int64_t begin, int64_t end) override {
    EvalResult r;
    r.classified = data_.num_classes > 0;
    constexpr int64_t kChunk = 1000;
    for (int64_t b = begin; b < end; b += kChunk) {
      const int64_t e = std::min(end, b + kChunk);
      EvaluateBatch(*net_, Inputs(data_.test.inputs, test_x_, {}, b, e - b),
                    test_y_.slice(0, b, e).to(device_), &r);
    }
    return r;
  }

  absl::Status Export(const std::string& path) override { return net_->Export(path, inputs_); }

  // The first few training samples, for CheckModelFitsData.
  absl::Status CheckModel() {
    const int64_t n = std::min<int64_t>(2, train_size());
    return CheckModelFitsData(*net_, Inputs(data_.train.inputs, train_x_, {}, 0, n),
                              train_y_.slice(0, 0, n).to(device_), data_.num_classes);
  }

 private:
  static void FourDigits(std::string* out, double v) { absl::StrAppendFormat(out, "%.4f", v); }

  // The network's inputs for rows `rows` of `x` (`view` is x as a tensor), or, when `rows` is
  // empty, for the `n` rows from `first`.
  torch::Tensor Inputs(const Array& x, const torch::Tensor& view, absl::Span<const int64_t> rows,
                       int64_t first, int64_t n = 0) {
    if (!rows.empty()) n = static_cast<int64_t>(rows.size());
    if (table_.empty()) {
      const torch::Tensor raw =
          rows.empty() ? view.slice(0, first, first + n)
                       : view.index_select(0, torch::from_blob(const_cast<int64_t*>(rows.data()),
                                                               {n}, torch::kInt64));
      return PrepareInputs(raw.to(device_), norm_, mean_, std_);
    }
    const int64_t row = x.row_elements();
    const int64_t inner = std::max<int64_t>(row / channels_, 1);
    batch_.resize(static_cast<size_t>(n * row));
    for (int64_t i = 0; i < n; ++i) {
      const uint8_t* src = x.values<uint8_t>() + (rows.empty() ? first + i : rows[i]) * row;
      float* dst = batch_.data() + i * row;
      for (int64_t j = 0; j < row; ++j) dst[j] = table_[(j / inner) * 256 + src[j]];
    }
    std::vector<int64_t> shape = x.shape();
    shape[0] = n;
    // On the CPU the tensor views batch_, which the next batch overwrites: each step's graph is
    // gone by then (ComputeGradient and EvaluateBatch finish with it before returning).
    return torch::from_blob(batch_.data(), shape, torch::kFloat32).to(device_);
  }

  const torch::Device device_;
  std::unique_ptr<Net> net_;
  const Data data_;  // owns (or maps) what the tensors below view
  const Normalization norm_;
  const torch::Tensor train_x_, train_y_, test_x_, test_y_;
  torch::Tensor mean_, std_;  // norm_ as tensors on the device (more than one channel)
  InputTransform inputs_;     // norm_ and the classes, for an export
  int64_t channels_ = 1;
  std::vector<float> table_;  // uint8 inputs: 256 values per channel
  std::vector<float> batch_;  // the last batch of uint8 inputs, made float
};

bool IsBuiltin(const std::string& model) { return model == "cnn" || model == "mlp"; }

}  // namespace

absl::StatusOr<std::unique_ptr<Learner>> MakeTorchLearner(const LearnerConfig& config) {
  if (config.threads < 1) return absl::InvalidArgumentError("threads must be >= 1");
  torch::set_num_threads(config.threads);
  DBS_ASSIGN_OR_RETURN(torch::Device device, ChooseDevice(config.device));
  DBS_ASSIGN_OR_RETURN(
      Data data, LoadData(config.data, config.data_dir, config.train_limit, config.test_limit));
  DBS_ASSIGN_OR_RETURN(Normalization norm, ChooseNormalization(config.normalize, data));
  torch::manual_seed(config.seed);
  std::unique_ptr<Net> net;
  if (IsBuiltin(config.model)) {
    const int64_t outputs =
        data.num_classes > 0 ? data.num_classes : data.train.targets.row_elements();
    DBS_ASSIGN_OR_RETURN(
        net, MakeBuiltinNet(config.model, data.train.inputs.row_shape(), outputs, config.loss));
  } else if (access(config.model.c_str(), R_OK) != 0) {
    return absl::InvalidArgumentError(absl::StrCat("unknown model '", config.model,
                                                   "': use cnn, mlp or the path of a TorchScript "
                                                   "file (that file cannot be read: ",
                                                   std::strerror(errno), ")"));
  } else {
    DBS_ASSIGN_OR_RETURN(net, LoadScriptNet(config.model, config.loss));
  }
  if (!config.init_params_path.empty()) {
    std::vector<float> initial(static_cast<size_t>(TotalElements(net->layout())));
    DBS_RETURN_IF_ERROR(ReadRawParams(config.init_params_path, absl::MakeSpan(initial)));
    LoadParameters(*net, initial);
  }
  auto learner =
      std::make_unique<TorchLearner>(device, std::move(net), std::move(data), std::move(norm));
  DBS_RETURN_IF_ERROR(learner->CheckModel());
  return learner;
}

}  // namespace dbs
