#include "server/job_config.h"

#include <cmath>
#include <cstdint>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"

namespace dbs {

PolicyConfig PolicyConfigOf(const JobConfig& config) {
  PolicyConfig pc;
  pc.kind = config.policy;
  pc.speed_window = config.speed_window;
  pc.global_batch = config.scheduler.global_batch;
  pc.min_batch = config.min_batch;
  pc.max_batch = config.max_batch;
  pc.smoothing = config.smoothing;
  pc.deadband = config.deadband;
  pc.noise_margin = config.noise_margin;
  pc.fixed_split = config.fixed_split;
  return pc;
}

std::map<std::string, std::string> TrainingSettings(const JobConfig& c) {
  const auto f = [](double v) { return absl::StrCat(v); };
  return {{"policy", PolicyName(c.policy)},
          {"speed_window", absl::StrCat(c.speed_window)},
          {"min_batch", absl::StrCat(c.min_batch)},
          {"max_batch", absl::StrCat(c.max_batch)},
          {"smoothing", f(c.smoothing)},
          {"deadband", f(c.deadband)},
          {"fixed_split", FixedSplitText(c.fixed_split)},
          {"replan_window_steps", absl::StrCat(c.replan_window_steps)},
          {"replan_threshold", f(c.replan_threshold)},
          {"wire_dtype", WireDtypeName(c.wire_dtype)},
          {"noise_margin", f(c.noise_margin)},
          {"optimizer", c.optimizer.name},
          {"lr", f(c.optimizer.name == "adam" ? c.optimizer.adam.lr : c.optimizer.sgd.lr)},
          {"momentum", f(c.optimizer.sgd.momentum)},
          {"nesterov", c.optimizer.sgd.nesterov ? "true" : "false"},
          {"weight_decay", f(c.optimizer.name == "adam" ? c.optimizer.adam.weight_decay
                                                        : c.optimizer.sgd.weight_decay)},
          {"adam_beta1", f(c.optimizer.adam.beta1)},
          {"adam_beta2", f(c.optimizer.adam.beta2)},
          {"adam_eps", f(c.optimizer.adam.eps)}};
}

absl::Status ValidateJobConfig(const JobConfig& c) {
  const SchedulerConfig& s = c.scheduler;
  if (s.expected_workers < 1) {
    return absl::InvalidArgumentError("workers must be >= 1: need at least one worker");
  }
  if (s.expected_workers > static_cast<int>(kMaxWorkers)) {
    return absl::InvalidArgumentError(absl::StrCat("workers must be at most ", kMaxWorkers));
  }
  if (s.max_workers_per_source < 0) {
    return absl::InvalidArgumentError("max_workers_per_host must be >= 0 (0: no limit)");
  }
  if (s.registration_idle < absl::ZeroDuration()) {
    return absl::InvalidArgumentError("registration_idle_s must be >= 0 (0: never)");
  }
  if (s.epochs < 1 || s.epochs > 1000000) {
    return absl::InvalidArgumentError("epochs must be in [1, 1000000]");
  }
  if (s.global_batch < 1 || s.global_batch > kMaxGlobalBatch) {
    return absl::InvalidArgumentError("global_batch must be in [1, 16777216]");
  }
  DBS_RETURN_IF_ERROR(ValidatePolicyConfig(PolicyConfigOf(c)));
  if (static_cast<int64_t>(c.min_batch) * s.expected_workers > s.global_batch) {
    return absl::InvalidArgumentError("min_batch times workers exceeds global_batch");
  }
  DBS_RETURN_IF_ERROR(ValidateOptimizerConfig(c.optimizer));
  if (c.stall_timeout < absl::ZeroDuration() || c.worker_timeout < absl::ZeroDuration()) {
    return absl::InvalidArgumentError("stall_timeout and worker_timeout must be >= 0");
  }
  if (c.replan_window_steps < -1) {
    return absl::InvalidArgumentError("replan_window_steps must be >= -1");
  }
  if (!(c.screen.norm_ratio > 1.0) || !std::isfinite(c.screen.norm_ratio)) {
    return absl::InvalidArgumentError(
        "faulty_norm_ratio must be a number > 1 (a gradient this many times the median of the "
        "recent ones is faulty)");
  }
  if (!(c.replan_threshold > 1.0)) {
    return absl::InvalidArgumentError("replan_threshold must be > 1");
  }
  if (c.checkpoint_every_steps < 1) {
    return absl::InvalidArgumentError("checkpoint_every_steps must be >= 1");
  }
  return absl::OkStatus();
}

}  // namespace dbs
