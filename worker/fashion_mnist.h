// Fashion-MNIST (or any MNIST-format set) read directly from gzipped IDX files.
//
// Debian's dataset-fashion-mnist package installs train-images-idx3-ubyte.gz,
// train-labels-idx1-ubyte.gz, t10k-images-idx3-ubyte.gz and t10k-labels-idx1-ubyte.gz under
// /usr/share/datasets/fashion-mnist. Uncompressed files (the same names without .gz) are accepted
// too. No libtorch here; the trainer turns the bytes into tensors.
#ifndef DBS_WORKER_FASHION_MNIST_H_
#define DBS_WORKER_FASHION_MNIST_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace dbs {

inline constexpr char kDefaultFashionMnistDir[] = "/usr/share/datasets/fashion-mnist";

struct ImageDataset {
  int64_t size = 0;
  int rows = 0;
  int cols = 0;
  std::vector<uint8_t> images;  // size * rows * cols pixels, row-major
  std::vector<uint8_t> labels;  // size labels in [0, 9]
};

// Parses an IDX image file and an IDX label file (already decompressed), keeping at most `limit`
// samples (all when limit <= 0). With a limit below the file's count, the data may stop after the
// samples kept. INVALID_ARGUMENT on a malformed file.
absl::StatusOr<ImageDataset> ParseIdx(const std::string& images, const std::string& labels,
                                      int64_t limit);

// Reads a file, gunzipping it if it is gzip-compressed; at most `max_bytes` bytes when it is > 0.
// NOT_FOUND when it does not exist.
absl::StatusOr<std::string> ReadMaybeGzip(const std::string& path, int64_t max_bytes = 0);

// Loads the training (`train`) or test split from `dir`. NOT_FOUND, with the apt command that
// installs the data set, when the files are missing.
absl::StatusOr<ImageDataset> LoadFashionMnist(const std::string& dir, bool train, int64_t limit);

}  // namespace dbs

#endif  // DBS_WORKER_FASHION_MNIST_H_
