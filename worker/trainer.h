// The worker's training loop, behind a libtorch-free interface.
//
// RunWorker loads the data, joins the job, registers the model (so every worker starts from the
// first worker's initial values), then for each epoch: fetches the plan, trains its share of the
// epoch's permutation step by step (forward/backward on its batch, push the mean gradient, load
// the aggregated parameters), evaluates its slice of the test set and reports compute-only time.
// Compute time covers data, forward, backward and parameter copies; time inside server calls is
// reported separately as waiting. Prints a progress line every `log_every`.
#ifndef DBS_WORKER_TRAINER_H_
#define DBS_WORKER_TRAINER_H_

#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "worker/ps_client.h"
#include "worker/slowdown_schedule.h"

namespace dbs {

struct TrainerConfig {
  std::string name;                 // worker name (unique in the job)
  std::string model = "cnn";        // "cnn" or "mlp"
  std::string device = "auto";      // "auto", "cpu" or "cuda"
  std::string data_dir;             // folder with the Fashion-MNIST IDX files
  int64_t train_limit = 0;          // use the first N training samples (0: all)
  int64_t test_limit = 0;           // use the first N test samples (0: all)
  SlowdownSchedule slowdown;        // emulated slowness: compute takes this many times longer
  std::string init_params_path;     // optional raw float32 initial parameters (layout order)
  int threads = 1;                  // intra-op threads of libtorch on CPU
  int max_batch = 0;                // the largest batch this worker can hold (0: no limit)
  uint64_t seed = 1;                // seed of the initial parameters
  absl::Duration log_every = absl::Seconds(5);
  std::string record_path;          // optional JSON record of this worker's epochs
};

// Runs the worker until the job ends. Errors say what failed and what to do about it.
absl::Status RunWorker(const TrainerConfig& config, PsClient* client);

// Standalone compute speed, without a server: forward/backward over `samples` training samples
// in batches of `batch`, slowed by the schedule's base factor. Returns samples per second.
absl::StatusOr<double> MeasureSpeed(const TrainerConfig& config, int64_t samples, int batch);

}  // namespace dbs

#endif  // DBS_WORKER_TRAINER_H_
