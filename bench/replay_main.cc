// dbs_replay: the share policy's decisions of a finished run, computed again from its summary.
//
// Every plan and mid-epoch re-plan is replayed from the measurements the summary records; each
// line shows the batches the run used and the batches replayed. With the run's own settings the
// two must be equal (exit 1 otherwise: the record is incomplete). --verbose shows, for the dbs
// policy, why: each worker's fitted step-time curve, its noise margin and its damping gain.
// --policy / --noise_margin ask what another setting would have answered to the same
// measurements (later measurements would of course have differed).
#include <cmath>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <sstream>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/flags/usage_config.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "nlohmann/json.hpp"
#include "server/balancing_policy.h"
#include "server/batch_allocator.h"
#include "server/plan_replay.h"

ABSL_FLAG(
    std::string, summary, "",
    "A run's summary.json (dbs_ps --summary_path; local_cluster.py writes OUT_DIR/summary.json).");
ABSL_FLAG(bool, verbose, false,
          "dbs policy: print each worker's fitted curve (batch:ms per step), margin and gain.");
ABSL_FLAG(std::string, policy, "", "Replay with this policy instead of the run's.");
ABSL_FLAG(double, noise_margin, -1.0,
          "Replay with this noise margin (standard deviations) instead of the run's.");
ABSL_FLAG(int, epoch, 0, "Only the decisions about this epoch (1-based, as printed; 0: all).");
ABSL_FLAG(std::string, json_out, "", "Also write every decision, recorded and replayed, as JSON.");

namespace {

std::string Batches(const std::vector<int64_t>& b) { return absl::StrJoin(b, " "); }

void PrintModels(const dbs::BalancingPolicy& policy, const dbs::RecordedDecision& d) {
  const dbs::BalancingPlan plan = policy.Plan(d.observations);
  const std::vector<dbs::StepTimeModel> models = policy.Models(d.observations);
  const std::vector<double> margins = policy.NoiseMargins(d.observations, models);
  std::printf("    %s: slowest step now %.2f ms, planned %.2f ms\n",
              plan.held ? "held (balanced within the hold spread)" : "moved",
              1e3 * plan.current_step_seconds, 1e3 * plan.predicted_step_seconds);
  for (size_t i = 0; i < d.observations.size(); ++i) {
    const dbs::WorkerObservation& o = d.observations[i];
    std::string knots;
    for (const auto& [b, t] : models[i].knots()) absl::StrAppend(&knots, " ", b, ":", 1e3 * t);
    std::printf(
        "    worker %d %-12s now %3d -> %6.2f  gain %.3f  margin %.2f ms  last change %d  "
        "measurements %zu\n      curve (batch:ms)%s\n",
        d.ids[i], o.name.c_str(), o.current_batch, i < plan.batches.size() ? plan.batches[i] : 0.0,
        i < plan.gains.size() ? plan.gains[i] : 0.0, 1e3 * margins[i], models[i].last_change(),
        o.history.size(), knots.c_str());
  }
}

// The summary at `path` as JSON; false (with a message) when it cannot be read or parsed, or has
// no recorded decisions.
bool LoadSummary(const std::string& path, nlohmann::json* summary) {
  std::ifstream in(path);
  if (!in) {
    std::cerr << "dbs_replay: cannot read " << path << std::endl;
    return false;
  }
  std::stringstream text;
  text << in.rdbuf();
  *summary = nlohmann::json::parse(text.str(), nullptr, false);
  if (summary->is_discarded()) {
    std::cerr << "dbs_replay: " << path << " is not JSON" << std::endl;
    return false;
  }
  if (!summary->contains("controller")) {
    std::cerr << "dbs_replay: " << path
              << " has no \"controller\": it was written before decisions were recorded"
              << std::endl;
    return false;
  }
  return true;
}

// Applies --policy and --noise_margin to the recorded controller settings; sets `changed` when
// either differs from them. False (with a message) for an unknown policy.
bool ApplyOverrides(dbs::PolicyConfig* config, bool* changed) {
  if (const std::string p = absl::GetFlag(FLAGS_policy); !p.empty()) {
    absl::StatusOr<dbs::PolicyKind> kind = dbs::ParsePolicy(p);
    if (!kind.ok()) {
      std::cerr << "dbs_replay: --policy: " << kind.status() << std::endl;
      return false;
    }
    *changed |= *kind != config->kind;
    config->kind = *kind;
  }
  if (const double m = absl::GetFlag(FLAGS_noise_margin); m >= 0) {
    *changed |= m != config->noise_margin;
    config->noise_margin = m;
  }
  return true;
}

// Replays one decision, prints its line (and the curves with --verbose) and returns its record.
nlohmann::json ReplayOne(const dbs::SharePolicy& policy, const dbs::BalancingPolicy& balancing,
                         int global_batch, bool verbose, const dbs::RecordedDecision& d) {
  const std::vector<double> replayed = dbs::Replay(policy, d);
  const std::vector<int64_t> a = dbs::LargestRemainder(global_batch, d.shares);
  const std::vector<int64_t> b = dbs::LargestRemainder(global_batch, replayed);
  std::vector<int64_t> current;
  for (const dbs::WorkerObservation& o : d.observations) current.push_back(o.current_batch);
  bool same = a == b;
  for (size_t i = 0; same && i < replayed.size(); ++i) {
    same = std::abs(replayed[i] - d.shares[i]) <= 1e-12;
  }
  const std::string when =
      d.from_step == 0 ? std::string("plan") : absl::StrCat("after step ", d.from_step);
  std::printf("epoch %d %-16s from [%s]  recorded [%s]%s  replayed [%s]  %s\n", d.epoch + 1,
              when.c_str(), Batches(current).c_str(), Batches(a).c_str(),
              d.applied ? "" : " (kept)", Batches(b).c_str(), same ? "same" : "DIFFERENT");
  if (verbose && !(d.epoch == 0 && d.from_step == 0)) PrintModels(balancing, d);
  return {{"epoch", d.epoch},
          {"from_step", d.from_step},
          {"applied", d.applied},
          {"workers", d.ids},
          {"current", current},
          {"recorded_shares", d.shares},
          {"replayed_shares", replayed},
          {"recorded", a},
          {"replayed", b},
          {"same", same}};
}

int Main(const std::string& path) {
  nlohmann::json summary;
  if (!LoadSummary(path, &summary)) return 2;
  absl::StatusOr<dbs::PolicyConfig> config = dbs::PolicyConfigFromJson(summary.at("controller"));
  absl::StatusOr<std::vector<dbs::RecordedDecision>> decisions = dbs::DecisionsOf(summary);
  if (!config.ok() || !decisions.ok()) {
    std::cerr << "dbs_replay: " << path << ": "
              << (config.ok() ? decisions.status() : config.status()) << std::endl;
    return 2;
  }
  bool changed = false;
  if (!ApplyOverrides(&*config, &changed)) return 2;
  absl::StatusOr<std::unique_ptr<dbs::SharePolicy>> policy = dbs::MakeSharePolicy(*config);
  if (!policy.ok()) {
    std::cerr << "dbs_replay: " << policy.status() << std::endl;
    return 2;
  }
  const dbs::BalancingPolicy balancing(dbs::BalancingOptionsOf(*config));
  const bool verbose = absl::GetFlag(FLAGS_verbose) && config->kind == dbs::PolicyKind::kDbs &&
                       config->smoothing == 1.0 && config->deadband == 0.0;
  const int only = absl::GetFlag(FLAGS_epoch) - 1;
  std::printf("%s: policy %s%s, global batch %d, noise margin %g, %zu decisions\n", path.c_str(),
              dbs::PolicyName(config->kind).c_str(), changed ? " (changed)" : "",
              config->global_batch, config->noise_margin, decisions->size());
  nlohmann::json out = nlohmann::json::array();
  int differ = 0, shown = 0;
  for (const dbs::RecordedDecision& d : *decisions) {
    if (only >= 0 && d.epoch != only) continue;
    ++shown;
    out.push_back(ReplayOne(**policy, balancing, config->global_batch, verbose, d));
    differ += out.back()["same"].get<bool>() ? 0 : 1;
  }
  std::printf("%d of %d decisions replayed %s\n", shown - differ, shown,
              changed ? "the same with the changed setting" : "the same");
  if (const std::string j = absl::GetFlag(FLAGS_json_out); !j.empty()) {
    std::ofstream f(j);
    f << nlohmann::json{{"summary", path}, {"changed", changed}, {"decisions", out}}.dump(1)
      << "\n";
    if (!f) {
      std::cerr << "dbs_replay: cannot write " << j << std::endl;
      return 2;
    }
  }
  return differ > 0 && !changed ? 1 : 0;
}

}  // namespace

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "Replays the share policy's decisions of a finished run from its summary.json.\n"
      "Usage: dbs_replay --summary=RUN/summary.json [--verbose] [--epoch=N]\n"
      "       [--policy=dbs|proportional|fixed] [--noise_margin=SD] [--json_out=FILE]\n"
      "Exit status: 0 every decision replayed as recorded (or a setting was changed), 1 some "
      "differ, 2 bad input.");
  absl::SetFlagsUsageConfig({.contains_help_flags = [](absl::string_view file) {
    return absl::EndsWith(file, "bench/replay_main.cc");
  }});
  absl::ParseCommandLine(argc, argv);
  const std::string path = absl::GetFlag(FLAGS_summary);
  if (path.empty()) {
    std::cerr << "dbs_replay: --summary is required (see --help)" << std::endl;
    return 2;
  }
  return Main(path);
}
