#include "server/step_trace.h"

#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "nlohmann/json.hpp"

namespace dbs {

absl::StatusOr<std::unique_ptr<StepTrace>> StepTrace::Open(const std::string& path, bool append,
                                                           const Clock* clock) {
  if (path.empty()) return nullptr;
  std::FILE* file = std::fopen(path.c_str(), append ? "a" : "w");
  if (file == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat("--step_trace_path: cannot write ", path, ": ", std::strerror(errno)));
  }
  return std::unique_ptr<StepTrace>(new StepTrace(file, clock));
}

StepTrace::~StepTrace() {
  absl::MutexLock lock(&mu_);
  std::fclose(file_);
}

void StepTrace::OnStep(absl::Duration wall, const StepStats& stats) {
  nlohmann::json workers = nlohmann::json::array();
  for (const auto& [id, reported] : stats.workers) {
    nlohmann::json w = {
        {"id", id}, {"samples", reported.first}, {"compute_seconds", reported.second}};
    if (auto cycle = stats.cycle.find(id); cycle != stats.cycle.end()) {
      w["step_seconds"] = cycle->second;
    }
    workers.push_back(std::move(w));
  }
  const nlohmann::json line = {{"epoch", stats.epoch},
                               {"step", stats.step},
                               {"time", absl::ToDoubleSeconds(clock_->Now() - absl::UnixEpoch())},
                               {"wall_seconds", absl::ToDoubleSeconds(wall)},
                               {"samples", stats.samples},
                               {"loss", stats.samples > 0 ? stats.loss_sum / stats.samples : 0.0},
                               {"workers", std::move(workers)}};
  const std::string text = line.dump() + "\n";
  absl::MutexLock lock(&mu_);
  std::fwrite(text.data(), 1, text.size(), file_);
  if (stats.last_of_epoch) std::fflush(file_);
}

}  // namespace dbs
