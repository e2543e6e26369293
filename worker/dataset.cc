#include "worker/dataset.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zlib.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <set>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "common/status_macros.h"

namespace dbs {
namespace {

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

int64_t Product(const std::vector<int64_t>& dims, size_t from = 0) {
  int64_t n = 1;
  for (size_t i = from; i < dims.size(); ++i) n *= dims[i];
  return n;
}

std::string ShapeString(const std::vector<int64_t>& shape) {
  return absl::StrCat("[", absl::StrJoin(shape, ", "), "]");
}

// Prefixes a parse error with the file it came from.
absl::Status InFile(const std::string& path, const absl::Status& status) {
  return absl::Status(status.code(), absl::StrCat(path, ": ", status.message()));
}

// Class labels as int64, whatever integer type they came in. INVALID_ARGUMENT for a negative one.
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

// Labels must lie below a data set's known number of classes.
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

// ------------------------------------------------------------------------------------ IDX

struct IdxFiles {
  std::string train_images, train_labels, test_images, test_labels;
};

// The gzipped file when it exists, else the plain one.
std::string GzOrPlain(const std::string& dir, const std::string& base) {
  const std::string gz = absl::StrCat(dir, "/", base, ".gz");
  return Exists(gz) ? gz : absl::StrCat(dir, "/", base);
}

// Finds the one file of `dir` whose name holds `kind` ("images-idx" or "labels-idx") and one of
// `splits` ("train", or "t10k"/"test").
absl::StatusOr<std::string> FindIdxFile(const std::string& dir, const std::string& kind,
                                        const std::vector<std::string>& splits) {
  DIR* d = opendir(dir.c_str());
  if (d == nullptr) return absl::NotFoundError(absl::StrCat("idx: no folder ", dir));
  std::set<std::string> bases;  // names without .gz
  while (dirent* e = readdir(d)) {
    const std::string name = e->d_name;
    if (!absl::StrContains(name, kind)) continue;
    for (const std::string& split : splits) {
      if (absl::StrContains(name, split)) bases.insert(std::string(absl::StripSuffix(name, ".gz")));
    }
  }
  closedir(d);
  const std::string what = absl::StrCat(splits.front() == "train" ? "training" : "test", " ",
                                        absl::StrContains(kind, "images") ? "images" : "labels");
  if (bases.empty()) {
    return absl::NotFoundError(absl::StrCat("idx: ", dir, " has no ", what, " file (a name with '",
                                            splits.front(), "' and '", kind,
                                            "', e.g. train-images-idx3-ubyte.gz)"));
  }
  if (bases.size() > 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("idx: ", dir, " has several ", what, " files: ", absl::StrJoin(bases, ", ")));
  }
  return GzOrPlain(dir, *bases.begin());
}

absl::StatusOr<Dataset> LoadIdxPair(const std::string& images_path, const std::string& labels_path,
                                    int64_t limit) {
  for (const std::string& p : {images_path, labels_path}) {
    if (!Exists(p)) return absl::NotFoundError(absl::StrCat(p, " does not exist"));
  }
  // With a limit, read the header and only the images kept (a small subset loads at once).
  int64_t image_bytes = 0;
  if (limit > 0) {
    DBS_ASSIGN_OR_RETURN(std::string header, ReadMaybeGzip(images_path, 8));
    if (header.size() == 8 && (BigEndian32(header, 0) & 0xFFFFFF00u) == 0x800) {
      const int dims = static_cast<int>(BigEndian32(header, 0) & 0xFF);
      DBS_ASSIGN_OR_RETURN(std::string dim_bytes, ReadMaybeGzip(images_path, 4 + 4 * dims));
      if (dim_bytes.size() == static_cast<size_t>(4 + 4 * dims)) {
        int64_t row = 1;
        for (int i = 1; i < dims && row <= (int64_t{1} << 30); ++i) {
          row *= BigEndian32(dim_bytes, 4 + 4 * i);  // < 2^62; ParseIdx refuses a corrupt one
        }
        if (row <= (int64_t{1} << 30) && limit <= (int64_t{1} << 30)) {
          image_bytes = 4 + 4 * dims + limit * row;
        }
      }
    }
  }
  DBS_ASSIGN_OR_RETURN(std::string images, ReadMaybeGzip(images_path, image_bytes));
  DBS_ASSIGN_OR_RETURN(std::string labels, ReadMaybeGzip(labels_path));
  absl::StatusOr<Dataset> parsed = ParseIdx(images, labels, limit);
  if (!parsed.ok()) return InFile(images_path, parsed.status());
  return parsed;
}

absl::StatusOr<Data> LoadIdx(const std::string& spec, const IdxFiles& files, int64_t train_limit,
                             int64_t test_limit) {
  Data data;
  data.spec = spec;
  DBS_ASSIGN_OR_RETURN(data.train,
                       LoadIdxPair(files.train_images, files.train_labels, train_limit));
  DBS_ASSIGN_OR_RETURN(data.test, LoadIdxPair(files.test_images, files.test_labels, test_limit));
  return data;
}

// ------------------------------------------------------------------------------------ CIFAR-10

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

// ------------------------------------------------------------------------------------ .npy

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

// Sets num_classes from the labels when the reader does not know it.
void CountClasses(Data* data) {
  if (data->num_classes > 0 || data->train.targets.dtype() != DType::kInt64) return;
  data->num_classes = 1 + std::max(data->train.max_label, data->test.max_label);
}

}  // namespace

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

absl::StatusOr<std::string> ReadMaybeGzip(const std::string& path, int64_t max_bytes) {
  if (!Exists(path)) return absl::NotFoundError(absl::StrCat(path, " does not exist"));
  gzFile f = gzopen(path.c_str(), "rb");  // reads plain files transparently
  if (f == nullptr) {
    return absl::UnavailableError(absl::StrCat("cannot open ", path, ": ", std::strerror(errno)));
  }
  std::string out;
  char buf[1 << 16];
  while (max_bytes <= 0 || static_cast<int64_t>(out.size()) < max_bytes) {
    const int64_t room = max_bytes > 0 ? max_bytes - static_cast<int64_t>(out.size())
                                       : static_cast<int64_t>(sizeof(buf));
    const int n = gzread(f, buf, static_cast<unsigned>(std::min<int64_t>(room, sizeof(buf))));
    if (n < 0) {
      int errnum = 0;
      std::string msg = gzerror(f, &errnum);
      gzclose(f);
      return absl::DataLossError(absl::StrCat("cannot decompress ", path, ": ", msg));
    }
    if (n == 0) break;
    out.append(buf, n);
  }
  gzclose(f);
  return out;
}

absl::StatusOr<Dataset> ParseIdx(const std::string& images, const std::string& labels,
                                 int64_t limit) {
  if (images.size() < 8 || (BigEndian32(images, 0) & 0xFFFFFF00u) != 0x800) {
    return absl::InvalidArgumentError(
        "not an IDX file of unsigned bytes (magic 0x000008NN expected)");
  }
  if (labels.size() < 8 || BigEndian32(labels, 0) != 0x00000801) {
    return absl::InvalidArgumentError("not an IDX label file (magic 0x00000801 expected)");
  }
  const int dims = static_cast<int>(BigEndian32(images, 0) & 0xFF);
  const size_t header = 4 + 4 * static_cast<size_t>(dims);
  if (dims < 1 || images.size() < header) {
    return absl::InvalidArgumentError("IDX header is truncated");
  }
  std::vector<int64_t> shape;
  int64_t elements = 1;
  for (int i = 0; i < dims; ++i) {
    shape.push_back(BigEndian32(images, 4 + 4 * i));
    const int64_t factor = std::max<int64_t>(shape.back(), 1);
    if (elements > (int64_t{1} << 48) / factor) {  // checked before multiplying: no overflow
      return absl::InvalidArgumentError("IDX header gives an impossible size");
    }
    elements *= factor;
  }
  const int64_t n = shape[0];
  if (BigEndian32(labels, 4) != n) {
    return absl::InvalidArgumentError(absl::StrCat("image file has ", n, " images, label file ",
                                                   BigEndian32(labels, 4), " labels"));
  }
  if (dims == 3) shape.insert(shape.begin() + 1, 1);  // [N, H, W] images get a channel
  const int64_t row = Product(shape, 1);
  const int64_t kept = limit > 0 && limit < n ? limit : n;
  const bool exact = kept == n;
  const auto fits = [exact](size_t have, int64_t need) {
    return exact ? have == static_cast<size_t>(need) : have >= static_cast<size_t>(need);
  };
  if (!fits(images.size(), header + kept * row) || labels.size() != static_cast<size_t>(8 + n)) {
    return absl::InvalidArgumentError(
        absl::StrCat("IDX file is truncated or has trailing bytes (", n, " samples of shape ",
                     ShapeString({shape.begin() + 1, shape.end()}), " need ", header + n * row,
                     " bytes of images and ", 8 + n, " of labels; there are ", images.size(),
                     " and ", labels.size(), ")"));
  }
  shape[0] = kept;
  Dataset out;
  out.inputs = Array::Of(DType::kUint8, shape, images.substr(header, kept * row));
  DBS_ASSIGN_OR_RETURN(
      out.targets, LabelsAsInt64(Array::Of(DType::kUint8, {n}, labels.substr(8)), "IDX labels"));
  out.max_label = MaxLabel(out.targets);
  out.targets = out.targets.FirstRows(kept);
  return out;
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

absl::StatusOr<Data> LoadData(const std::string& spec, const std::string& fashion_mnist_dir,
                              int64_t train_limit, int64_t test_limit) {
  const size_t colon = spec.find(':');
  const std::string reader = spec.substr(0, colon);
  const std::string arg = colon == std::string::npos ? "" : spec.substr(colon + 1);
  absl::StatusOr<Data> data;
  if (reader == "fashion-mnist") {
    const std::string dir = arg.empty() ? fashion_mnist_dir : arg;
    IdxFiles files{
        GzOrPlain(dir, "train-images-idx3-ubyte"), GzOrPlain(dir, "train-labels-idx1-ubyte"),
        GzOrPlain(dir, "t10k-images-idx3-ubyte"), GzOrPlain(dir, "t10k-labels-idx1-ubyte")};
    for (const std::string& p :
         {files.train_images, files.train_labels, files.test_images, files.test_labels}) {
      if (!Exists(p)) {
        return absl::NotFoundError(absl::StrCat(
            "Fashion-MNIST not found: ", p,
            "(.gz) is missing. Install Debian's copy with "
            "'sudo apt-get install dataset-fashion-mnist' (files land in ",
            kDefaultFashionMnistDir,
            "), or point --data_dir (or --data=fashion-mnist:DIR) at a folder holding the IDX "
            "files."));
      }
    }
    data = LoadIdx("fashion-mnist:" + dir, files, train_limit, test_limit);
    if (data.ok()) {
      data->num_classes = 10;
      data->published = {{0.2860}, {0.3530}, "Fashion-MNIST's own"};
      DBS_RETURN_IF_ERROR(CheckLabelsBelow(data->train.targets, 10, data->spec));
      DBS_RETURN_IF_ERROR(CheckLabelsBelow(data->test.targets, 10, data->spec));
    }
  } else if (reader == "idx" && !arg.empty()) {
    IdxFiles files;
    DBS_ASSIGN_OR_RETURN(files.train_images, FindIdxFile(arg, "images-idx", {"train"}));
    DBS_ASSIGN_OR_RETURN(files.train_labels, FindIdxFile(arg, "labels-idx", {"train"}));
    DBS_ASSIGN_OR_RETURN(files.test_images, FindIdxFile(arg, "images-idx", {"t10k", "test"}));
    DBS_ASSIGN_OR_RETURN(files.test_labels, FindIdxFile(arg, "labels-idx", {"t10k", "test"}));
    data = LoadIdx("idx:" + arg, files, train_limit, test_limit);
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
