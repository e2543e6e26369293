// dbs_worker: one training worker of a dbs job. Flags are parsed here only.
#include <sched.h>
#include <signal.h>
#include <unistd.h>

#include <iostream>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "common/cli.h"
#include "common/clock.h"
#include "common/cpu_limit.h"
#include "common/files.h"
#include "common/signal_watcher.h"
#include "common/status_macros.h"
#include "worker/dataset.h"
#include "worker/emulation.h"
#include "worker/grpc_ps_client.h"
#include "worker/sharded_ps_client.h"
#include "worker/torch_learner.h"
#include "worker/training_loop.h"

ABSL_FLAG(std::string, server, "127.0.0.1:50051",
          "Address of dbs_ps (host:port); for a sharded job every shard's, comma-separated, "
          "shard 0 first.");
ABSL_FLAG(std::string, name, "", "Worker name, unique in the job (default host:pid).");
ABSL_FLAG(std::string, model, "cnn",
          "Model to train: 'cnn', 'mlp', or the path of a TorchScript file saved from Python "
          "(torch.jit.script(model).save(path)); docs/models.md.");
ABSL_FLAG(std::string, loss, "auto",
          "cross_entropy, nll (TorchScript models), mse, or auto: a TorchScript module's own "
          "loss(output, target) method when it has one, else cross_entropy for class labels and "
          "mse for real-valued targets.");
ABSL_FLAG(std::string, export_path, "",
          "Write the trained model here at the end of the job (a TorchScript model: the same "
          "module, for torch.jit.load; a built-in: a state dict for torch.load).");
ABSL_FLAG(int, export_every_epochs, 0, "Also export every N epochs (0: only at the end).");
ABSL_FLAG(std::string, device, "auto", "'auto' (CUDA when available), 'cpu' or 'cuda'.");
ABSL_FLAG(std::string, data, "fashion-mnist",
          "The data: fashion-mnist[:DIR], idx:DIR (MNIST-family IDX files), cifar10:DIR (the "
          "binary version), or npy:TRAIN_X.npy,TRAIN_Y.npy[,TEST_X.npy,TEST_Y.npy] (memory-mapped; "
          "int64 labels or float32 targets); docs/data.md.");
ABSL_FLAG(std::string, data_dir, dbs::kDefaultFashionMnistDir,
          "Folder of --data=fashion-mnist (the IDX files, gzipped or not).");
ABSL_FLAG(std::string, normalize, "auto",
          "Per-channel standardisation of the inputs (bytes are first scaled to [0, 1]): auto "
          "(the data set's own statistics when known, else the training inputs' for bytes, else "
          "none), none, train (the training inputs'), or MEAN/STD such as 0.49,0.48,0.45/"
          "0.25,0.24,0.26.");
ABSL_FLAG(int64_t, train_limit, 0, "Use only the first N training samples (0: all).");
ABSL_FLAG(int64_t, test_limit, 0, "Use only the first N test samples (0: all).");
ABSL_FLAG(double, slowdown, 1.0,
          "Emulate a slower worker: each step's compute takes this many times longer (>= 1).");
ABSL_FLAG(std::string, slow_windows, "",
          "Extra slowdown while training, like a background job: 'e<begin>:<end>:<factor>' "
          "(epochs) or 's<begin>:<end>:<factor>' (global steps), ';'-separated, e.g. e2:4:3.");
ABSL_FLAG(std::string, corrupt_gradient, "",
          "Testing: emulate a faulty GPU from this worker's Nth step on (counted over the job "
          "from 0): 'nan@N' every value NaN, 'scale:F@N' every value times F, 'sign@N' negated, "
          "'bitflip@N' one random bit flipped in about one value in a thousand (drawn from --seed "
          "and the step). dbs_ps "
          "--faulty_gradients decides what the job does about it.");
ABSL_FLAG(std::string, slowdown_of, "cpu",
          "What the slowdown multiplies: 'cpu', the step's CPU time (the computation ends that "
          "many times its CPU time after it began, as on a slower core of its own; time spent "
          "waiting for a core that other emulated workers hold counts inside it), or 'wall', "
          "its elapsed time (a worker held to a CPU quota, whose waiting is its own "
          "throttling).");
ABSL_FLAG(int, threads, 1, "libtorch intra-op threads on CPU.");
ABSL_FLAG(std::string, cpu_limit, "auto",
          "The CPU limit this worker runs under, in cores: 'auto' reads its cgroup's CFS quota "
          "(Kubernetes CPU limits, docker --cpus), 'none' ignores any, or a number. Under a limit "
          "a step costs at least its CPU time divided by the limit, which is what the worker "
          "reports (docs/controller.md#cpu-limits).");
ABSL_FLAG(int, max_batch, 0,
          "The largest batch this worker computes at once (its memory). A larger planned batch is "
          "computed as micro-batches whose mean gradient is pushed, so the server plans on speed "
          "alone; 0: no limit.");
ABSL_FLAG(std::string, init_params, "",
          "Optional file of raw float32 initial parameters in the model's order (for comparing "
          "against another framework from the same start).");
ABSL_FLAG(int64_t, measure_speed_samples, 0,
          "If > 0, do not train: measure standalone compute speed over this many samples, print "
          "it as JSON and exit.");
ABSL_FLAG(std::vector<std::string>, measure_batch, {"32"},
          "Batch size(s) of --measure_speed_samples, comma-separated: one measurement each "
          "(a step-time curve), printed as 'curve'.");
ABSL_FLAG(uint64_t, seed, 1, "Seed of the initial parameters (the first worker's are used).");
ABSL_FLAG(double, log_every_s, 5.0, "Seconds between progress lines.");
ABSL_FLAG(double, connect_timeout_s, 60.0,
          "How long to keep retrying (with backoff) while dbs_ps is unreachable.");
ABSL_FLAG(bool, dry_run, false,
          "Check the flags and variables, the files they name (the token and TLS files), the "
          "data and the model (loaded, and run on two samples) and that --export_path can be "
          "written; say whether the configuration is valid, and exit (0 or 2) without "
          "connecting.");
ABSL_FLAG(double, call_timeout_s, 60.0,
          "Deadline of one attempt of any call to dbs_ps. A call that answers at once is retried "
          "after it (within --connect_timeout_s); a call that waits for the other workers is "
          "asked again.");
ABSL_FLAG(double, max_wait_s, 0.0,
          "Longest total wait for a step or the next epoch's plan; 0: no limit (dbs_ps's own "
          "timeouts end a job that cannot go on).");
ABSL_FLAG(int, max_message_mb, 512,
          "Largest gRPC message sent or accepted, in MiB (as dbs_ps's): at least the model in "
          "fp32 + 1 MiB (512 holds 130M parameters).");
ABSL_FLAG(bool, shared_memory, true,
          "On dbs_ps's own host, push each step's gradient and read its answer through "
          "memory shared with dbs_ps instead of the socket (fewer copies; checked with the "
          "server at the first push, and pushes go over gRPC where it cannot be shared). Off: "
          "always over gRPC.");
ABSL_FLAG(std::string, record_path, "", "Optional JSON record of this worker's epochs.");
ABSL_FLAG(std::string, job_token, "",
          "The job's secret, when dbs_ps requires one (prefer --job_token_file).");
ABSL_FLAG(std::string, job_token_file, "", "A file holding the job's secret.");
ABSL_FLAG(std::string, tls_ca, "",
          "PEM CA certificate that signed the server's certificate: connect over TLS.");
ABSL_FLAG(std::string, tls_cert, "",
          "PEM certificate of this worker, for a server that requires mutual TLS.");
ABSL_FLAG(std::string, tls_key, "", "PEM private key of --tls_cert.");

namespace {

struct WorkerConfig {
  dbs::LearnerConfig learner;
  dbs::LoopConfig loop;
  dbs::GrpcClientConfig client;
  int64_t measure_speed_samples = 0;
  std::vector<int> measure_batches = {32};
  // An emulated slower worker (--slowdown, --slow_windows, --slowdown_of): the learner is
  // wrapped in a SlowedLearner when the schedule ever slows it.
  dbs::SlowdownSchedule slowdown;
  dbs::SlowdownOf slowdown_of = dbs::SlowdownOf::kCpu;
};

absl::Status EmulationFromFlags(WorkerConfig* c) {
  absl::StatusOr<dbs::SlowdownSchedule> slowdown = dbs::SlowdownSchedule::Create(
      absl::GetFlag(FLAGS_slowdown), absl::GetFlag(FLAGS_slow_windows));
  if (!slowdown.ok()) return slowdown.status();
  c->slowdown = *slowdown;
  dbs::LoopConfig* loop = &c->loop;
  absl::StatusOr<dbs::GradientFault> fault =
      dbs::GradientFault::Parse(absl::GetFlag(FLAGS_corrupt_gradient));
  if (!fault.ok()) return fault.status();
  loop->fault = *fault;
  loop->fault.seed = absl::GetFlag(FLAGS_seed);
  absl::StatusOr<dbs::SlowdownOf> of = dbs::ParseSlowdownOf(absl::GetFlag(FLAGS_slowdown_of));
  if (!of.ok()) return of.status();
  c->slowdown_of = *of;
  return absl::OkStatus();
}

// --cpu_limit in cores (0: none in effect).
absl::StatusOr<double> CpuLimitFromFlags() {
  const std::string flag = absl::GetFlag(FLAGS_cpu_limit);
  cpu_set_t set;
  const int cpus = sched_getaffinity(0, sizeof(set), &set) == 0 ? CPU_COUNT(&set) : 0;
  if (flag == "none") return 0.0;
  if (flag == "auto") {
    absl::StatusOr<double> limit = dbs::CgroupCpuLimitCores();
    if (!limit.ok()) {
      return absl::FailedPreconditionError(
          absl::StrCat(limit.status().message(), "; pass --cpu_limit=CORES or --cpu_limit=none"));
    }
    return dbs::EffectiveCpuLimit(*limit, cpus);
  }
  double cores = 0.0;
  if (!absl::SimpleAtod(flag, &cores) || !(cores > 0) || cores > dbs::kMaxCpuLimitCores) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--cpu_limit must be 'auto', 'none' or a number of cores > 0, not '", flag, "'"));
  }
  return dbs::EffectiveCpuLimit(cores, cpus);
}

// Every flag's check lives here: main only composes what these return.
absl::StatusOr<dbs::LearnerConfig> LearnerConfigFromFlags() {
  dbs::LearnerConfig c;
  c.model = absl::GetFlag(FLAGS_model);
  c.loss = absl::GetFlag(FLAGS_loss);
  c.device = absl::GetFlag(FLAGS_device);
  c.data = absl::GetFlag(FLAGS_data);
  c.data_dir = absl::GetFlag(FLAGS_data_dir);
  c.normalize = absl::GetFlag(FLAGS_normalize);
  c.train_limit = absl::GetFlag(FLAGS_train_limit);
  c.test_limit = absl::GetFlag(FLAGS_test_limit);
  c.threads = absl::GetFlag(FLAGS_threads);
  c.seed = absl::GetFlag(FLAGS_seed);
  c.init_params_path = absl::GetFlag(FLAGS_init_params);
  if (c.threads < 1) return absl::InvalidArgumentError("--threads must be >= 1");
  if (c.train_limit < 0 || c.test_limit < 0) {
    return absl::InvalidArgumentError("--train_limit and --test_limit must be >= 0");
  }
  return c;
}

// The connection to dbs_ps: address, deadlines, message and chunk sizes, secret and TLS.
absl::StatusOr<dbs::GrpcClientConfig> ClientConfigFromFlags() {
  dbs::GrpcClientConfig c;
  c.address = absl::GetFlag(FLAGS_server);
  c.connect_timeout = absl::Seconds(absl::GetFlag(FLAGS_connect_timeout_s));
  const double call_timeout_s = absl::GetFlag(FLAGS_call_timeout_s);
  const double max_wait_s = absl::GetFlag(FLAGS_max_wait_s);
  if (!(call_timeout_s > 0)) return absl::InvalidArgumentError("--call_timeout_s must be > 0");
  if (!(max_wait_s >= 0)) return absl::InvalidArgumentError("--max_wait_s must be >= 0");
  c.call_timeout = absl::Seconds(call_timeout_s);
  c.max_wait = absl::Seconds(max_wait_s);
  c.max_message_mb = absl::GetFlag(FLAGS_max_message_mb);
  if (c.max_message_mb < 1 || c.max_message_mb > 2047) {
    return absl::InvalidArgumentError("--max_message_mb must be in [1, 2047]");
  }
  c.shared_memory = absl::GetFlag(FLAGS_shared_memory);
  absl::StatusOr<std::string> secret = dbs::SecretFrom(
      absl::GetFlag(FLAGS_job_token), absl::GetFlag(FLAGS_job_token_file), "--job_token");
  if (!secret.ok()) return secret.status();
  c.job_token = *secret;
  absl::Status pems = dbs::ReadFilesInto({{absl::GetFlag(FLAGS_tls_ca), &c.tls_ca_pem},
                                          {absl::GetFlag(FLAGS_tls_cert), &c.tls_cert_pem},
                                          {absl::GetFlag(FLAGS_tls_key), &c.tls_key_pem}});
  if (!pems.ok()) return pems;
  if (c.tls_cert_pem.empty() != c.tls_key_pem.empty()) {
    return absl::InvalidArgumentError("--tls_cert and --tls_key go together");
  }
  if (!c.tls_cert_pem.empty() && c.tls_ca_pem.empty()) {
    return absl::InvalidArgumentError("--tls_cert needs --tls_ca (the CA of the server)");
  }
  return c;
}

absl::StatusOr<WorkerConfig> WorkerConfigFromFlags() {
  WorkerConfig c;
  absl::StatusOr<dbs::LearnerConfig> learner = LearnerConfigFromFlags();
  if (!learner.ok()) return learner.status();
  c.learner = *learner;

  c.loop.name = absl::GetFlag(FLAGS_name);
  if (c.loop.name.empty()) {
    char host[256] = {0};
    gethostname(host, sizeof(host) - 1);
    c.loop.name = absl::StrCat(host, ":", getpid());
  }
  c.loop.model = c.learner.model;
  DBS_RETURN_IF_ERROR(EmulationFromFlags(&c));
  absl::StatusOr<double> cpu_limit = CpuLimitFromFlags();
  if (!cpu_limit.ok()) return cpu_limit.status();
  c.loop.cpu_limit_cores = *cpu_limit;
  c.loop.max_batch = absl::GetFlag(FLAGS_max_batch);
  if (c.loop.max_batch < 0) return absl::InvalidArgumentError("--max_batch must be >= 0");
  const double log_every_s = absl::GetFlag(FLAGS_log_every_s);
  if (!(log_every_s > 0)) return absl::InvalidArgumentError("--log_every_s must be > 0");
  c.loop.log_every = absl::Seconds(log_every_s);
  c.loop.record_path = absl::GetFlag(FLAGS_record_path);
  c.loop.export_path = absl::GetFlag(FLAGS_export_path);
  c.loop.export_every_epochs = absl::GetFlag(FLAGS_export_every_epochs);
  if (c.loop.export_every_epochs < 0) {
    return absl::InvalidArgumentError("--export_every_epochs must be >= 0");
  }
  if (c.loop.export_every_epochs > 0 && c.loop.export_path.empty()) {
    return absl::InvalidArgumentError("--export_every_epochs needs --export_path");
  }
  // Found now, not after the whole job.
  if (!c.loop.export_path.empty()) {
    DBS_RETURN_IF_ERROR(dbs::CheckWritable(c.loop.export_path, "--export_path"));
  }
  if (!c.loop.record_path.empty()) {
    DBS_RETURN_IF_ERROR(dbs::CheckWritable(c.loop.record_path, "--record_path"));
  }

  absl::StatusOr<dbs::GrpcClientConfig> client = ClientConfigFromFlags();
  if (!client.ok()) return client.status();
  c.client = *client;
  c.measure_speed_samples = absl::GetFlag(FLAGS_measure_speed_samples);
  c.measure_batches.clear();
  for (const std::string& b : absl::GetFlag(FLAGS_measure_batch)) {
    int batch = 0;
    if (!absl::SimpleAtoi(b, &batch) || batch < 1) {
      return absl::InvalidArgumentError(
          absl::StrCat("--measure_batch: '", b, "' is not a batch size (an integer >= 1)"));
    }
    c.measure_batches.push_back(batch);
  }
  if (c.measure_speed_samples > 0 && c.measure_batches.empty()) {
    return absl::InvalidArgumentError("--measure_batch must name at least one batch size");
  }
  return c;
}

int Fail(const std::string& who, const absl::Status& status, int code) {
  std::cerr << who << ": " << status.message() << std::endl;
  return code;
}

// torchrun's convention: MASTER_ADDR (and MASTER_PORT, else 50051) name the server when
// neither --server nor DBS_SERVER does.
std::map<std::string, std::string> TorchrunFallbacks() {
  const std::map<std::string, std::string> env = dbs::Environment();
  auto addr = env.find("MASTER_ADDR");
  if (addr == env.end() || addr->second.empty()) return {};
  auto port = env.find("MASTER_PORT");
  return {{"server", addr->second + ":" +
                         (port == env.end() || port->second.empty() ? "50051" : port->second)}};
}

// A slower worker emulated on this host (--slowdown, --slow_windows): wraps `learner` in
// `slowed`, which follows the position the loop announces, and returns the learner to train with
// (`learner` itself when nothing is slowed).
dbs::Learner* EmulateSlowdown(WorkerConfig* config, dbs::Learner* learner, const dbs::Clock* clock,
                              std::optional<dbs::SlowedLearner>* slowed) {
  if (config->slowdown.base() <= 1.0 && config->slowdown.windows().empty()) return learner;
  slowed->emplace(learner, config->slowdown, config->slowdown_of, clock);
  config->loop.before_step = [slowed](int epoch, int64_t step) { (*slowed)->At(epoch, step); };
  return &**slowed;
}

// Says how the worker is slowed, before training.
void SayEmulated(const WorkerConfig& config) {
  if (config.slowdown.base() > 1.0) {
    std::cout << "[" << config.loop.name << "] emulating a slower worker: a step's computation "
              << "takes " << config.slowdown.base() << " x "
              << (config.slowdown_of == dbs::SlowdownOf::kCpu
                      ? "its CPU time (a wait for a core counts inside it)"
                      : "its elapsed time")
              << std::endl;
  }
}

}  // namespace

// --measure_speed_samples: measures the learner's speed at each of --measure_batches and prints
// it as JSON (the first batch's at the top level, every batch's in "curve") instead of training.
int MeasureSpeedAndExit(const WorkerConfig& config, dbs::Learner* learner,
                        const dbs::Clock* clock) {
  std::string curve;
  double first = 0.0;
  for (int batch : config.measure_batches) {
    absl::StatusOr<double> speed =
        dbs::MeasureSpeed(learner, clock, config.measure_speed_samples, batch);
    if (!speed.ok()) return Fail("dbs_worker", speed.status(), dbs::kExitFailed);
    if (curve.empty()) first = *speed;
    absl::StrAppend(&curve, curve.empty() ? "" : ", ", "{\"batch\": ", batch,
                    ", \"samples_per_second\": ", *speed, "}");
  }
  std::cout << "{\"samples_per_second\": " << first << ", \"slowdown\": " << config.slowdown.base()
            << ", \"batch\": " << config.measure_batches.front() << ", \"curve\": [" << curve
            << "]}" << std::endl;
  return dbs::kExitOk;
}

int main(int argc, char** argv) {
  dbs::ParseCommandLine(argc, argv,
                        "dbs_worker: trains a model (built-in or TorchScript) on the data of "
                        "--data as a client of dbs_ps.\n"
                        "Example: dbs_worker --server=127.0.0.1:50051 --model=cnn",
                        "worker_main.cc", TorchrunFallbacks());
  dbs::SkipDeadlockDetection();
  dbs::SignalWatcher::Block();
  absl::StatusOr<WorkerConfig> config = WorkerConfigFromFlags();
  if (!config.ok()) return Fail("dbs_worker", config.status(), dbs::kExitBadConfig);
  // The data and the model, loaded and checked against each other.
  absl::StatusOr<std::unique_ptr<dbs::Learner>> learner = dbs::MakeTorchLearner(config->learner);
  if (!learner.ok()) {
    return Fail("dbs_worker " + config->loop.name, learner.status(), dbs::kExitBadConfig);
  }
  if (absl::GetFlag(FLAGS_dry_run)) {
    std::cout << "dbs_worker: configuration ok; " << (*learner)->DescribeData() << std::endl;
    return dbs::kExitOk;
  }
  const dbs::RealClock clock;
  std::optional<dbs::SlowedLearner> slowed;
  dbs::Learner* trained = EmulateSlowdown(&*config, learner->get(), &clock, &slowed);

  if (config->measure_speed_samples > 0) return MeasureSpeedAndExit(*config, trained, &clock);

  std::cout << "[" << config->loop.name << "] " << (*learner)->DescribeData() << std::endl;
  SayEmulated(*config);
  std::unique_ptr<dbs::PsClient> client = dbs::MakePsClient(config->client);
  dbs::TrainingLoop loop(config->loop, trained, client.get(), &clock);
  absl::Status status;
  int signal = 0;
  {
    dbs::SignalWatcher signals([&loop](int) { loop.RequestStop(); });
    status = loop.Run();
    signal = signals.received();
  }
  if (signal == SIGTERM) return dbs::kExitTerminated;
  if (signal == SIGINT) return dbs::kExitInterrupted;
  if (!status.ok()) {
    return Fail("dbs_worker " + config->loop.name, status, dbs::ExitCodeFor(status));
  }
  return dbs::kExitOk;
}
