#include "worker/dataset.h"

#include <sys/stat.h>

#include <algorithm>
#include <cmath>
#include <utility>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "common/status_macros.h"
#include "worker/data_formats.h"

namespace dbs {
namespace {

// Sets num_classes from the labels when the reader does not know it.
void CountClasses(Data* data) {
  if (data->num_classes > 0 || data->train.targets.dtype() != DType::kInt64) return;
  data->num_classes = 1 + std::max(data->train.max_label, data->test.max_label);
}

}  // namespace

uint32_t BigEndian32(const std::string& data, size_t offset) {
  const auto* p = reinterpret_cast<const unsigned char*>(data.data() + offset);
  return (uint32_t{p[0]} << 24) | (uint32_t{p[1]} << 16) | (uint32_t{p[2]} << 8) | uint32_t{p[3]};
}

bool Exists(const std::string& path) {
  struct stat st;
  return stat(path.c_str(), &st) == 0;
}

bool IsDirectory(const std::string& path) {
  struct stat st;
  return stat(path.c_str(), &st) == 0 && S_ISDIR(st.st_mode);
}

int64_t Product(const std::vector<int64_t>& dims, size_t from) {
  int64_t n = 1;
  for (size_t i = from; i < dims.size(); ++i) n *= dims[i];
  return n;
}

std::string ShapeString(const std::vector<int64_t>& shape) {
  return absl::StrCat("[", absl::StrJoin(shape, ", "), "]");
}

absl::Status InFile(const std::string& path, const absl::Status& status) {
  return absl::Status(status.code(), absl::StrCat(path, ": ", status.message()));
}

absl::StatusOr<Array> LabelsAsInt64(const Array& labels, const std::string& where) {
  const int64_t n = labels.rows();
  const bool as_is = labels.dtype() == DType::kInt64;  // keep the mapping; only check
  std::string bytes(as_is ? 0 : static_cast<size_t>(n) * sizeof(int64_t), '\0');
  auto* out = reinterpret_cast<int64_t*>(bytes.data());
  for (int64_t i = 0; i < n; ++i) {
    int64_t v = 0;
    switch (labels.dtype()) {
      case DType::kUint8:
        v = labels.values<uint8_t>()[i];
        break;
      case DType::kInt32:
        v = labels.values<int32_t>()[i];
        break;
      case DType::kInt64:
        v = labels.values<int64_t>()[i];
        break;
      default:
        return absl::InvalidArgumentError(absl::StrCat(where, ": labels must be integers"));
    }
    if (v < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat(where, ": label ", v, " of sample ", i, " is negative"));
    }
    if (!as_is) out[i] = v;
  }
  if (as_is) return labels;
  return Array::Of(DType::kInt64, {n}, std::move(bytes));
}

int64_t MaxLabel(const Array& labels) {
  int64_t max = -1;
  for (int64_t i = 0; i < labels.rows(); ++i) max = std::max(max, labels.values<int64_t>()[i]);
  return max;
}

absl::Status CheckLabelsBelow(const Array& labels, int64_t classes, const std::string& where) {
  for (int64_t i = 0; i < labels.rows(); ++i) {
    const int64_t l = labels.values<int64_t>()[i];
    if (l >= classes) {
      return absl::InvalidArgumentError(absl::StrCat(where, ": label ", l, " of sample ", i,
                                                     " is out of range (", classes,
                                                     " classes: 0 to ", classes - 1, ")"));
    }
  }
  return absl::OkStatus();
}

const char* DTypeName(DType dtype) {
  switch (dtype) {
    case DType::kUint8:
      return "uint8";
    case DType::kInt32:
      return "int32";
    case DType::kInt64:
      return "int64";
    case DType::kFloat32:
      return "float32";
    case DType::kFloat64:
      return "float64";
  }
  return "?";
}

size_t DTypeSize(DType dtype) {
  switch (dtype) {
    case DType::kUint8:
      return 1;
    case DType::kInt32:
    case DType::kFloat32:
      return 4;
    case DType::kInt64:
    case DType::kFloat64:
      return 8;
  }
  return 0;
}

Array::Array(DType dtype, std::vector<int64_t> shape, const void* data,
             std::shared_ptr<const void> owner)
    : dtype_(dtype), shape_(std::move(shape)), data_(data), owner_(std::move(owner)) {}

Array Array::Of(DType dtype, std::vector<int64_t> shape, std::string bytes) {
  auto owned = std::make_shared<const std::string>(std::move(bytes));
  const void* data = owned->data();
  return Array(dtype, std::move(shape), data, std::move(owned));
}

int64_t Array::row_elements() const { return Product(shape_, 1); }

Array Array::FirstRows(int64_t n) const {
  if (n <= 0 || n >= rows()) return *this;
  Array out = *this;
  out.shape_[0] = n;
  return out;
}

absl::StatusOr<Data> LoadData(const std::string& spec, const std::string& fashion_mnist_dir,
                              int64_t train_limit, int64_t test_limit) {
  const size_t colon = spec.find(':');
  const std::string reader = spec.substr(0, colon);
  const std::string arg = colon == std::string::npos ? "" : spec.substr(colon + 1);
  absl::StatusOr<Data> data;
  if (reader == "fashion-mnist") {
    data = LoadFashionMnist(arg.empty() ? fashion_mnist_dir : arg, train_limit, test_limit);
  } else if (reader == "idx" && !arg.empty()) {
    data = LoadIdxFolder(arg, train_limit, test_limit);
  } else if (reader == "cifar10" && !arg.empty()) {
    if (!IsDirectory(arg)) return absl::NotFoundError(absl::StrCat("cifar10: no folder ", arg));
    data = LoadCifar10(arg, train_limit, test_limit);
  } else if (reader == "npy" && !arg.empty()) {
    data = LoadNpy(arg, train_limit, test_limit);
  } else {
    return absl::InvalidArgumentError(
        absl::StrCat("--data='", spec,
                     "' names no reader: use fashion-mnist[:DIR], idx:DIR, cifar10:DIR or "
                     "npy:TRAIN_X.npy,TRAIN_Y.npy[,TEST_X.npy,TEST_Y.npy]"));
  }
  if (!data.ok()) return data.status();
  if (data->train.inputs.rows() == 0) {
    return absl::InvalidArgumentError(absl::StrCat(data->spec, ": no training samples"));
  }
  CountClasses(&*data);
  return data;
}

int64_t NormalizationChannels(const std::vector<int64_t>& row_shape) {
  if (row_shape.size() >= 3 || row_shape.size() == 1) return std::max<int64_t>(row_shape[0], 1);
  return 1;
}

Normalization ComputeNormalization(const Array& inputs) {
  const int64_t channels = NormalizationChannels(inputs.row_shape());
  const int64_t row = inputs.row_elements();
  const int64_t inner = std::max<int64_t>(row / channels, 1);
  const double scale = inputs.dtype() == DType::kUint8 ? 1.0 / 255.0 : 1.0;
  std::vector<double> sum(channels, 0.0), squares(channels, 0.0);
  for (int64_t r = 0; r < inputs.rows(); ++r) {
    for (int64_t c = 0; c < channels; ++c) {
      double s = 0.0, q = 0.0;
      for (int64_t j = c * inner; j < (c + 1) * inner; ++j) {
        const int64_t at = r * row + j;
        const double x = inputs.dtype() == DType::kUint8 ? inputs.values<uint8_t>()[at] * scale
                                                         : inputs.values<float>()[at];
        s += x;
        q += x * x;
      }
      sum[c] += s;
      squares[c] += q;
    }
  }
  Normalization out;
  out.source = "the training inputs'";
  const double count = static_cast<double>(std::max<int64_t>(inputs.rows(), 1) * inner);
  for (int64_t c = 0; c < channels; ++c) {
    const double mean = sum[c] / count;
    const double var = std::max(0.0, squares[c] / count - mean * mean);
    out.mean.push_back(mean);
    out.std.push_back(var > 0 ? std::sqrt(var) : 1.0);  // a constant channel is only centred
  }
  return out;
}

absl::StatusOr<Normalization> ChooseNormalization(const std::string& flag, const Data& data) {
  const int64_t channels = NormalizationChannels(data.train.inputs.row_shape());
  if (flag == "none") return Normalization{{}, {}, "none"};
  if (flag == "train") return ComputeNormalization(data.train.inputs);
  if (flag == "auto") {
    if (!data.published.mean.empty() &&
        static_cast<int64_t>(data.published.mean.size()) == channels) {
      return data.published;
    }
    if (data.train.inputs.dtype() == DType::kUint8) return ComputeNormalization(data.train.inputs);
    return Normalization{{}, {}, "none"};
  }
  const std::vector<std::string> parts = absl::StrSplit(flag, '/');
  Normalization out;
  out.source = "--normalize";
  bool ok = parts.size() == 2;
  for (size_t i = 0; ok && i < 2; ++i) {
    for (absl::string_view v : absl::StrSplit(parts[i], ',')) {
      double x = 0.0;
      ok = ok && absl::SimpleAtod(v, &x) && std::isfinite(x) && (i == 0 || x > 0);
      (i == 0 ? out.mean : out.std).push_back(x);
    }
  }
  if (!ok) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--normalize='", flag,
        "': use auto, none, train, or MEAN/STD figures such as 0.5/0.25 or 0.49,0.48,0.45/"
        "0.25,0.24,0.26 (standard deviations > 0)"));
  }
  for (std::vector<double>* v : {&out.mean, &out.std}) {
    if (v->size() == 1) v->assign(channels, v->front());
    if (static_cast<int64_t>(v->size()) != channels) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--normalize='", flag, "' gives ", v->size(), " figures; the inputs (samples of shape ",
          ShapeString(data.train.inputs.row_shape()), ") have ", channels, " channel",
          channels == 1 ? "" : "s"));
    }
  }
  return out;
}

}  // namespace dbs
