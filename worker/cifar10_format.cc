// The CIFAR-10 reader: the binary version (data_batch_*.bin, test_batch.bin).
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "worker/data_formats.h"
#include "worker/dataset.h"

namespace dbs {
namespace {

constexpr int64_t kCifarRecord = 1 + 3 * 32 * 32;

absl::StatusOr<Dataset> LoadCifarFiles(const std::vector<std::string>& paths, int64_t limit) {
  std::string labels, pixels;
  int64_t n = 0;
  for (const std::string& path : paths) {
    if (limit > 0 && n >= limit) break;
    const int64_t want = limit > 0 ? (limit - n) * kCifarRecord : 0;
    DBS_ASSIGN_OR_RETURN(std::string records, ReadMaybeGzip(path, want));
    absl::StatusOr<Dataset> part = ParseCifar10(records, 0);
    if (!part.ok()) return InFile(path, part.status());
    const int64_t rows = part->inputs.rows();
    const auto* l = part->targets.values<int64_t>();
    for (int64_t i = 0; i < rows; ++i) labels.push_back(static_cast<char>(l[i]));
    pixels.append(static_cast<const char*>(part->inputs.data()),
                  static_cast<size_t>(rows * 3 * 32 * 32));
    n += rows;
  }
  Dataset out;
  out.inputs = Array::Of(DType::kUint8, {n, 3, 32, 32}, std::move(pixels));
  DBS_ASSIGN_OR_RETURN(out.targets,
                       LabelsAsInt64(Array::Of(DType::kUint8, {n}, std::move(labels)), "cifar10"));
  return out;
}

}  // namespace

absl::StatusOr<Data> LoadCifar10(const std::string& dir_flag, int64_t train_limit,
                                 int64_t test_limit) {
  std::string dir = dir_flag;
  if (!Exists(dir + "/test_batch.bin") && Exists(dir + "/cifar-10-batches-bin/test_batch.bin")) {
    dir += "/cifar-10-batches-bin";
  }
  std::vector<std::string> train;
  for (int i = 1; i <= 5; ++i) train.push_back(absl::StrCat(dir, "/data_batch_", i, ".bin"));
  const std::string test = dir + "/test_batch.bin";
  for (const std::string& p : train) {
    if (!Exists(p)) {
      return absl::NotFoundError(
          absl::StrCat("cifar10: ", p,
                       " does not exist (the folder needs data_batch_1.bin to data_batch_5.bin and "
                       "test_batch.bin of the CIFAR-10 binary version, cifar-10-binary.tar.gz)"));
    }
  }
  if (!Exists(test)) return absl::NotFoundError(absl::StrCat("cifar10: ", test, " does not exist"));
  Data data;
  data.spec = "cifar10:" + dir;
  DBS_ASSIGN_OR_RETURN(data.train, LoadCifarFiles(train, train_limit));
  DBS_ASSIGN_OR_RETURN(data.test, LoadCifarFiles({test}, test_limit));
  data.num_classes = 10;
  // The training set's per-channel statistics, as torchvision users quote them.
  data.published = {{0.4914, 0.4822, 0.4465}, {0.2470, 0.2435, 0.2616}, "CIFAR-10's own"};
  DBS_RETURN_IF_ERROR(CheckLabelsBelow(data.train.targets, 10, data.spec));
  DBS_RETURN_IF_ERROR(CheckLabelsBelow(data.test.targets, 10, data.spec));
  return data;
}

absl::StatusOr<Dataset> ParseCifar10(const std::string& records, int64_t limit) {
  if (records.size() % kCifarRecord != 0) {
    return absl::InvalidArgumentError(absl::StrCat("not CIFAR-10 binary records: ", records.size(),
                                                   " bytes is not a multiple of ", kCifarRecord,
                                                   " (a label byte and 3x32x32 pixels)"));
  }
  int64_t n = static_cast<int64_t>(records.size()) / kCifarRecord;
  if (limit > 0) n = std::min(n, limit);
  std::string labels, pixels;
  labels.reserve(n);
  pixels.reserve(n * (kCifarRecord - 1));
  for (int64_t i = 0; i < n; ++i) {
    labels.push_back(records[i * kCifarRecord]);
    pixels.append(records, i * kCifarRecord + 1, kCifarRecord - 1);
  }
  Dataset out;
  out.inputs = Array::Of(DType::kUint8, {n, 3, 32, 32}, std::move(pixels));
  DBS_ASSIGN_OR_RETURN(out.targets,
                       LabelsAsInt64(Array::Of(DType::kUint8, {n}, std::move(labels)), "cifar10"));
  DBS_RETURN_IF_ERROR(CheckLabelsBelow(out.targets, 10, "cifar10"));
  return out;
}

}  // namespace dbs
