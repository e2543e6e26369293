// Optimizers applied by the parameter server to its flat parameter buffer, once per step.
//
// Semantics follow torch.optim (SGD with momentum, dampening 0, optional Nesterov, L2 weight decay
// added to the gradient; Adam with bias correction and L2 weight decay), so a run can be checked
// against PyTorch. State (momentum, moments) is sized on the first step. Not thread-safe: the
// ParameterStore serialises calls.
#ifndef DBS_SERVER_OPTIMIZER_H_
#define DBS_SERVER_OPTIMIZER_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"

namespace dbs {

// An optimizer's internal state, for checkpoints.
struct OptimizerState {
  std::string kind;                         // "sgd" or "adam"
  int64_t steps = 0;                        // updates applied (Adam's t; SGD: momentum started)
  std::vector<std::vector<float>> buffers;  // SGD: momentum; Adam: m, v
};

class Optimizer {
 public:
  virtual ~Optimizer() = default;
  // params -= update(grad). Both spans have the model's size.
  void Step(absl::Span<float> params, absl::Span<const float> grad) {
    Begin(params.size());
    StepRange(params.data(), grad.data(), 0, params.size());
    End();
  }
  // The same step in pieces, so that a caller can do more with each block while it is in the
  // cache: Begin (the model's size), then StepRange over every range [offset, offset + count)
  // exactly once (`params` and `grad` point at the range), then End. The result is the same, bit
  // for bit, whatever the ranges.
  virtual void Begin(size_t model_size) = 0;
  virtual void StepRange(float* params, const float* grad, size_t offset, size_t count) = 0;
  virtual void End() = 0;
  virtual std::string Describe() const = 0;
  virtual OptimizerState SaveState() const = 0;
  // INVALID_ARGUMENT when the state belongs to another optimizer or another model size.
  virtual absl::Status LoadState(const OptimizerState& state, size_t model_size) = 0;
};

struct SgdConfig {
  double lr = 0.05;
  double momentum = 0.9;
  double weight_decay = 0.0;
  bool nesterov = false;
};

class SgdOptimizer : public Optimizer {
 public:
  explicit SgdOptimizer(SgdConfig config) : config_(config) {}
  void Begin(size_t model_size) override;
  void StepRange(float* params, const float* grad, size_t offset, size_t count) override;
  void End() override;
  std::string Describe() const override;
  OptimizerState SaveState() const override;
  absl::Status LoadState(const OptimizerState& state, size_t model_size) override;

 private:
  SgdConfig config_;
  std::vector<float> momentum_;
  bool has_momentum_ = false;
  bool first_ = false;  // this step starts the momentum
};

struct AdamConfig {
  double lr = 1e-3;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 0.0;
};

class AdamOptimizer : public Optimizer {
 public:
  explicit AdamOptimizer(AdamConfig config) : config_(config) {}
  void Begin(size_t model_size) override;
  void StepRange(float* params, const float* grad, size_t offset, size_t count) override;
  void End() override {}
  std::string Describe() const override;
  OptimizerState SaveState() const override;
  absl::Status LoadState(const OptimizerState& state, size_t model_size) override;

 private:
  AdamConfig config_;
  std::vector<float> m_;
  std::vector<float> v_;
  int64_t t_ = 0;
  float step_ = 0.0f;      // lr / (1 - beta1^t), of the step in progress
  float sqrt_bc2_ = 0.0f;  // sqrt(1 - beta2^t)
};

struct OptimizerConfig {
  std::string name = "sgd";  // "sgd" or "adam"
  SgdConfig sgd;
  AdamConfig adam;
};

// INVALID_ARGUMENT for an unknown name or out-of-range hyper-parameters.
absl::Status ValidateOptimizerConfig(const OptimizerConfig& config);
// INVALID_ARGUMENT when ValidateOptimizerConfig refuses the configuration.
absl::StatusOr<std::unique_ptr<Optimizer>> MakeOptimizer(const OptimizerConfig& config);

}  // namespace dbs

#endif  // DBS_SERVER_OPTIMIZER_H_
