// dataplane_client: the dbs side of the data-plane benchmark (bench/dataplane.py).
//
// Runs --clients fake workers in one process, each with its own GrpcPsClient (the workers' own
// client code) and channel, against a running dbs_ps: register, register a model of --params
// floats, then push a gradient and receive the parameters for --warmup + --steps synchronous
// steps. No training happens: what is timed is the data plane alone (push, aggregate, update,
// reply to all). Prints one JSON object: the step time (median and spread, from the slowest
// client of each step), and, over the timed steps, this process's CPU per client and step and the
// server's CPU, minor page faults and peak RSS (read from /proc/--server_pid). Faults are also
// given over the second half of the timed steps alone: the server's receive buffers grow over
// the first steps of a large model (gRPC widens its flow-control window as it measures the
// link), and a short warm-up leaves that growth inside the timed window.
#include <sys/resource.h>

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <memory>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/status/status.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/synchronization/barrier.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "common/cli.h"
#include "nlohmann/json.hpp"
#include "worker/grpc_ps_client.h"
#include "worker/sharded_ps_client.h"

ABSL_FLAG(std::string, server, "127.0.0.1:50051",
          "dbs_ps address; for a sharded job every shard's, comma-separated, shard 0 first.");
ABSL_FLAG(int, clients, 4, "Fake workers (dbs_ps must be started with --workers equal to this).");
ABSL_FLAG(int64_t, params, 1000000, "Model size in floats.");
ABSL_FLAG(int, tensors, 8, "Number of tensors the model is split into (sizes halve).");
ABSL_FLAG(int, warmup, 60,
          "Untimed steps first (a large model's server heap grows over about 50 steps).");
ABSL_FLAG(int, steps, 20, "Timed steps.");
ABSL_FLAG(bool, shared_memory, false,
          "Push through memory shared with dbs_ps (a worker's default on the server's host); "
          "off: over the socket.");
ABSL_FLAG(std::vector<std::string>, server_pid, {},
          "dbs_ps's pid (every shard's, comma-separated), for its CPU time, page faults and peak "
          "RSS (summed over the shards).");

namespace {

struct ProcStat {
  double cpu_seconds = 0;
  long long minor_faults = 0;
};

// utime + stime and minflt of `pid` from /proc/PID/stat.
ProcStat ReadProcStat(int pid) {
  ProcStat s;
  std::ifstream f(absl::StrCat("/proc/", pid, "/stat"));
  std::string text((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  const size_t close = text.rfind(')');
  if (close == std::string::npos) return s;
  std::vector<std::string> fields = absl::StrSplit(text.substr(close + 2), ' ');
  // After "pid (comm) ": state is field 3, so field k is fields[k - 3].
  if (fields.size() < 15) return s;
  const double tick = static_cast<double>(sysconf(_SC_CLK_TCK));
  s.minor_faults = std::stoll(fields[10 - 3]);
  s.cpu_seconds = (std::stod(fields[14 - 3]) + std::stod(fields[15 - 3])) / tick;
  return s;
}

// A field of /proc/`pid`/status given in kB (VmHWM: the peak RSS; RssShmem: the shared memory
// mapped now), in bytes.
long long StatusBytes(int pid, const std::string& field) {
  std::ifstream f(absl::StrCat("/proc/", pid, "/status"));
  std::string line;
  while (std::getline(f, line)) {
    if (line.rfind(field + ":", 0) == 0) {
      std::istringstream in(line.substr(field.size() + 1));
      long long kb = 0;
      in >> kb;
      return kb * 1024;
    }
  }
  return 0;
}

double SelfCpuSeconds() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  return u.ru_utime.tv_sec + u.ru_utime.tv_usec * 1e-6 + u.ru_stime.tv_sec +
         u.ru_stime.tv_usec * 1e-6;
}

// --params floats in --tensors tensors, each half the size of the one before (the rest in the
// first), like a network whose last layers are small.
dbs::ModelLayout MakeLayout(int64_t params, int tensors) {
  std::vector<int64_t> sizes;
  int64_t left = params;
  for (int i = 0; i < tensors - 1 && left > 1; ++i) {
    sizes.push_back(left / 2);
    left -= left / 2;
  }
  sizes.push_back(left);
  dbs::ModelLayout layout;
  for (size_t i = 0; i < sizes.size(); ++i) {
    layout.push_back({absl::StrCat("t", i), {sizes[i]}, false});
  }
  return layout;
}

struct ClientResult {
  absl::Status status;
  std::vector<double> step_seconds;
};

// The timing points every client passes: before the timed steps, half-way, after them.
struct Barriers {
  explicit Barriers(int parties) : start(parties), mid(parties), end(parties) {}
  absl::Barrier start, mid, end;
};

struct Run {
  int clients = 0;
  int64_t params = 0;
  int warmup = 0;
  int steps = 0;
  dbs::ModelLayout layout;
};

// Fake worker `c`: registers, registers the model, takes the plan, pushes `warmup` steps, then
// the timed ones between the barriers (passing them even when a call failed).
void RunClient(int c, const Run& run, Barriers* barriers, ClientResult* r) {
  dbs::GrpcClientConfig config;
  config.address = absl::GetFlag(FLAGS_server);
  config.connect_timeout = absl::Seconds(30);
  config.call_timeout = absl::Seconds(300);
  config.max_message_mb = 2047;
  config.shared_memory = absl::GetFlag(FLAGS_shared_memory);
  std::unique_ptr<dbs::PsClient> owned = dbs::MakePsClient(config);
  dbs::PsClient& client = *owned;
  std::vector<float> values(static_cast<size_t>(run.params), 0.0f);
  std::vector<float> gradient(static_cast<size_t>(run.params));
  for (size_t i = 0; i < gradient.size(); ++i) gradient[i] = 1e-3f * ((i + c) % 17);
  int id = -1;
  dbs::WorkerPlan plan;
  auto setup = [&]() -> absl::Status {
    const int64_t samples = static_cast<int64_t>(run.clients) * (run.warmup + run.steps);
    auto reg = client.RegisterWorker({absl::StrCat("bench-", c), samples, run.clients, "cpu"});
    if (!reg.ok()) return reg.status();
    id = reg->worker_id;
    absl::Status s = client.RegisterModel(id, run.layout, values, absl::MakeSpan(values));
    if (!s.ok()) return s;
    auto p = client.GetEpochPlan(id, 0);
    if (!p.ok()) return p.status();
    plan = *p;
    if (plan.num_steps < run.warmup + run.steps) {
      return absl::FailedPreconditionError(
          absl::StrCat("the plan has ", plan.num_steps, " steps; need ", run.warmup + run.steps));
    }
    return absl::OkStatus();
  };
  r->status = setup();
  auto push = [&](int step) -> absl::Status {
    return client
        .PushGradient(id, 0, step, plan.BatchAt(step), 1.0, 0.0, gradient, absl::MakeSpan(values))
        .status();
  };
  for (int s = 0; s < run.warmup && r->status.ok(); ++s) r->status = push(s);
  barriers->start.Block();
  bool past_mid = false;
  for (int s = run.warmup; s < run.warmup + run.steps && r->status.ok(); ++s) {
    if (s == run.warmup + run.steps / 2) {
      barriers->mid.Block();
      past_mid = true;
    }
    const absl::Time t0 = absl::Now();
    r->status = push(s);
    r->step_seconds.push_back(absl::ToDoubleSeconds(absl::Now() - t0));
  }
  if (!past_mid) barriers->mid.Block();  // failed before it: let the others through
  barriers->end.Block();
}

// --server_pid, every shard's process; false (with a message) for one that is not a pid.
bool ParsePids(std::vector<int>* pids) {
  for (const std::string& p : absl::GetFlag(FLAGS_server_pid)) {
    int pid = 0;
    if (!absl::SimpleAtoi(p, &pid) || pid <= 0) {
      std::fprintf(stderr, "--server_pid: '%s' is not a pid\n", p.c_str());
      return false;
    }
    pids->push_back(pid);
  }
  return true;
}

// Every shard's figures, summed.
ProcStat ServerStat(const std::vector<int>& pids) {
  ProcStat total;
  for (int pid : pids) {
    const ProcStat s = ReadProcStat(pid);
    total.cpu_seconds += s.cpu_seconds;
    total.minor_faults += s.minor_faults;
  }
  return total;
}

// The servers' CPU, page faults and memory over the timed steps (`before`, `mid`, `after`).
void AddServerFigures(const std::vector<int>& pids, int steps, const ProcStat& before,
                      const ProcStat& mid, const ProcStat& after, nlohmann::json* out) {
  (*out)["server_cpu_ms_per_step"] = 1e3 * (after.cpu_seconds - before.cpu_seconds) / steps;
  (*out)["server_faults_per_step"] =
      static_cast<double>(after.minor_faults - before.minor_faults) / steps;
  (*out)["server_faults_per_step_second_half"] =
      static_cast<double>(after.minor_faults - mid.minor_faults) / (steps - steps / 2);
  long long rss = 0, shared = 0;
  for (int pid : pids) {
    rss += StatusBytes(pid, "VmHWM");
    shared += StatusBytes(pid, "RssShmem");
  }
  (*out)["server_peak_rss_bytes"] = rss;
  // Of it, memory shared with the clients (their gradient regions and the answers' slots, all
  // touched in the first steps and mapped to the end): 0 over the socket.
  (*out)["server_shared_rss_bytes"] = shared;
  (*out)["shards"] = pids.size();
}

}  // namespace

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "The dbs side of the data-plane benchmark: fake workers push and pull a model of --params "
      "floats through dbs_ps. Usually run by bench/dataplane.py.");
  absl::ParseCommandLine(argc, argv);
  dbs::SkipDeadlockDetection();
  Run run;
  run.clients = absl::GetFlag(FLAGS_clients);
  run.params = absl::GetFlag(FLAGS_params);
  run.warmup = absl::GetFlag(FLAGS_warmup);
  run.steps = absl::GetFlag(FLAGS_steps);
  std::vector<int> server_pids;
  if (!ParsePids(&server_pids)) return 2;
  if (run.clients < 1 || run.params < 1 || run.steps < 1 || run.warmup < 0 ||
      absl::GetFlag(FLAGS_tensors) < 1) {
    std::fprintf(stderr, "--clients, --params, --steps and --tensors must be >= 1\n");
    return 2;
  }
  run.layout = MakeLayout(run.params, absl::GetFlag(FLAGS_tensors));
  std::vector<ClientResult> results(run.clients);
  Barriers barriers(run.clients + 1);
  std::vector<std::thread> threads;
  for (int c = 0; c < run.clients; ++c) {
    threads.emplace_back([&, c] { RunClient(c, run, &barriers, &results[c]); });
  }
  barriers.start.Block();
  const ProcStat server_before = ServerStat(server_pids);
  const double self_before = SelfCpuSeconds();
  const absl::Time t0 = absl::Now();
  barriers.mid.Block();
  const ProcStat server_mid = ServerStat(server_pids);
  barriers.end.Block();
  const double wall = absl::ToDoubleSeconds(absl::Now() - t0);
  const double self_after = SelfCpuSeconds();
  const ProcStat server_after = ServerStat(server_pids);
  for (std::thread& t : threads) t.join();
  for (const ClientResult& r : results) {
    if (!r.status.ok()) {
      std::fprintf(stderr, "dataplane_client: %s\n", r.status.ToString().c_str());
      return 1;
    }
  }
  // A step ends for everyone when its slowest client gets its answer.
  const int steps = run.steps;
  std::vector<double> per_step(steps, 0.0);
  for (const ClientResult& r : results) {
    for (int s = 0; s < steps; ++s) per_step[s] = std::max(per_step[s], r.step_seconds[s]);
  }
  std::sort(per_step.begin(), per_step.end());
  nlohmann::json out = {
      {"params", run.params},
      {"clients", run.clients},
      {"steps", steps},
      {"step_ms_median", 1e3 * per_step[steps / 2]},
      {"step_ms_min", 1e3 * per_step.front()},
      {"step_ms_max", 1e3 * per_step.back()},
      {"wall_ms_per_step", 1e3 * wall / steps},
      {"client_cpu_ms_per_step", 1e3 * (self_after - self_before) / steps / run.clients},
  };
  if (!server_pids.empty()) {
    AddServerFigures(server_pids, steps, server_before, server_mid, server_after, &out);
  }
  std::printf("%s\n", out.dump().c_str());
  return 0;
}
