#include "server/optimizer.h"

#include <cmath>

#include "absl/strings/str_cat.h"

namespace dbs {

void SgdOptimizer::Step(absl::Span<float> params, absl::Span<const float> grad) {
  const float lr = static_cast<float>(config_.lr);
  const float mu = static_cast<float>(config_.momentum);
  const float wd = static_cast<float>(config_.weight_decay);
  const size_t n = params.size();
  if (mu == 0.0f) {
    for (size_t i = 0; i < n; ++i) params[i] -= lr * (grad[i] + wd * params[i]);
    return;
  }
  if (!has_momentum_) momentum_.assign(n, 0.0f);
  for (size_t i = 0; i < n; ++i) {
    const float d = grad[i] + wd * params[i];
    // torch.optim.SGD: the first step's buffer is the gradient itself.
    momentum_[i] = has_momentum_ ? mu * momentum_[i] + d : d;
    params[i] -= lr * (config_.nesterov ? d + mu * momentum_[i] : momentum_[i]);
  }
  has_momentum_ = true;
}

std::string SgdOptimizer::Describe() const {
  return absl::StrCat("sgd(lr=", config_.lr, ", momentum=", config_.momentum,
                      ", weight_decay=", config_.weight_decay, config_.nesterov ? ", nesterov" : "",
                      ")");
}

void AdamOptimizer::Step(absl::Span<float> params, absl::Span<const float> grad) {
  const size_t n = params.size();
  if (m_.size() != n) {
    m_.assign(n, 0.0f);
    v_.assign(n, 0.0f);
  }
  ++t_;
  const double b1 = config_.beta1, b2 = config_.beta2;
  const double bc1 = 1.0 - std::pow(b1, static_cast<double>(t_));
  const double bc2 = 1.0 - std::pow(b2, static_cast<double>(t_));
  const float step = static_cast<float>(config_.lr / bc1);
  const float sqrt_bc2 = static_cast<float>(std::sqrt(bc2));
  const float eps = static_cast<float>(config_.eps);
  const float wd = static_cast<float>(config_.weight_decay);
  const float fb1 = static_cast<float>(b1), fb2 = static_cast<float>(b2);
  for (size_t i = 0; i < n; ++i) {
    const float g = grad[i] + wd * params[i];
    m_[i] = fb1 * m_[i] + (1.0f - fb1) * g;
    v_[i] = fb2 * v_[i] + (1.0f - fb2) * g * g;
    params[i] -= step * m_[i] / (std::sqrt(v_[i]) / sqrt_bc2 + eps);
  }
}

std::string AdamOptimizer::Describe() const {
  return absl::StrCat("adam(lr=", config_.lr, ", betas=(", config_.beta1, ", ", config_.beta2,
                      "), eps=", config_.eps, ", weight_decay=", config_.weight_decay, ")");
}

OptimizerState SgdOptimizer::SaveState() const {
  OptimizerState s;
  s.kind = "sgd";
  s.steps = has_momentum_ ? 1 : 0;
  if (has_momentum_) s.buffers = {momentum_};
  return s;
}

absl::Status SgdOptimizer::LoadState(const OptimizerState& s, size_t model_size) {
  if (s.kind != "sgd") return absl::InvalidArgumentError("the checkpoint is not of an SGD run");
  if (s.steps > 0 && (s.buffers.size() != 1 || s.buffers[0].size() != model_size)) {
    return absl::InvalidArgumentError("SGD momentum does not match the model");
  }
  has_momentum_ = s.steps > 0;
  momentum_ = has_momentum_ ? s.buffers[0] : std::vector<float>{};
  return absl::OkStatus();
}

OptimizerState AdamOptimizer::SaveState() const {
  OptimizerState s;
  s.kind = "adam";
  s.steps = t_;
  if (t_ > 0) s.buffers = {m_, v_};
  return s;
}

absl::Status AdamOptimizer::LoadState(const OptimizerState& s, size_t model_size) {
  if (s.kind != "adam") return absl::InvalidArgumentError("the checkpoint is not of an Adam run");
  if (s.steps > 0 && (s.buffers.size() != 2 || s.buffers[0].size() != model_size ||
                      s.buffers[1].size() != model_size)) {
    return absl::InvalidArgumentError("Adam moments do not match the model");
  }
  t_ = s.steps;
  m_ = t_ > 0 ? s.buffers[0] : std::vector<float>{};
  v_ = t_ > 0 ? s.buffers[1] : std::vector<float>{};
  return absl::OkStatus();
}

absl::Status ValidateOptimizerConfig(const OptimizerConfig& config) {
  if (config.name == "sgd") {
    const SgdConfig& c = config.sgd;
    if (!(c.lr > 0.0) || !(c.momentum >= 0.0 && c.momentum < 1.0) || !(c.weight_decay >= 0.0)) {
      return absl::InvalidArgumentError(
          "sgd needs lr > 0, 0 <= momentum < 1 and weight_decay >= 0");
    }
    if (c.nesterov && c.momentum == 0.0) {
      return absl::InvalidArgumentError("nesterov momentum needs momentum > 0");
    }
    return absl::OkStatus();
  }
  if (config.name == "adam") {
    const AdamConfig& c = config.adam;
    if (!(c.lr > 0.0) || !(c.beta1 >= 0.0 && c.beta1 < 1.0) || !(c.beta2 >= 0.0 && c.beta2 < 1.0) ||
        !(c.eps > 0.0) || !(c.weight_decay >= 0.0)) {
      return absl::InvalidArgumentError(
          "adam needs lr > 0, betas in [0, 1), eps > 0 and weight_decay >= 0");
    }
    return absl::OkStatus();
  }
  return absl::InvalidArgumentError(
      absl::StrCat("unknown optimizer '", config.name, "'; use 'sgd' or 'adam'"));
}

absl::StatusOr<std::unique_ptr<Optimizer>> MakeOptimizer(const OptimizerConfig& config) {
  if (absl::Status valid = ValidateOptimizerConfig(config); !valid.ok()) return valid;
  if (config.name == "sgd") return std::unique_ptr<Optimizer>(new SgdOptimizer(config.sgd));
  return std::unique_ptr<Optimizer>(new AdamOptimizer(config.adam));
}

}  // namespace dbs
