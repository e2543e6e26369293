// The libtorch Learner: a built-in or TorchScript model on the data --data names, on CPU or CUDA.
// The header is free of libtorch so dbs_worker's main and the loop compile without it.
#ifndef DBS_WORKER_TORCH_LEARNER_H_
#define DBS_WORKER_TORCH_LEARNER_H_

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "worker/learner.h"

namespace dbs {

struct LearnerConfig {
  std::string model = "cnn";           // "cnn", "mlp" or the path of a TorchScript file
  std::string loss = "auto";           // a TorchScript model's loss (see LoadScriptNet)
  std::string device = "auto";         // "auto", "cpu" or "cuda"
  std::string data = "fashion-mnist";  // a reader and its files (worker/dataset.h)
  std::string data_dir;                // the folder of --data=fashion-mnist without one
  std::string normalize = "auto";      // see ChooseNormalization
  int64_t train_limit = 0;             // use the first N training samples (0: all)
  int64_t test_limit = 0;              // use the first N test samples (0: all)
  int threads = 1;                     // intra-op threads of libtorch on CPU
  uint64_t seed = 1;                   // seed of the initial parameters
  std::string init_params_path;        // optional raw float32 initial parameters (layout order)
};

// Loads the data onto the device and builds the model. Errors name the flag or file at fault
// (a missing data set says how to install it).
absl::StatusOr<std::unique_ptr<Learner>> MakeTorchLearner(const LearnerConfig& config);

}  // namespace dbs

#endif  // DBS_WORKER_TORCH_LEARNER_H_
