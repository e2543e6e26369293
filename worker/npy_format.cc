// The NumPy reader: .npy files, memory-mapped, so a data set larger than RAM works.
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <memory>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "common/status_macros.h"
#include "worker/data_formats.h"
#include "worker/dataset.h"

namespace dbs {
namespace {

struct Mapping {
  void* addr = MAP_FAILED;
  size_t length = 0;
  ~Mapping() {
    if (addr != MAP_FAILED) munmap(addr, length);
  }
};

// The value of `key` in a .npy header dict, up to the next top-level comma or closing brace.
absl::StatusOr<std::string> HeaderValue(const std::string& header, const std::string& key) {
  const size_t k = header.find("'" + key + "'");
  if (k == std::string::npos) return absl::InvalidArgumentError(absl::StrCat("no '", key, "'"));
  size_t i = header.find(':', k);
  if (i == std::string::npos) return absl::InvalidArgumentError("malformed header");
  ++i;
  while (i < header.size() && header[i] == ' ') ++i;
  size_t end = i;
  if (i < header.size() && header[i] == '(') {
    end = header.find(')', i);
    if (end == std::string::npos) return absl::InvalidArgumentError("malformed shape");
    return header.substr(i, end + 1 - i);
  }
  while (end < header.size() && header[end] != ',' && header[end] != '}') ++end;
  return std::string(absl::StripTrailingAsciiWhitespace(header.substr(i, end - i)));
}

absl::StatusOr<DType> NpyDType(std::string descr) {
  descr = std::string(absl::StripSuffix(absl::StripPrefix(descr, "'"), "'"));
  if (descr == "|u1" || descr == "<u1") return DType::kUint8;
  if (descr == "<i4") return DType::kInt32;
  if (descr == "<i8") return DType::kInt64;
  if (descr == "<f4") return DType::kFloat32;
  if (descr == "<f8") return DType::kFloat64;
  return absl::InvalidArgumentError(
      absl::StrCat("element type ", descr,
                   " is not supported (use uint8 or float32 inputs, int64 labels or float32 "
                   "targets, little-endian; e.g. x.astype(np.float32))"));
}

absl::StatusOr<std::vector<int64_t>> NpyShape(const std::string& tuple) {
  std::vector<int64_t> shape;
  const std::string inner(absl::StripSuffix(absl::StripPrefix(tuple, "("), ")"));
  int64_t elements = 1;
  for (absl::string_view part : absl::StrSplit(inner, ',', absl::SkipWhitespace())) {
    int64_t d = 0;
    if (!absl::SimpleAtoi(part, &d) || d < 0) {
      return absl::InvalidArgumentError(absl::StrCat("malformed shape ", tuple));
    }
    // No file holds 2^56 elements: a larger product is a corrupt header, not a big data set.
    if (d > 0 && elements > (int64_t{1} << 56) / d) {
      return absl::InvalidArgumentError(absl::StrCat("impossible shape ", tuple));
    }
    elements *= d;
    shape.push_back(d);
  }
  if (shape.empty()) {
    return absl::InvalidArgumentError("a scalar; the first dimension must count samples");
  }
  return shape;
}

absl::StatusOr<Array> ParseNpyHeader(const char* bytes, size_t size, std::shared_ptr<Mapping> map) {
  if (size < 10 || std::memcmp(bytes, "\x93NUMPY", 6) != 0) {
    return absl::InvalidArgumentError("not a NumPy .npy file (no \\x93NUMPY magic)");
  }
  const int major = static_cast<unsigned char>(bytes[6]);
  if (major < 1 || major > 3) {
    return absl::InvalidArgumentError(absl::StrCat(".npy format version ", major, " unknown"));
  }
  const auto* u = reinterpret_cast<const unsigned char*>(bytes);
  size_t header_len = 0, start = 0;
  if (major == 1) {
    header_len = u[8] | (size_t{u[9]} << 8);
    start = 10;
  } else {
    if (size < 12) return absl::InvalidArgumentError("truncated header");
    header_len = u[8] | (size_t{u[9]} << 8) | (size_t{u[10]} << 16) | (size_t{u[11]} << 24);
    start = 12;
  }
  if (start + header_len > size) return absl::InvalidArgumentError("truncated header");
  const std::string header(bytes + start, header_len);
  DBS_ASSIGN_OR_RETURN(std::string descr, HeaderValue(header, "descr"));
  DBS_ASSIGN_OR_RETURN(std::string fortran, HeaderValue(header, "fortran_order"));
  DBS_ASSIGN_OR_RETURN(std::string shape_text, HeaderValue(header, "shape"));
  DBS_ASSIGN_OR_RETURN(DType dtype, NpyDType(descr));
  if (fortran != "False") {
    return absl::InvalidArgumentError(
        "stored in Fortran order; save np.ascontiguousarray(x) instead");
  }
  DBS_ASSIGN_OR_RETURN(std::vector<int64_t> shape, NpyShape(shape_text));
  const size_t offset = start + header_len;
  const int64_t need = Product(shape) * static_cast<int64_t>(DTypeSize(dtype));
  if (static_cast<int64_t>(size - offset) != need) {
    return absl::InvalidArgumentError(absl::StrCat(
        static_cast<int64_t>(size - offset) < need ? "truncated" : "has trailing bytes", ": shape ",
        ShapeString(shape), " of ", DTypeName(dtype), " needs ", need,
        " bytes of data, the file has ", size - offset));
  }
  return Array(dtype, std::move(shape), bytes + offset, std::move(map));
}

absl::StatusOr<Dataset> LoadNpyPair(const std::string& x_path, const std::string& y_path,
                                    int64_t limit) {
  DBS_ASSIGN_OR_RETURN(Array x, MapNpy(x_path));
  DBS_ASSIGN_OR_RETURN(Array y, MapNpy(y_path));
  if (x.dtype() != DType::kUint8 && x.dtype() != DType::kFloat32) {
    return absl::InvalidArgumentError(
        absl::StrCat(x_path, ": inputs are ", DTypeName(x.dtype()),
                     "; use uint8 or float32 (x.astype(np.float32))"));
  }
  if (x.rows() != y.rows()) {
    return absl::InvalidArgumentError(
        absl::StrCat(x_path, " has ", x.rows(), " samples but ", y_path, " has ", y.rows()));
  }
  Dataset out;
  out.inputs = x.FirstRows(limit);
  if (y.dtype() == DType::kFloat32 || y.dtype() == DType::kFloat64) {
    y = y.FirstRows(limit);
    if (y.dtype() == DType::kFloat64) {  // targets are small next to inputs: convert them
      const int64_t count = Product(y.shape());
      std::string bytes(static_cast<size_t>(count) * sizeof(float), '\0');
      auto* f = reinterpret_cast<float*>(bytes.data());
      for (int64_t i = 0; i < count; ++i) f[i] = static_cast<float>(y.values<double>()[i]);
      y = Array::Of(DType::kFloat32, y.shape(), std::move(bytes));
    }
    out.targets = y;
    return out;
  }
  if (y.shape().size() != 1) {
    return absl::InvalidArgumentError(
        absl::StrCat(y_path, ": integer labels must be one per sample (shape [N]), not ",
                     ShapeString(y.shape()), "; for real-valued targets save float32"));
  }
  DBS_ASSIGN_OR_RETURN(out.targets, LabelsAsInt64(y, y_path));
  out.max_label = MaxLabel(out.targets);
  out.targets = out.targets.FirstRows(limit);
  return out;
}

}  // namespace

absl::StatusOr<Data> LoadNpy(const std::string& list, int64_t train_limit, int64_t test_limit) {
  const std::vector<std::string> paths = absl::StrSplit(list, ',', absl::SkipEmpty());
  if (paths.size() != 2 && paths.size() != 4) {
    return absl::InvalidArgumentError(
        "--data=npy: wants TRAIN_X.npy,TRAIN_Y.npy or "
        "TRAIN_X.npy,TRAIN_Y.npy,TEST_X.npy,TEST_Y.npy");
  }
  Data data;
  data.spec = "npy:" + list;
  DBS_ASSIGN_OR_RETURN(data.train, LoadNpyPair(paths[0], paths[1], train_limit));
  if (paths.size() == 4) {
    DBS_ASSIGN_OR_RETURN(data.test, LoadNpyPair(paths[2], paths[3], test_limit));
    if (data.test.inputs.row_shape() != data.train.inputs.row_shape() ||
        data.test.inputs.dtype() != data.train.inputs.dtype()) {
      return absl::InvalidArgumentError(
          absl::StrCat(paths[2], " holds ", DTypeName(data.test.inputs.dtype()),
                       " samples of shape ", ShapeString(data.test.inputs.row_shape()),
                       ", the training inputs ", DTypeName(data.train.inputs.dtype()), " of shape ",
                       ShapeString(data.train.inputs.row_shape())));
    }
    if (data.test.targets.row_shape() != data.train.targets.row_shape() ||
        data.test.targets.dtype() != data.train.targets.dtype()) {
      return absl::InvalidArgumentError(
          absl::StrCat(paths[3], ": the test targets are not of the training targets' kind (",
                       DTypeName(data.train.targets.dtype()), " ",
                       ShapeString(data.train.targets.row_shape()), ")"));
    }
  } else {  // no test set: an empty one of the same shape
    std::vector<int64_t> x_shape = data.train.inputs.shape(), y_shape = data.train.targets.shape();
    x_shape[0] = y_shape[0] = 0;
    data.test.inputs = Array::Of(data.train.inputs.dtype(), x_shape, "");
    data.test.targets = Array::Of(data.train.targets.dtype(), y_shape, "");
  }
  return data;
}

absl::StatusOr<Array> MapNpy(const std::string& path) {
  const int fd = open(path.c_str(), O_RDONLY);
  if (fd < 0) {
    return absl::NotFoundError(absl::StrCat(path, " cannot be opened: ", std::strerror(errno)));
  }
  struct stat st;
  if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    close(fd);
    return absl::InvalidArgumentError(absl::StrCat(path, " is not a regular file"));
  }
  auto map = std::make_shared<Mapping>();
  map->length = static_cast<size_t>(st.st_size);
  if (map->length > 0) {
    map->addr = mmap(nullptr, map->length, PROT_READ, MAP_PRIVATE, fd, 0);
  }
  close(fd);
  if (map->addr == MAP_FAILED) {
    return absl::InvalidArgumentError(absl::StrCat(path, " is empty or cannot be mapped"));
  }
  absl::StatusOr<Array> array =
      ParseNpyHeader(static_cast<const char*>(map->addr), map->length, map);
  if (!array.ok()) return InFile(path, array.status());
  return array;
}

}  // namespace dbs
