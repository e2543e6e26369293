// The IDX reader: Fashion-MNIST (Debian's copy by default) and any MNIST-family IDX files.
#include <dirent.h>
#include <zlib.h>

#include <set>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/strip.h"
#include "common/status_macros.h"
#include "worker/data_formats.h"
#include "worker/dataset.h"

namespace dbs {
namespace {

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

}  // namespace

absl::StatusOr<Data> LoadFashionMnist(const std::string& dir, int64_t train_limit,
                                      int64_t test_limit) {
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
  DBS_ASSIGN_OR_RETURN(Data data, LoadIdx("fashion-mnist:" + dir, files, train_limit, test_limit));
  data.num_classes = 10;
  data.published = {{0.2860}, {0.3530}, "Fashion-MNIST's own"};
  DBS_RETURN_IF_ERROR(CheckLabelsBelow(data.train.targets, 10, data.spec));
  DBS_RETURN_IF_ERROR(CheckLabelsBelow(data.test.targets, 10, data.spec));
  return data;
}

absl::StatusOr<Data> LoadIdxFolder(const std::string& dir, int64_t train_limit,
                                   int64_t test_limit) {
  IdxFiles files;
  DBS_ASSIGN_OR_RETURN(files.train_images, FindIdxFile(dir, "images-idx", {"train"}));
  DBS_ASSIGN_OR_RETURN(files.train_labels, FindIdxFile(dir, "labels-idx", {"train"}));
  DBS_ASSIGN_OR_RETURN(files.test_images, FindIdxFile(dir, "images-idx", {"t10k", "test"}));
  DBS_ASSIGN_OR_RETURN(files.test_labels, FindIdxFile(dir, "labels-idx", {"t10k", "test"}));
  return LoadIdx("idx:" + dir, files, train_limit, test_limit);
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

}  // namespace dbs
