// dbs_worker: one training worker of a dbs job. Flags are parsed here only.
#include <unistd.h>

#include <iostream>
#include <string>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "common/flags_help.h"
#include "absl/strings/str_cat.h"
#include "worker/fashion_mnist.h"
#include "worker/grpc_ps_client.h"
#include "worker/trainer.h"

ABSL_FLAG(std::string, server, "127.0.0.1:50051", "Address of dbs_ps (host:port).");
ABSL_FLAG(std::string, name, "", "Worker name, unique in the job (default host:pid).");
ABSL_FLAG(std::string, model, "cnn", "Model to train: 'cnn' or 'mlp'.");
ABSL_FLAG(std::string, device, "auto", "'auto' (CUDA when available), 'cpu' or 'cuda'.");
ABSL_FLAG(std::string, data_dir, dbs::kDefaultFashionMnistDir,
          "Folder with the Fashion-MNIST IDX files (gzipped or not).");
ABSL_FLAG(int64_t, train_limit, 0, "Use only the first N training samples (0: all).");
ABSL_FLAG(int64_t, test_limit, 0, "Use only the first N test samples (0: all).");
ABSL_FLAG(double, slowdown, 1.0,
          "Emulate a slower worker: each step's compute takes this many times longer (>= 1).");
ABSL_FLAG(std::string, slow_windows, "",
          "Extra slowdown while training, like a background job: 'e<begin>:<end>:<factor>' "
          "(epochs) or 's<begin>:<end>:<factor>' (global steps), ';'-separated, e.g. e2:4:3.");
ABSL_FLAG(int, threads, 1, "libtorch intra-op threads on CPU.");
ABSL_FLAG(int, max_batch, 0,
          "The largest batch this worker can hold (its memory cap), honoured by the server's "
          "'dbs' policy; 0: no limit.");
ABSL_FLAG(std::string, init_params, "",
          "Optional file of raw float32 initial parameters in the model's order (for comparing "
          "against another framework from the same start).");
ABSL_FLAG(int64_t, measure_speed_samples, 0,
          "If > 0, do not train: measure standalone compute speed over this many samples, print "
          "it as JSON and exit.");
ABSL_FLAG(int, measure_batch, 32, "Batch size of --measure_speed_samples.");
ABSL_FLAG(uint64_t, seed, 1, "Seed of the initial parameters (the first worker's are used).");
ABSL_FLAG(double, log_every_s, 5.0, "Seconds between progress lines.");
ABSL_FLAG(double, connect_timeout_s, 60.0,
          "How long to keep retrying (with backoff) while dbs_ps is unreachable.");
ABSL_FLAG(int, max_message_mb, 512, "Largest gRPC message sent or accepted, in MiB.");
ABSL_FLAG(std::string, record_path, "", "Optional JSON record of this worker's epochs.");

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "dbs_worker: trains on Fashion-MNIST as a client of dbs_ps.\n"
      "Example: dbs_worker --server=127.0.0.1:50051 --model=cnn");
  dbs::HelpListsFlagsOf("worker_main.cc");
  absl::ParseCommandLine(argc, argv);

  dbs::TrainerConfig config;
  config.name = absl::GetFlag(FLAGS_name);
  if (config.name.empty()) {
    char host[256] = {0};
    gethostname(host, sizeof(host) - 1);
    config.name = absl::StrCat(host, ":", getpid());
  }
  config.model = absl::GetFlag(FLAGS_model);
  config.device = absl::GetFlag(FLAGS_device);
  config.data_dir = absl::GetFlag(FLAGS_data_dir);
  config.train_limit = absl::GetFlag(FLAGS_train_limit);
  config.test_limit = absl::GetFlag(FLAGS_test_limit);
  absl::StatusOr<dbs::SlowdownSchedule> slowdown = dbs::SlowdownSchedule::Create(
      absl::GetFlag(FLAGS_slowdown), absl::GetFlag(FLAGS_slow_windows));
  if (!slowdown.ok()) {
    std::cerr << "dbs_worker: " << slowdown.status().message() << std::endl;
    return 1;
  }
  config.slowdown = *slowdown;
  config.init_params_path = absl::GetFlag(FLAGS_init_params);
  config.threads = absl::GetFlag(FLAGS_threads);
  config.max_batch = absl::GetFlag(FLAGS_max_batch);
  if (config.max_batch < 0) {
    std::cerr << "dbs_worker: --max_batch must be >= 0" << std::endl;
    return 1;
  }
  config.seed = absl::GetFlag(FLAGS_seed);
  config.log_every = absl::Seconds(absl::GetFlag(FLAGS_log_every_s));
  config.record_path = absl::GetFlag(FLAGS_record_path);

  if (absl::GetFlag(FLAGS_measure_speed_samples) > 0) {
    absl::StatusOr<double> speed = dbs::MeasureSpeed(
        config, absl::GetFlag(FLAGS_measure_speed_samples), absl::GetFlag(FLAGS_measure_batch));
    if (!speed.ok()) {
      std::cerr << "dbs_worker: " << speed.status().message() << std::endl;
      return 1;
    }
    std::cout << "{\"samples_per_second\": " << *speed << ", \"slowdown\": "
              << config.slowdown.base() << ", \"batch\": " << absl::GetFlag(FLAGS_measure_batch)
              << "}" << std::endl;
    return 0;
  }

  dbs::GrpcClientConfig client_config;
  client_config.address = absl::GetFlag(FLAGS_server);
  client_config.connect_timeout = absl::Seconds(absl::GetFlag(FLAGS_connect_timeout_s));
  client_config.max_message_mb = absl::GetFlag(FLAGS_max_message_mb);
  if (client_config.max_message_mb < 1 || client_config.max_message_mb > 2047) {
    std::cerr << "dbs_worker: --max_message_mb must be in [1, 2047]" << std::endl;
    return 2;
  }
  dbs::GrpcPsClient client(client_config);
  const absl::Status status = dbs::RunWorker(config, &client);
  if (!status.ok()) {
    std::cerr << "dbs_worker " << config.name << ": " << status.message() << std::endl;
    return 1;
  }
  return 0;
}
