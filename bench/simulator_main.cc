// dbs_simulator: DBS against S-SGD beyond one machine, with the real scheduler on a simulated
// clock. Replays per-worker speeds (a measured pattern, repeated to n workers) and a per-step
// communication cost c(n) = c0 + c1 * n, and prints a table (and JSON) for n = 4 ... 256.
#include <cstdio>
#include <fstream>
#include <iostream>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/flags/usage_config.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "bench/simulation.h"
#include "nlohmann/json.hpp"

ABSL_FLAG(std::string, speeds, "426,330,736,1181",
          "Speed pattern in samples/s (measured standalone speeds), repeated to n workers.");
ABSL_FLAG(std::string, workers, "4,8,16,64,256", "Cluster sizes to simulate.");
ABSL_FLAG(double, comm_base_ms, 1.0, "c0: per-step communication cost independent of n (ms).");
ABSL_FLAG(double, comm_per_worker_ms, 2.5, "c1: per-step cost per worker at the server (ms).");
ABSL_FLAG(int, per_worker_batch, 32, "Global batch = this times n (weak scaling).");
ABSL_FLAG(int64_t, train_samples, 60000, "Samples per epoch.");
ABSL_FLAG(int, epochs, 4, "Epochs per simulation.");
ABSL_FLAG(std::string, json_out, "", "Optional JSON output.");
ABSL_FLAG(int, trace_cluster, 0,
          "Instead of the table: print every epoch of the random property-test cluster with this "
          "seed (tests/simulation_test.cc) under the dbs, proportional and fixed policies.");
ABSL_FLAG(bool, trace_drift, true, "With --trace_cluster: the cluster's drift, if it has one.");
ABSL_FLAG(std::string, trace_cfs, "",
          "With --trace_cluster: the random cluster of workers under CPU limits (RandomCfsCluster) "
          "with this seed and 'short' (1 ms / limit) or 'kernel' (100 ms) periods; dbs also "
          "without the limit-aware step cost ('dbs/wall').");
ABSL_FLAG(int, trace_replan_window_steps, -1,
          "With --trace_cluster: mid-epoch re-planning window (-1: the policy's default; 0: "
          "epoch boundaries only, as the property test of the epoch-boundary controller).");
ABSL_FLAG(int, trace_epochs, 0, "With --trace_cluster: epochs to simulate (0: the cluster's).");
ABSL_FLAG(double, noise_margin, dbs::kDefaultNoiseMargin,
          "dbs: standard deviations of each worker's per-step time added to its predicted step.");

namespace {

int TraceCluster(uint64_t seed) {
  std::string what;
  const std::string periods = absl::GetFlag(FLAGS_trace_cfs);
  if (!periods.empty() && periods != "short" && periods != "kernel") {
    std::cerr << "dbs_simulator: --trace_cfs must be 'short' or 'kernel'" << std::endl;
    return 2;
  }
  const bool cfs = !periods.empty();
  dbs::SimulationConfig c = cfs ? dbs::RandomCfsCluster(seed, periods == "kernel", &what)
                                : dbs::RandomCluster(seed, absl::GetFlag(FLAGS_trace_drift), &what);
  c.noise_margin = absl::GetFlag(FLAGS_noise_margin);
  c.replan_window_steps = absl::GetFlag(FLAGS_trace_replan_window_steps);
  if (absl::GetFlag(FLAGS_trace_epochs) > 0) c.epochs = absl::GetFlag(FLAGS_trace_epochs);
  const std::vector<int> best = dbs::BestSplit(c, 0);
  std::printf("cluster %llu: %s\n", static_cast<unsigned long long>(seed), what.c_str());
  for (size_t i = 0; i < c.workers.size(); ++i) {
    std::printf("  worker %2zu %-46s best batch %d\n", i, c.workers[i].Describe().c_str(), best[i]);
  }
  struct Run {
    dbs::PolicyKind policy;
    bool aware;
  };
  std::vector<Run> runs = {{dbs::PolicyKind::kDbs, true},
                           {dbs::PolicyKind::kProportional, true},
                           {dbs::PolicyKind::kFixed, true}};
  if (cfs) runs.insert(runs.begin() + 1, {dbs::PolicyKind::kDbs, false});
  for (const Run& run : runs) {
    const dbs::PolicyKind p = run.policy;
    c.policy = p;
    c.cpu_limit_aware = run.aware;
    const std::string name = dbs::PolicyName(p) + (run.aware ? "" : "/wall");
    absl::StatusOr<dbs::SimulationResult> r = dbs::Simulate(c);
    if (!r.ok()) {
      std::cerr << "dbs_simulator: " << r.status() << std::endl;
      return 1;
    }
    for (size_t e = 0; e < r->epochs.size(); ++e) {
      const dbs::EpochResult& er = r->epochs[e];
      std::printf("%-12s epoch %2zu  %.3f s  spread %.3f  %.3fx best  %s  re-plans %d  batches",
                  name.c_str(), e, er.seconds, er.Spread(), er.OverBest(),
                  er.Balanced(c, static_cast<int>(e), 0.10) ? "balanced" : "        ", er.replans);
      for (int b : er.batches) std::printf(" %d", b);
      std::printf("\n%-12s           ms", "");
      for (double t : er.step_seconds) std::printf(" %.0f", 1e3 * t);
      std::printf("\n");
    }
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "DBS against S-SGD beyond one machine: the real scheduler on a simulated clock.\n"
      "Usage: dbs_simulator [--speeds=...] [--workers=4,8,...] [--json_out=FILE]\n"
      "       dbs_simulator --trace_cluster=SEED [--trace_cfs=short|kernel]");
  absl::SetFlagsUsageConfig({.contains_help_flags = [](absl::string_view file) {
    return absl::EndsWith(file, "bench/simulator_main.cc");
  }});
  absl::ParseCommandLine(argc, argv);
  if (absl::GetFlag(FLAGS_trace_cluster) > 0)
    return TraceCluster(absl::GetFlag(FLAGS_trace_cluster));
  std::vector<double> pattern;
  for (absl::string_view s : absl::StrSplit(absl::GetFlag(FLAGS_speeds), ',')) {
    double v;
    if (!absl::SimpleAtod(s, &v) || v <= 0) {
      std::cerr << "dbs_simulator: bad --speeds" << std::endl;
      return 2;
    }
    pattern.push_back(v);
  }
  nlohmann::json rows = nlohmann::json::array();
  std::printf("%6s %8s %12s %12s %12s %10s %10s %12s\n", "n", "batch", "ideal s", "S-SGD s",
              "DBS s", "DBS/SSGD", "gain %", "comm/step ms");
  for (absl::string_view s : absl::StrSplit(absl::GetFlag(FLAGS_workers), ',')) {
    int n;
    if (!absl::SimpleAtoi(s, &n) || n < 1) {
      std::cerr << "dbs_simulator: bad --workers" << std::endl;
      return 2;
    }
    std::vector<double> speeds;
    for (int i = 0; i < n; ++i) speeds.push_back(pattern[i % pattern.size()]);
    dbs::SimulationConfig c = dbs::SimulationConfig::Linear(speeds);
    c.comm_base_seconds = absl::GetFlag(FLAGS_comm_base_ms) / 1000.0;
    c.comm_per_worker_seconds = absl::GetFlag(FLAGS_comm_per_worker_ms) / 1000.0;
    c.global_batch = absl::GetFlag(FLAGS_per_worker_batch) * n;
    c.train_samples = absl::GetFlag(FLAGS_train_samples);
    c.epochs = absl::GetFlag(FLAGS_epochs);
    c.policy = dbs::PolicyKind::kFixed;
    auto sgd = dbs::Simulate(c);
    c.policy = dbs::PolicyKind::kDbs;
    auto dbs_run = dbs::Simulate(c);
    if (!sgd.ok() || !dbs_run.ok()) {
      std::cerr << "dbs_simulator: " << (sgd.ok() ? dbs_run.status() : sgd.status()) << std::endl;
      return 1;
    }
    const double a = sgd->SteadyEpochSeconds(), b = dbs_run->SteadyEpochSeconds();
    std::printf("%6d %8d %12.2f %12.2f %12.2f %10.3f %10.1f %12.2f\n", n, c.global_batch,
                dbs_run->ideal_epoch_seconds, a, b, b / a, 100.0 * (1.0 - b / a),
                1000.0 * dbs_run->step_comm_seconds);
    rows.push_back({{"workers", n},
                    {"global_batch", c.global_batch},
                    {"ideal_epoch_seconds", dbs_run->ideal_epoch_seconds},
                    {"sgd_epoch_seconds", a},
                    {"dbs_epoch_seconds", b},
                    {"dbs_over_sgd", b / a},
                    {"step_comm_seconds", dbs_run->step_comm_seconds},
                    {"steps", dbs_run->steps}});
  }
  const std::string out = absl::GetFlag(FLAGS_json_out);
  if (!out.empty()) std::ofstream(out) << rows.dump(2) << "\n";
  return 0;
}
