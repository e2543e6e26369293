// The data a worker trains on, read from the formats users already have (docs/data.md). `--data`
// names a reader:
//   fashion-mnist[:DIR]  Fashion-MNIST's IDX files (the default; Debian's copy without DIR)
//   idx:DIR              any MNIST-family IDX files (gzipped or not, any number of classes)
//   cifar10:DIR          the CIFAR-10 binary version (data_batch_*.bin, test_batch.bin)
//   npy:X,Y[,TX,TY]      NumPy .npy files, memory-mapped (a data set larger than RAM works)
// Each reader has a file of its own (idx_format.cc, cifar10_format.cc, npy_format.cc).
//
// No libtorch here: an Array is a dense row-major block of rows, in memory or memory-mapped from a
// file, which the learner wraps into tensors without copying.
#ifndef DBS_WORKER_DATASET_H_
#define DBS_WORKER_DATASET_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace dbs {

inline constexpr char kDefaultFashionMnistDir[] = "/usr/share/datasets/fashion-mnist";

// kInt32 and kFloat64 occur only in .npy files; the readers convert them.
enum class DType { kUint8, kInt32, kInt64, kFloat32, kFloat64 };
const char* DTypeName(DType dtype);
size_t DTypeSize(DType dtype);

// A dense, row-major array whose first dimension counts samples. Copies share the storage.
class Array {
 public:
  Array() = default;
  // `data` must stay valid while `owner` lives.
  Array(DType dtype, std::vector<int64_t> shape, const void* data,
        std::shared_ptr<const void> owner);
  // An array that owns `bytes` (which must hold exactly the shape's elements).
  static Array Of(DType dtype, std::vector<int64_t> shape, std::string bytes);

  DType dtype() const { return dtype_; }
  // [rows, ...row_shape]
  const std::vector<int64_t>& shape() const { return shape_; }
  std::vector<int64_t> row_shape() const { return {shape_.begin() + 1, shape_.end()}; }
  int64_t rows() const { return shape_.empty() ? 0 : shape_[0]; }
  int64_t row_elements() const;
  const void* data() const { return data_; }
  template <typename T>
  const T* values() const {
    return static_cast<const T*>(data_);
  }
  // The first `n` rows (all when n <= 0 or n >= rows()), sharing the storage.
  Array FirstRows(int64_t n) const;

 private:
  DType dtype_ = DType::kUint8;
  std::vector<int64_t> shape_;
  const void* data_ = nullptr;
  std::shared_ptr<const void> owner_;
};

struct Dataset {
  Array inputs;            // uint8 or float32, [N, ...]
  Array targets;           // int64 class labels [N], or float32 values [N, ...]
  int64_t max_label = -1;  // the largest label of the whole file, before any limit
};

// Per-channel standardisation: an input value x becomes (x * scale - mean[c]) / std[c], where scale
// is 1/255 for uint8 inputs and 1 for float32 ones.
struct Normalization {
  std::vector<double> mean, std;  // empty: no standardisation (bytes are still scaled)
  std::string source;             // where the figures come from, for the log
};

struct Data {
  std::string spec;  // what --data said, with the folder or files it resolved to
  Dataset train, test;
  int64_t num_classes = 0;  // targets are labels in [0, num_classes); 0: real-valued targets
  Normalization published;  // the data set's own statistics, when known (Fashion-MNIST, CIFAR-10)
};

// Loads what `spec` names (see the top of this file), keeping the first `train_limit` training and
// `test_limit` test samples (all when <= 0). NOT_FOUND says which file is missing (and, for
// Fashion-MNIST, how to install it); INVALID_ARGUMENT names the file and what is wrong with it.
absl::StatusOr<Data> LoadData(const std::string& spec, const std::string& fashion_mnist_dir,
                              int64_t train_limit, int64_t test_limit);

// How many channels an input row of `row_shape` has for standardisation: the first dimension of an
// image row [C, H, W] (rank >= 3), every feature of a vector row [F], one otherwise.
int64_t NormalizationChannels(const std::vector<int64_t>& row_shape);

// The per-channel mean and (population) standard deviation of `inputs`, after scaling bytes.
Normalization ComputeNormalization(const Array& inputs);

// --normalize: "auto" (the data set's published statistics when it has them, else those of the
// training inputs when they are bytes, else none), "none", "train" (computed from the training
// inputs), or explicit figures "M1,M2,.../S1,S2,..." (one per channel, or one for all).
absl::StatusOr<Normalization> ChooseNormalization(const std::string& flag, const Data& data);

// Reads a file, gunzipping it if it is gzip-compressed; at most `max_bytes` bytes when it is > 0.
// NOT_FOUND when it does not exist.
absl::StatusOr<std::string> ReadMaybeGzip(const std::string& path, int64_t max_bytes = 0);

// Parses an IDX image file and an IDX label file (already decompressed), keeping at most `limit`
// samples (all when limit <= 0). With a limit below the file's count, the data may stop after the
// samples kept. Images of shape [N, H, W] become [N, 1, H, W]. INVALID_ARGUMENT on a malformed
// file.
absl::StatusOr<Dataset> ParseIdx(const std::string& images, const std::string& labels,
                                 int64_t limit);

// Parses CIFAR-10 binary records (1 label byte, then 3x32x32 pixel bytes) of one file.
absl::StatusOr<Dataset> ParseCifar10(const std::string& records, int64_t limit);

// Memory-maps a NumPy .npy file (format 1.0-3.0, C order, little-endian uint8, int32, int64,
// float32 or float64). The returned array keeps the mapping alive.
absl::StatusOr<Array> MapNpy(const std::string& path);

}  // namespace dbs

#endif  // DBS_WORKER_DATASET_H_
