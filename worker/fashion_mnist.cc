#include "worker/fashion_mnist.h"

#include <sys/stat.h>
#include <zlib.h>

#include <algorithm>
#include <fstream>

#include "absl/strings/str_cat.h"
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

}  // namespace

absl::StatusOr<std::string> ReadMaybeGzip(const std::string& path, int64_t max_bytes) {
  if (!Exists(path)) return absl::NotFoundError(absl::StrCat(path, " does not exist"));
  gzFile f = gzopen(path.c_str(), "rb");  // reads plain files transparently
  if (f == nullptr) return absl::UnavailableError(absl::StrCat("cannot open ", path));
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

absl::StatusOr<ImageDataset> ParseIdx(const std::string& images, const std::string& labels,
                                      int64_t limit) {
  if (images.size() < 16 || BigEndian32(images, 0) != 0x00000803) {
    return absl::InvalidArgumentError("not an IDX image file (magic 0x00000803 expected)");
  }
  if (labels.size() < 8 || BigEndian32(labels, 0) != 0x00000801) {
    return absl::InvalidArgumentError("not an IDX label file (magic 0x00000801 expected)");
  }
  const int64_t n = BigEndian32(images, 4);
  const int rows = static_cast<int>(BigEndian32(images, 8));
  const int cols = static_cast<int>(BigEndian32(images, 12));
  if (BigEndian32(labels, 4) != n) {
    return absl::InvalidArgumentError(absl::StrCat("image file has ", n, " images, label file ",
                                                   BigEndian32(labels, 4), " labels"));
  }
  const int64_t pixels = static_cast<int64_t>(rows) * cols;
  ImageDataset out;
  out.size = limit > 0 && limit < n ? limit : n;
  const bool exact = out.size == n;
  const auto fits = [exact](size_t have, int64_t need) {
    return exact ? have == static_cast<size_t>(need) : have >= static_cast<size_t>(need);
  };
  if (!fits(images.size(), 16 + out.size * pixels) || !fits(labels.size(), 8 + out.size)) {
    return absl::InvalidArgumentError("IDX file is truncated or has trailing bytes");
  }
  out.rows = rows;
  out.cols = cols;
  out.images.assign(images.begin() + 16, images.begin() + 16 + out.size * pixels);
  out.labels.assign(labels.begin() + 8, labels.begin() + 8 + out.size);
  for (uint8_t l : out.labels) {
    if (l > 9) return absl::InvalidArgumentError(absl::StrCat("label ", int{l}, " out of range"));
  }
  return out;
}

absl::StatusOr<ImageDataset> LoadFashionMnist(const std::string& dir, bool train, int64_t limit) {
  const std::string prefix = train ? "train" : "t10k";
  auto find = [&](const std::string& base) -> std::string {
    const std::string gz = absl::StrCat(dir, "/", base, ".gz");
    return Exists(gz) ? gz : absl::StrCat(dir, "/", base);
  };
  const std::string images_path = find(prefix + "-images-idx3-ubyte");
  const std::string labels_path = find(prefix + "-labels-idx1-ubyte");
  for (const std::string& p : {images_path, labels_path}) {
    if (!Exists(p)) {
      return absl::NotFoundError(absl::StrCat(
          "Fashion-MNIST not found: ", p,
          "(.gz) is missing. Install Debian's copy with "
          "'sudo apt-get install dataset-fashion-mnist' (files land in ",
          kDefaultFashionMnistDir, "), or point --data_dir at a folder holding the IDX files."));
    }
  }
  // With a limit, read the header and only the samples kept (a small subset loads at once).
  int64_t image_bytes = 0, label_bytes = 0;
  if (limit > 0) {
    DBS_ASSIGN_OR_RETURN(std::string header, ReadMaybeGzip(images_path, 16));
    if (header.size() == 16) {
      image_bytes = 16 + limit * static_cast<int64_t>(BigEndian32(header, 8)) *
                             static_cast<int64_t>(BigEndian32(header, 12));
      label_bytes = 8 + limit;
    }
  }
  DBS_ASSIGN_OR_RETURN(std::string images, ReadMaybeGzip(images_path, image_bytes));
  DBS_ASSIGN_OR_RETURN(std::string labels, ReadMaybeGzip(labels_path, label_bytes));
  absl::StatusOr<ImageDataset> parsed = ParseIdx(images, labels, limit);
  if (!parsed.ok()) {
    return absl::DataLossError(
        absl::StrCat("cannot parse ", images_path, ": ", parsed.status().message()));
  }
  return parsed;
}

}  // namespace dbs
