// What the data set readers share (worker/dataset.h's LoadData dispatches to them), one file per
// format: idx_format.cc (Fashion-MNIST and any IDX files), cifar10_format.cc, npy_format.cc.
// Internal to //worker:dataset.
#ifndef DBS_WORKER_DATA_FORMATS_H_
#define DBS_WORKER_DATA_FORMATS_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "worker/dataset.h"

namespace dbs {

// The readers, each keeping the first `train_limit` training and `test_limit` test samples (all
// when <= 0).
absl::StatusOr<Data> LoadFashionMnist(const std::string& dir, int64_t train_limit,
                                      int64_t test_limit);
absl::StatusOr<Data> LoadIdxFolder(const std::string& dir, int64_t train_limit, int64_t test_limit);
absl::StatusOr<Data> LoadCifar10(const std::string& dir, int64_t train_limit, int64_t test_limit);
absl::StatusOr<Data> LoadNpy(const std::string& list, int64_t train_limit, int64_t test_limit);

uint32_t BigEndian32(const std::string& data, size_t offset);
bool Exists(const std::string& path);
bool IsDirectory(const std::string& path);
int64_t Product(const std::vector<int64_t>& dims, size_t from = 0);
std::string ShapeString(const std::vector<int64_t>& shape);
// Prefixes a parse error with the file it came from.
absl::Status InFile(const std::string& path, const absl::Status& status);
// Class labels as int64, whatever integer type they came in. INVALID_ARGUMENT for a negative one.
absl::StatusOr<Array> LabelsAsInt64(const Array& labels, const std::string& where);
int64_t MaxLabel(const Array& labels);
// Labels must lie below a data set's known number of classes.
absl::Status CheckLabelsBelow(const Array& labels, int64_t classes, const std::string& where);

}  // namespace dbs

#endif  // DBS_WORKER_DATA_FORMATS_H_
