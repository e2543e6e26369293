// dbs_ps: the parameter server and DBS scheduler of a dbs training job.
//
// Flags are parsed here only; everything below main receives plain config structs.
#include <signal.h>

#include <cstdio>
#include <iostream>
#include <memory>
#include <string>
#include <thread>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "common/flags_help.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/clock.h"
#include "common/files.h"
#include "glog/logging.h"
#include "grpcpp/grpcpp.h"
#include "server/checkpoint.h"
#include "server/parameter_service.h"
#include "server/run_summary.h"
#include "server/scheduler_service.h"
#include "server/training_job.h"

ABSL_FLAG(std::string, host, "0.0.0.0", "Address to listen on.");
ABSL_FLAG(int, port, 50051, "Port to listen on; 0 picks a free port (see --port_file).");
ABSL_FLAG(std::string, port_file, "",
          "If set, the port actually bound is written to this file once the server is ready.");
ABSL_FLAG(int, workers, 1, "Number of workers the job waits for before epoch 0.");
ABSL_FLAG(int, epochs, 5, "Number of epochs to train.");
ABSL_FLAG(int, global_batch, 128, "Global batch size B (sum of all workers' batches per step).");
ABSL_FLAG(std::string, policy, "dbs",
          "Batch allocation: 'dbs' (each worker's measured step time as a function of its batch, "
          "balanced by a damped controller that converges; see docs/controller.md), "
          "'proportional' (the paper's rule: batch proportional to last epoch's speed) or "
          "'fixed' (equal split, plain S-SGD).");
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
ABSL_FLAG(int, max_message_mb, 512, "Largest gRPC message accepted or sent, in MiB.");
ABSL_FLAG(double, stall_timeout_s, 300.0,
          "Abort the job when no worker makes progress for this long (a worker died); 0: never.");
ABSL_FLAG(double, worker_timeout_s, 60.0,
          "A worker that has not pushed a step this long after the first push of that step is "
          "removed as dead and the job goes on without it; 0: never.");
ABSL_FLAG(int, replan_window_steps, -1,
          "Mid-epoch re-planning: judge the balance over this many recent steps and re-plan the "
          "rest of the epoch when it is off by --replan_threshold; -1: the policy's default (8 "
          "steps for dbs, off for proportional and fixed); 0: only at epoch boundaries (the "
          "paper's rule).");
ABSL_FLAG(double, replan_threshold, 1.15,
          "Re-plan mid-epoch when the slowest worker's recent compute time is this many times "
          "the fastest's (and the gap is clear of the noise).");
ABSL_FLAG(std::string, checkpoint_dir, "",
          "Write checkpoints here (every --checkpoint_every_steps steps and every epoch end).");
ABSL_FLAG(int, checkpoint_every_steps, 50, "Steps between checkpoints.");
ABSL_FLAG(bool, restore, false,
          "Continue from the newest valid checkpoint in --checkpoint_dir (corrupt ones are "
          "refused and the previous one is used).");
ABSL_FLAG(double, linger_s, 10.0,
          "After training, how long to wait for workers to leave before shutting down.");

namespace {

// Blocks SIGINT and SIGTERM in every thread; a dedicated thread receives them with sigwait.
sigset_t BlockTerminationSignals() {
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGINT);
  sigaddset(&set, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &set, nullptr);
  return set;
}

int Fail(const std::string& message) {
  std::cerr << "dbs_ps: " << message << std::endl;
  return 2;
}

}  // namespace

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "dbs_ps: parameter server and Dynamic Batch Size scheduler.\n"
      "Example: dbs_ps --port=50051 --workers=4 --epochs=5 --global_batch=128 --policy=dbs");
  dbs::HelpListsFlagsOf("ps_main.cc");
  absl::ParseCommandLine(argc, argv);
  FLAGS_logtostderr = true;
  google::InitGoogleLogging(argv[0]);
  const sigset_t signals = BlockTerminationSignals();

  dbs::JobConfig config;
  config.scheduler.expected_workers = absl::GetFlag(FLAGS_workers);
  config.scheduler.epochs = absl::GetFlag(FLAGS_epochs);
  config.scheduler.global_batch = absl::GetFlag(FLAGS_global_batch);
  config.scheduler.seed = absl::GetFlag(FLAGS_seed);
  absl::StatusOr<dbs::PolicyKind> policy = dbs::ParsePolicy(absl::GetFlag(FLAGS_policy));
  if (!policy.ok()) return Fail(absl::StrCat("--policy: ", policy.status().message()));
  config.policy = *policy;
  config.speed_window = absl::GetFlag(FLAGS_speed_window);
  config.min_batch = absl::GetFlag(FLAGS_min_batch);
  config.max_batch = absl::GetFlag(FLAGS_max_batch);
  config.smoothing = absl::GetFlag(FLAGS_smoothing);
  config.deadband = absl::GetFlag(FLAGS_deadband);
  config.optimizer.name = absl::GetFlag(FLAGS_optimizer);
  config.optimizer.sgd.lr = config.optimizer.adam.lr = absl::GetFlag(FLAGS_lr);
  config.optimizer.sgd.momentum = absl::GetFlag(FLAGS_momentum);
  config.optimizer.sgd.nesterov = absl::GetFlag(FLAGS_nesterov);
  config.optimizer.sgd.weight_decay = config.optimizer.adam.weight_decay =
      absl::GetFlag(FLAGS_weight_decay);
  config.optimizer.adam.beta1 = absl::GetFlag(FLAGS_adam_beta1);
  config.optimizer.adam.beta2 = absl::GetFlag(FLAGS_adam_beta2);
  config.optimizer.adam.eps = absl::GetFlag(FLAGS_adam_eps);
  config.stall_timeout = absl::Seconds(absl::GetFlag(FLAGS_stall_timeout_s));
  config.worker_timeout = absl::Seconds(absl::GetFlag(FLAGS_worker_timeout_s));
  config.checkpoint_dir = absl::GetFlag(FLAGS_checkpoint_dir);
  config.checkpoint_every_steps = absl::GetFlag(FLAGS_checkpoint_every_steps);
  if (config.checkpoint_every_steps < 1) return Fail("--checkpoint_every_steps must be >= 1");
  if (absl::GetFlag(FLAGS_restore) && config.checkpoint_dir.empty()) {
    return Fail("--restore needs --checkpoint_dir");
  }
  config.replan_window_steps = absl::GetFlag(FLAGS_replan_window_steps);
  config.replan_threshold = absl::GetFlag(FLAGS_replan_threshold);
  if (config.replan_window_steps < -1 || !(config.replan_threshold > 1.0)) {
    return Fail("--replan_window_steps must be >= -1 and --replan_threshold > 1");
  }
  const int port = absl::GetFlag(FLAGS_port);
  const int max_message_mb = absl::GetFlag(FLAGS_max_message_mb);
  if (port < 0 || port > 65535) return Fail("--port must be in [0, 65535]");
  if (max_message_mb < 1 || max_message_mb > 2047) {
    return Fail("--max_message_mb must be in [1, 2047]");
  }

  dbs::RealClock clock;
  absl::StatusOr<std::unique_ptr<dbs::TrainingJob>> job = dbs::TrainingJob::Create(config, &clock);
  if (!job.ok()) return Fail(absl::StrCat("bad configuration: ", job.status().message()));

  if (absl::GetFlag(FLAGS_restore)) {
    std::vector<std::string> refused;
    std::string path;
    absl::StatusOr<dbs::JobState> state =
        dbs::LoadNewestCheckpoint(config.checkpoint_dir, &refused, &path);
    for (const std::string& r : refused) LOG(ERROR) << "refusing checkpoint " << r;
    if (!state.ok()) return Fail(std::string(state.status().message()));
    absl::Status restored = (*job)->Restore(*state);
    if (!restored.ok()) return Fail(std::string(restored.message()));
    LOG(INFO) << "restored " << path << ": epoch " << state->aggregator.epoch + 1 << ", step "
              << state->aggregator.step + 1 << ", parameter version "
              << state->aggregator.store.version;
  }

  dbs::SchedulerServiceImpl scheduler_service((*job)->scheduler());
  dbs::Scheduler* scheduler = (*job)->scheduler();
  dbs::TrainingJob* job_ptr = job->get();
  dbs::ParameterServiceImpl parameter_service(
      (*job)->store(), (*job)->aggregator(),
      [scheduler](int id) { return scheduler->IsRegistered(id); },
      [job_ptr](int id) { return job_ptr->Resume(id); });

  const std::string address = absl::StrCat(absl::GetFlag(FLAGS_host), ":", port);
  int bound_port = 0;
  grpc::ServerBuilder builder;
  builder.AddListeningPort(address, grpc::InsecureServerCredentials(), &bound_port);
  builder.SetMaxReceiveMessageSize(max_message_mb << 20);
  builder.SetMaxSendMessageSize(max_message_mb << 20);
  builder.RegisterService(&scheduler_service);
  builder.RegisterService(&parameter_service);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (server == nullptr || bound_port == 0) {
    return Fail(absl::StrCat("cannot listen on ", address, " (in use, or not a local address?)"));
  }
  const std::string port_file = absl::GetFlag(FLAGS_port_file);
  if (!port_file.empty()) {
    absl::Status written = dbs::WriteFileAtomic(port_file, absl::StrCat(bound_port, "\n"));
    if (!written.ok()) return Fail(std::string(written.message()));
  }
  LOG(INFO) << "dbs_ps listening on " << absl::GetFlag(FLAGS_host) << ":" << bound_port
            << ", waiting for " << config.scheduler.expected_workers << " workers; "
            << config.scheduler.epochs << " epochs, global batch "
            << config.scheduler.global_batch << ", policy " << dbs::PolicyName(config.policy);

  std::thread signal_thread([&signals, job = job->get()]() {
    int sig = 0;
    if (sigwait(&signals, &sig) == 0) {
      LOG(WARNING) << "received " << (sig == SIGINT ? "SIGINT" : "SIGTERM") << ", stopping";
      job->Abort(absl::CancelledError(absl::StrCat("dbs_ps stopped by signal ", sig)));
    }
  });
  signal_thread.detach();

  while (!(*job)->WaitFor(absl::Milliseconds(250))) {
    (*job)->CheckDeadWorkers();
    (*job)->CheckStall();
  }
  const absl::Status result = (*job)->Wait();
  const dbs::RunInfo run = (*job)->Run();
  const std::string summary_path = absl::GetFlag(FLAGS_summary_path);
  if (!summary_path.empty()) {
    absl::Status written =
        dbs::WriteFileAtomic(summary_path, dbs::BuildSummary(run).dump(2) + "\n");
    if (written.ok()) {
      LOG(INFO) << "summary written to " << summary_path;
    } else {
      LOG(ERROR) << written.message();
    }
  }
  std::cout << dbs::HumanSummary(run) << std::flush;

  // Let workers fetch their final plan and leave, then release anything still waiting.
  const absl::Time linger_until = absl::Now() + absl::Seconds(absl::GetFlag(FLAGS_linger_s));
  while (result.ok() && scheduler->active_workers() > 0 && absl::Now() < linger_until) {
    absl::SleepFor(absl::Milliseconds(50));
  }
  (*job)->Abort(absl::UnavailableError("dbs_ps is shutting down"));
  server->Shutdown(absl::ToChronoTime(absl::Now() + absl::Seconds(2)));
  if (!result.ok()) {
    LOG(ERROR) << "training did not finish: " << result;
    return 1;
  }
  return 0;
}
