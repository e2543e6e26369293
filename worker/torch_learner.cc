#include "worker/torch_learner.h"

#include <unistd.h>

#include <cstdio>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "worker/fashion_mnist.h"
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

class TorchLearner : public Learner {
 public:
  TorchLearner(torch::Device device, std::unique_ptr<Net> net, const ImageDataset& train,
               const ImageDataset& test)
      : device_(device),
        net_(std::move(net)),
        train_x_(ImagesTensor(train).to(device)),
        train_y_(LabelsTensor(train).to(device)),
        test_x_(ImagesTensor(test).to(device)),
        test_y_(LabelsTensor(test).to(device)) {
    net_->To(device_);
  }

  int64_t train_size() const override { return train_x_.size(0); }
  int64_t test_size() const override { return test_x_.size(0); }
  std::string device() const override { return device_.str(); }
  const ModelLayout& layout() const override { return net_->layout(); }

  void GetParameters(absl::Span<float> out) override { CopyParametersTo(*net_, out); }
  void SetParameters(absl::Span<const float> values) override { LoadParameters(*net_, values); }

  double ComputeGradient(absl::Span<const int64_t> indices, absl::Span<float> grad) override {
    const torch::Tensor idx =
        torch::from_blob(const_cast<int64_t*>(indices.data()),
                         {static_cast<int64_t>(indices.size())}, torch::kInt64)
            .to(device_);
    return dbs::ComputeGradient(*net_, train_x_.index_select(0, idx), train_y_.index_select(0, idx),
                                grad);
  }

  EvalResult Evaluate(int64_t begin, int64_t end) override {
    return dbs::Evaluate(*net_, test_x_, test_y_, begin, end);
  }

  absl::Status Export(const std::string& path) override { return net_->Export(path); }

 private:
  const torch::Device device_;
  std::unique_ptr<Net> net_;
  const torch::Tensor train_x_, train_y_, test_x_, test_y_;
};

bool IsBuiltin(const std::string& model) { return model == "cnn" || model == "mlp"; }

}  // namespace

absl::StatusOr<std::unique_ptr<Learner>> MakeTorchLearner(const LearnerConfig& config) {
  if (config.threads < 1) return absl::InvalidArgumentError("threads must be >= 1");
  torch::set_num_threads(config.threads);
  DBS_ASSIGN_OR_RETURN(torch::Device device, ChooseDevice(config.device));
  DBS_ASSIGN_OR_RETURN(ImageDataset train,
                       LoadFashionMnist(config.data_dir, true, config.train_limit));
  DBS_ASSIGN_OR_RETURN(ImageDataset test,
                       LoadFashionMnist(config.data_dir, false, config.test_limit));
  torch::manual_seed(config.seed);
  std::unique_ptr<Net> net;
  if (IsBuiltin(config.model)) {
    DBS_ASSIGN_OR_RETURN(net, MakeBuiltinNet(config.model));
  } else if (access(config.model.c_str(), R_OK) != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "unknown model '", config.model,
        "': use cnn, mlp or the path of a TorchScript file (there is no readable file by that "
        "name)"));
  } else {
    DBS_ASSIGN_OR_RETURN(net, LoadScriptNet(config.model, config.loss));
  }
  if (!config.init_params_path.empty()) {
    std::vector<float> initial(static_cast<size_t>(TotalElements(net->layout())));
    DBS_RETURN_IF_ERROR(ReadRawParams(config.init_params_path, absl::MakeSpan(initial)));
    LoadParameters(*net, initial);
  }
  return std::make_unique<TorchLearner>(device, std::move(net), train, test);
}

}  // namespace dbs
