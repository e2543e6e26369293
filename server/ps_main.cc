// dbs_ps: the parameter server and DBS scheduler of a dbs training job.
//
// Flags are parsed here only; everything below main receives plain config structs.
#include <signal.h>
#include <unistd.h>

#include <cstdlib>
#include <iostream>
#include <map>
#include <memory>
#include <string>

#include "absl/flags/flag.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/cli.h"
#include "common/clock.h"
#include "common/files.h"
#include "common/malloc_tuning.h"
#include "common/shard_range.h"
#include "common/signal_watcher.h"
#include "common/status_macros.h"
#include "glog/logging.h"
#include "server/ps_server.h"

ABSL_FLAG(std::string, host, "127.0.0.1",
          "Address to listen on. The default takes workers on this machine only; 0.0.0.0 listens "
          "everywhere (use TLS and a job secret on a shared network).");
ABSL_FLAG(std::string, job_token, "",
          "The job's secret: RegisterWorker must carry it (dbs_worker --job_token). Prefer "
          "--job_token_file, which does not show in the process list.");
ABSL_FLAG(std::string, job_token_file, "", "A file holding the job's secret.");
ABSL_FLAG(std::string, tls_cert, "", "PEM certificate of this server: serve over TLS.");
ABSL_FLAG(std::string, tls_key, "", "PEM private key of --tls_cert.");
ABSL_FLAG(std::string, tls_client_ca, "",
          "PEM CA certificate: mutual TLS, every worker must present a certificate it signed.");
ABSL_FLAG(int, port, 50051, "Port to listen on; 0 picks a free port (see --port_file).");
ABSL_FLAG(std::string, port_file, "",
          "If set, the port actually bound is written to this file once the server is ready.");
ABSL_FLAG(std::string, shard, "0/1",
          "i/k: this process keeps shard i of the model's values split across k dbs_ps "
          "processes (docs/dataplane.md#shards). Shard 0 is the leader and hosts the scheduler; "
          "start shards 1..k-1 with --leader and the same training flags. Workers list every "
          "shard in --server, in order. 'ordinal/k' takes i from the host name's trailing -N "
          "(a Kubernetes StatefulSet pod's ordinal); shard 0 then ignores --leader.");
ABSL_FLAG(std::string, leader, "",
          "Shards 1..k-1: host:port of shard 0, which they follow (with the same --job_token "
          "and TLS files).");
ABSL_FLAG(int, workers, 1, "Number of workers the job waits for before epoch 0.");
ABSL_FLAG(int, epochs, 5, "Number of epochs to train.");
ABSL_FLAG(int, global_batch, 128, "Global batch size B (sum of all workers' batches per step).");
ABSL_FLAG(std::string, policy, "dbs",
          "Batch allocation: 'dbs' (each worker's measured step time as a function of its batch, "
          "balanced by a damped controller that converges; see docs/controller.md), "
          "'proportional' (the paper's rule: batch proportional to last epoch's speed) or "
          "'fixed' (equal split, plain S-SGD).");
ABSL_FLAG(std::string, fixed_split, "",
          "Policy 'fixed': each worker's weight by name, NAME:WEIGHT[,NAME:WEIGHT...] (e.g. "
          "gpu-a:3,gpu-b:1): a worker's share of every batch is its weight over the weights of "
          "the workers in the job, from the first epoch on; a weight may be 0. Workers with "
          "other names are refused. Empty: the equal split.");
ABSL_FLAG(int, min_batch, 0, "Policy 'dbs': smallest batch a worker is given.");
ABSL_FLAG(int, max_batch, 0, "Policy 'dbs': largest batch a worker is given (0: no limit).");
ABSL_FLAG(double, smoothing, 1.0,
          "EMA weight of the newest shares (1: none); older shares keep 1 - this.");
ABSL_FLAG(double, deadband, 0.0,
          "Keep the previous split unless some worker's share would move by more than this "
          "fraction (0: always move).");
ABSL_FLAG(int, speed_window, 1,
          "Policy 'proportional': take each worker's lowest speed over this many recent epochs "
          "(1: the paper's last-epoch rule).");
ABSL_FLAG(uint64_t, seed, 1, "Seed of the epochs' data permutations.");
ABSL_FLAG(std::string, optimizer, "sgd", "'sgd' (momentum, weight decay) or 'adam'.");
ABSL_FLAG(double, lr, 0.05, "Learning rate.");
ABSL_FLAG(double, momentum, 0.9, "SGD momentum.");
ABSL_FLAG(bool, nesterov, false, "Use Nesterov momentum with SGD.");
ABSL_FLAG(double, weight_decay, 0.0, "L2 weight decay (SGD and Adam).");
ABSL_FLAG(double, adam_beta1, 0.9, "Adam beta1.");
ABSL_FLAG(double, adam_beta2, 0.999, "Adam beta2.");
ABSL_FLAG(double, adam_eps, 1e-8, "Adam epsilon.");
ABSL_FLAG(std::string, summary_path, "dbs_summary.json",
          "Where the JSON run summary is written at the end ('' to skip).");
ABSL_FLAG(std::string, step_trace_path, "",
          "A JSON line per completed step ('' : none): each worker's samples, the compute it "
          "reported and its step as dbs_ps timed it (what DBS balances), to see the balance step "
          "by step, e.g. to line up a slowdown on one node with the plan's answer. A restored "
          "job appends to it (docs/deploying.md#the-step-trace).");
ABSL_FLAG(int, metrics_port, -1,
          "Port of the HTTP endpoint: /metrics (Prometheus), /status.json and a status page at "
          "/. -1: off; 0: any free port (see --metrics_port_file).");
ABSL_FLAG(std::string, metrics_host, "",
          "Address of the HTTP endpoint (default: the same as --host).");
ABSL_FLAG(std::string, metrics_port_file, "",
          "If set, the HTTP endpoint's port is written to this file once it serves.");
ABSL_FLAG(int, max_message_mb, 512,
          "Largest gRPC message accepted or sent, in MiB (as the workers'): at least the model "
          "in fp32 + 1 MiB (512 holds 130M parameters).");
ABSL_FLAG(int, memory_quota_mb, 4096,
          "Memory gRPC may hold for calls in flight, in MiB (at least 2 * --max_message_mb); "
          "past it new calls wait or fail instead of growing the server. Below one step's "
          "pushes (workers x the model on the wire) + 16 MiB the job can stall: dbs_ps warns.");
ABSL_FLAG(bool, shared_memory, true,
          "Share memory with workers on this host that ask (AttachSharedMemory): their "
          "gradients and answers pass through memory both processes map instead of the "
          "socket. Only processes of this user in this PID namespace can; others push over "
          "gRPC. Off: every worker pushes over gRPC (docs/dataplane.md#shared-memory).");
ABSL_FLAG(double, stall_timeout_s, 300.0,
          "Abort the job when no worker makes progress for this long (a worker died); 0: never.");
ABSL_FLAG(double, worker_timeout_s, 60.0,
          "A worker that has not pushed a step this long after the first push of that step is "
          "removed as dead and the job goes on without it; 0: never.");
ABSL_FLAG(int, max_workers_per_host, 64,
          "At most this many workers from one address (host) in the job at once, so that one "
          "host's registrations cannot fill the job's 1,024 places; 0: no limit.");
ABSL_FLAG(double, registration_idle_s, 60.0,
          "A worker that registered but was never planned, is not waiting for a plan and made "
          "no call for this long loses its registration (its place is freed); 0: never.");
ABSL_FLAG(int, replan_window_steps, -1,
          "Mid-epoch re-planning: judge the balance over this many recent steps and re-plan the "
          "rest of the epoch when it is off by --replan_threshold; -1: the policy's default (8 "
          "steps for dbs, off for proportional and fixed); 0: only at epoch boundaries (the "
          "paper's rule).");
ABSL_FLAG(double, replan_threshold, 1.15,
          "Re-plan mid-epoch when the slowest worker's recent step time (as this server observes "
          "it) is this many times the fastest's (and the gap is clear of the noise).");
ABSL_FLAG(double, noise_margin, dbs::kDefaultNoiseMargin,
          "dbs: standard deviations of each worker's per-step time added to its predicted step: "
          "a step waits for its slowest worker, so a noisy worker gets a little less; 0: balance "
          "the mean step times.");
ABSL_FLAG(std::string, wire_dtype, "fp32",
          "How each step's gradients and parameters travel: fp32, or bf16 / fp16 (half the "
          "bytes; the server still accumulates and keeps the parameters in fp32). Workers learn "
          "it when they register.");
ABSL_FLAG(bool, deterministic, true,
          "Sum each step's gradients in worker order whatever order they arrive in, so the same "
          "job gives bit-identical parameters run after run (a push that arrives early is held, "
          "not copied, until its turn); false: sum on arrival.");
ABSL_FLAG(std::string, faulty_gradients, "evict",
          "What a worker's faulty gradient meets (a GPU that corrupts results): a push with a "
          "value that is not finite or beyond 1e30, or whose L2 norm is more than "
          "--faulty_norm_ratio times the median of the last accepted pushes' norms. 'evict': not "
          "summed; the worker is quarantined (removed, its samples re-planned to the others) and "
          "the job goes on; 'log': a norm outlier is logged and summed, a bad value refuses the "
          "push; 'off': no norm screen, a bad value refuses the push.");
ABSL_FLAG(double, faulty_norm_ratio, 10.0,
          "With --faulty_gradients: how many times the median of the recent gradient norms a "
          "push's norm may be (> 1). Honest workers' norms vary with their batch sizes and the "
          "noise; lower values catch smaller corruptions and risk false alarms.");
ABSL_FLAG(std::string, checkpoint_dir, "",
          "Write checkpoints here (every --checkpoint_every_steps steps and every epoch end).");
ABSL_FLAG(int, checkpoint_every_steps, 50, "Steps between checkpoints.");
ABSL_FLAG(bool, restore, false,
          "Continue from the newest valid checkpoint in --checkpoint_dir (corrupt ones are "
          "refused and the previous one is used).");
ABSL_FLAG(bool, dry_run, false,
          "Check the flags and variables (read the files they name, check that the checkpoint "
          "folder and the summary can be written), say whether the configuration is valid and "
          "whether the job in --checkpoint_dir has finished, and exit (0 or 2) without serving.");
ABSL_FLAG(bool, restore_if_present, false,
          "Like --restore when --checkpoint_dir holds a valid checkpoint; start a new job when it "
          "holds none (for orchestrators that restart the same command).");
ABSL_FLAG(bool, restore_override, false,
          "With --restore: accept a checkpoint written with other training settings (learning "
          "rate, optimizer, policy knobs), which are otherwise refused.");
ABSL_FLAG(double, linger_s, 10.0,
          "After training, how long to wait for workers to leave (and for workers removed "
          "while cut off to call once more and hear the job is done), and how long the status "
          "page (--metrics_port) shows the final state, before shutting down.");

namespace {

// This machine's name: $HOSTNAME (a Kubernetes pod's name) when set, else gethostname().
std::string HostName() {
  if (const char* env = std::getenv("HOSTNAME"); env != nullptr && *env != '\0') return env;
  char name[256] = {};
  if (gethostname(name, sizeof(name) - 1) != 0) return "";
  return name;
}

dbs::OptimizerConfig OptimizerFromFlags() {
  dbs::OptimizerConfig o;
  o.name = absl::GetFlag(FLAGS_optimizer);
  o.sgd.lr = o.adam.lr = absl::GetFlag(FLAGS_lr);
  o.sgd.momentum = absl::GetFlag(FLAGS_momentum);
  o.sgd.nesterov = absl::GetFlag(FLAGS_nesterov);
  o.sgd.weight_decay = o.adam.weight_decay = absl::GetFlag(FLAGS_weight_decay);
  o.adam.beta1 = absl::GetFlag(FLAGS_adam_beta1);
  o.adam.beta2 = absl::GetFlag(FLAGS_adam_beta2);
  o.adam.eps = absl::GetFlag(FLAGS_adam_eps);
  return o;
}

// The job's flags: its workers and batches, the policy, the optimizer, timeouts, checkpoints,
// re-planning and the data plane.
absl::StatusOr<dbs::JobConfig> JobConfigFromFlags() {
  dbs::JobConfig job;
  job.scheduler.expected_workers = absl::GetFlag(FLAGS_workers);
  job.scheduler.epochs = absl::GetFlag(FLAGS_epochs);
  job.scheduler.global_batch = absl::GetFlag(FLAGS_global_batch);
  job.scheduler.seed = absl::GetFlag(FLAGS_seed);
  DBS_ASSIGN_OR_RETURN(job.policy, dbs::ParsePolicy(absl::GetFlag(FLAGS_policy)));
  job.speed_window = absl::GetFlag(FLAGS_speed_window);
  job.min_batch = absl::GetFlag(FLAGS_min_batch);
  job.max_batch = absl::GetFlag(FLAGS_max_batch);
  job.smoothing = absl::GetFlag(FLAGS_smoothing);
  job.deadband = absl::GetFlag(FLAGS_deadband);
  DBS_ASSIGN_OR_RETURN(job.fixed_split, dbs::ParseFixedSplit(absl::GetFlag(FLAGS_fixed_split)));
  job.optimizer = OptimizerFromFlags();
  job.stall_timeout = absl::Seconds(absl::GetFlag(FLAGS_stall_timeout_s));
  job.worker_timeout = absl::Seconds(absl::GetFlag(FLAGS_worker_timeout_s));
  job.scheduler.max_workers_per_source = absl::GetFlag(FLAGS_max_workers_per_host);
  job.scheduler.registration_idle = absl::Seconds(absl::GetFlag(FLAGS_registration_idle_s));
  job.checkpoint_dir = absl::GetFlag(FLAGS_checkpoint_dir);
  job.checkpoint_every_steps = absl::GetFlag(FLAGS_checkpoint_every_steps);
  job.replan_window_steps = absl::GetFlag(FLAGS_replan_window_steps);
  job.replan_threshold = absl::GetFlag(FLAGS_replan_threshold);
  job.noise_margin = absl::GetFlag(FLAGS_noise_margin);
  DBS_ASSIGN_OR_RETURN(job.wire_dtype, dbs::ParseWireDtype(absl::GetFlag(FLAGS_wire_dtype)));
  job.deterministic = absl::GetFlag(FLAGS_deterministic);
  DBS_ASSIGN_OR_RETURN(job.screen.mode,
                       dbs::ParseFaultyGradients(absl::GetFlag(FLAGS_faulty_gradients)));
  job.screen.norm_ratio = absl::GetFlag(FLAGS_faulty_norm_ratio);
  return job;
}

// Which shard this is and its leader, the job's credential and the TLS files.
absl::Status ReadShardAndSecurityFlags(dbs::ServerConfig* c) {
  const std::string shard_flag = absl::GetFlag(FLAGS_shard);
  using Shard = std::pair<int, int>;  // this shard, how many
  DBS_ASSIGN_OR_RETURN(Shard shard, dbs::ParseShard(shard_flag, HostName()));
  c->shard = shard.first;
  c->num_shards = shard.second;
  c->leader = absl::GetFlag(FLAGS_leader);
  // Every pod of a StatefulSet gets the same flags: the one that turns out to lead ignores
  // --leader (which names it).
  if (absl::StartsWith(shard_flag, "ordinal/") && c->shard == 0) c->leader.clear();
  DBS_ASSIGN_OR_RETURN(c->job_token,
                       dbs::SecretFrom(absl::GetFlag(FLAGS_job_token),
                                       absl::GetFlag(FLAGS_job_token_file), "--job_token"));
  return dbs::ReadFilesInto({{absl::GetFlag(FLAGS_tls_cert), &c->tls_cert_pem},
                             {absl::GetFlag(FLAGS_tls_key), &c->tls_key_pem},
                             {absl::GetFlag(FLAGS_tls_client_ca), &c->tls_client_ca_pem}});
}

// Every flag is read here; ValidateServerConfig checks them all in one place.
absl::StatusOr<dbs::ServerConfig> ServerConfigFromFlags() {
  dbs::ServerConfig c;
  DBS_ASSIGN_OR_RETURN(c.job, JobConfigFromFlags());
  c.host = absl::GetFlag(FLAGS_host);
  c.port = absl::GetFlag(FLAGS_port);
  c.port_file = absl::GetFlag(FLAGS_port_file);
  c.max_message_mb = absl::GetFlag(FLAGS_max_message_mb);
  c.metrics_port = absl::GetFlag(FLAGS_metrics_port);
  c.metrics_host = absl::GetFlag(FLAGS_metrics_host);
  c.metrics_port_file = absl::GetFlag(FLAGS_metrics_port_file);
  c.memory_quota_mb = absl::GetFlag(FLAGS_memory_quota_mb);
  c.shared_memory = absl::GetFlag(FLAGS_shared_memory);
  c.release_freed_memory = [] { dbs::ReleaseFreedMemory(); };
  c.summary_path = absl::GetFlag(FLAGS_summary_path);
  c.step_trace_path = absl::GetFlag(FLAGS_step_trace_path);
  c.restore = absl::GetFlag(FLAGS_restore);
  c.restore_if_present = absl::GetFlag(FLAGS_restore_if_present);
  c.restore_override = absl::GetFlag(FLAGS_restore_override);
  c.linger = absl::Seconds(absl::GetFlag(FLAGS_linger_s));
  DBS_RETURN_IF_ERROR(ReadShardAndSecurityFlags(&c));
  return c;
}

int Fail(const absl::Status& status, int code) {
  std::cerr << "dbs_ps: " << status.message() << std::endl;
  return code;
}

// How a run that ended with `result` exits (docs/deploying.md#exit-codes).
int ExitCodeOfRun(const absl::Status& result, int signal) {
  if (signal == SIGTERM) return dbs::kExitTerminated;
  if (signal == SIGINT) return dbs::kExitInterrupted;
  if (absl::IsDeadlineExceeded(result)) return dbs::kExitStalled;
  return dbs::ExitCodeFor(result);
}

}  // namespace

int main(int argc, char** argv) {
  dbs::ParseCommandLine(
      argc, argv,
      "dbs_ps: parameter server and Dynamic Batch Size scheduler.\n"
      "Example: dbs_ps --port=50051 --workers=4 --epochs=5 --global_batch=128 --policy=dbs",
      "ps_main.cc");
  FLAGS_logtostderr = true;
  dbs::SkipDeadlockDetection();
  dbs::KeepFreedMemoryMapped();
  google::InitGoogleLogging(argv[0]);
  // Before any thread starts, so that only the watcher receives them.
  dbs::SignalWatcher::Block();

  absl::StatusOr<dbs::ServerConfig> config = ServerConfigFromFlags();
  if (!config.ok()) return Fail(config.status(), dbs::kExitBadConfig);
  if (const absl::Status valid = dbs::ValidateServerConfig(*config); !valid.ok()) {
    return Fail(valid, dbs::kExitBadConfig);
  }
  if (const absl::Status files = dbs::CheckServerFiles(*config); !files.ok()) {
    return Fail(files, dbs::kExitBadConfig);
  }
  // A restart on a finished job's checkpoints (an orchestrator's, a second `docker-compose up`)
  // has nothing to do: it says so and succeeds, leaving the summary as it is.
  const absl::StatusOr<std::string> finished = dbs::FinishedJob(*config);
  if (absl::GetFlag(FLAGS_dry_run)) {
    std::cout << "dbs_ps: configuration ok"
              << (finished.ok() ? absl::StrCat("; ", *finished, ", so dbs_ps would exit 0 at once")
                                : "")
              << std::endl;
    return dbs::kExitOk;
  }
  if (finished.ok()) {
    std::cout << "dbs_ps: " << *finished << std::endl;
    return dbs::kExitOk;
  }
  const dbs::RealClock clock;
  absl::StatusOr<std::unique_ptr<dbs::PsServer>> server = dbs::PsServer::Start(*config, &clock);
  if (!server.ok()) return Fail(server.status(), dbs::ExitCodeFor(server.status()));
  absl::Status result;
  int signal = 0;
  {
    dbs::SignalWatcher signals([s = server->get()](int sig) {
      LOG(WARNING) << "received " << (sig == SIGINT ? "SIGINT" : "SIGTERM") << ", stopping";
      s->Stop(absl::CancelledError(absl::StrCat("dbs_ps stopped by signal ", sig)));
    });
    result = (*server)->Run(std::cout);
    signal = signals.received();
  }
  if (!result.ok()) LOG(ERROR) << "training did not finish: " << result;
  return ExitCodeOfRun(result, signal);
}
