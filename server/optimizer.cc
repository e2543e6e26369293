#include "server/optimizer.h"

#include <cmath>

#include "absl/strings/str_cat.h"
#include "common/multiversion.h"

namespace dbs {

void SgdOptimizer::Begin(size_t model_size) {
  if (static_cast<float>(config_.momentum) == 0.0f) return;
  first_ = !has_momentum_;  // torch.optim.SGD: the first buffer is the gradient itself
  if (first_) momentum_.assign(model_size, 0.0f);
}

namespace {

// The loops over every parameter, free functions so that each is compiled for AVX2 too
// (multiversion.h); one branch-free loop per case, over raw pointers, so that the compiler
// vectorizes it.
DBS_WIDE_VECTORS void SgdKernel(float* p, const float* g, float* m, size_t n, float lr, float mu,
                                float wd, bool first, bool nesterov) {
  if (m == nullptr) {
    for (size_t i = 0; i < n; ++i) p[i] -= lr * (g[i] + wd * p[i]);
  } else if (first && nesterov) {
    for (size_t i = 0; i < n; ++i) {
      const float d = g[i] + wd * p[i];
      m[i] = d;
      p[i] -= lr * (d + mu * d);
    }
  } else if (first) {
    for (size_t i = 0; i < n; ++i) {
      m[i] = g[i] + wd * p[i];
      p[i] -= lr * m[i];
    }
  } else if (nesterov) {
    for (size_t i = 0; i < n; ++i) {
      const float d = g[i] + wd * p[i];
      m[i] = mu * m[i] + d;
      p[i] -= lr * (d + mu * m[i]);
    }
  } else {
    for (size_t i = 0; i < n; ++i) {
      m[i] = mu * m[i] + (g[i] + wd * p[i]);
      p[i] -= lr * m[i];
    }
  }
}

DBS_WIDE_VECTORS void AdamKernel(float* p, const float* gr, float* m, float* v, size_t n,
                                 float step, float sqrt_bc2, float eps, float wd, float fb1,
                                 float fb2) {
  for (size_t i = 0; i < n; ++i) {
    const float g = gr[i] + wd * p[i];
    m[i] = fb1 * m[i] + (1.0f - fb1) * g;
    v[i] = fb2 * v[i] + (1.0f - fb2) * g * g;
    p[i] -= step * m[i] / (std::sqrt(v[i]) / sqrt_bc2 + eps);
  }
}

}  // namespace

void SgdOptimizer::StepRange(float* p, const float* g, size_t offset, size_t n) {
  const float mu = static_cast<float>(config_.momentum);
  SgdKernel(p, g, mu == 0.0f ? nullptr : momentum_.data() + offset, n,
            static_cast<float>(config_.lr), mu, static_cast<float>(config_.weight_decay), first_,
            config_.nesterov);
}

void SgdOptimizer::End() {
  if (static_cast<float>(config_.momentum) != 0.0f) has_momentum_ = true;
  first_ = false;
}

std::string SgdOptimizer::Describe() const {
  return absl::StrCat("sgd(lr=", config_.lr, ", momentum=", config_.momentum,
                      ", weight_decay=", config_.weight_decay, config_.nesterov ? ", nesterov" : "",
                      ")");
}

void AdamOptimizer::Begin(size_t model_size) {
  if (m_.size() != model_size) {
    m_.assign(model_size, 0.0f);
    v_.assign(model_size, 0.0f);
  }
  ++t_;
  const double bc1 = 1.0 - std::pow(config_.beta1, static_cast<double>(t_));
  const double bc2 = 1.0 - std::pow(config_.beta2, static_cast<double>(t_));
  step_ = static_cast<float>(config_.lr / bc1);
  sqrt_bc2_ = static_cast<float>(std::sqrt(bc2));
}

void AdamOptimizer::StepRange(float* p, const float* gr, size_t offset, size_t n) {
  AdamKernel(p, gr, m_.data() + offset, v_.data() + offset, n, step_, sqrt_bc2_,
             static_cast<float>(config_.eps), static_cast<float>(config_.weight_decay),
             static_cast<float>(config_.beta1), static_cast<float>(config_.beta2));
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
