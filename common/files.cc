#include "common/files.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <sstream>

#include "absl/strings/str_cat.h"

namespace dbs {
namespace {

absl::Status Errno(const std::string& what, const std::string& path) {
  return absl::UnavailableError(absl::StrCat("cannot ", what, " ", path, ": ", strerror(errno)));
}

std::string DirOf(const std::string& path) {
  const size_t slash = path.rfind('/');
  if (slash == std::string::npos) return ".";
  return slash == 0 ? "/" : path.substr(0, slash);
}

}  // namespace

absl::Status WriteFileAtomic(const std::string& path, const std::string& contents) {
  // A name no other writer (thread or process) uses at the same time.
  static std::atomic<uint64_t> counter{0};
  const std::string tmp = absl::StrCat(path, ".tmp.", getpid(), ".", counter++);
  const int fd = open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
  if (fd < 0) return Errno("write", tmp);
  size_t done = 0;
  while (done < contents.size()) {
    const ssize_t n = write(fd, contents.data() + done, contents.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      const absl::Status failed = Errno("write", tmp);
      close(fd);
      unlink(tmp.c_str());
      return failed;
    }
    done += static_cast<size_t>(n);
  }
  if (fsync(fd) != 0) {
    const absl::Status failed = Errno("sync", tmp);
    close(fd);
    unlink(tmp.c_str());
    return failed;
  }
  if (close(fd) != 0) {
    unlink(tmp.c_str());
    return Errno("close", tmp);
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    const absl::Status failed = Errno(absl::StrCat("rename ", tmp, " to"), path);
    unlink(tmp.c_str());
    return failed;
  }
  // The rename itself must survive a crash: sync the directory entry.
  const std::string dir = DirOf(path);
  const int dfd = open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dfd < 0) return Errno("open directory", dir);
  const bool synced = fsync(dfd) == 0;
  close(dfd);
  if (!synced) return Errno("sync directory", dir);
  return absl::OkStatus();
}

absl::StatusOr<std::string> ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot read ", path, ": ", strerror(errno)));
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

absl::Status ReadFilesInto(std::initializer_list<std::pair<std::string, std::string*>> files) {
  for (const auto& [path, out] : files) {
    if (path.empty()) continue;
    absl::StatusOr<std::string> contents = ReadFile(path);
    if (!contents.ok()) return contents.status();
    *out = *std::move(contents);
  }
  return absl::OkStatus();
}

absl::Status CheckWritable(const std::string& path, const std::string& what) {
  const auto refused = [&](const std::string& why) {
    return absl::InvalidArgumentError(absl::StrCat(what, "=", path, ": ", why));
  };
  struct stat st;
  if (stat(path.c_str(), &st) == 0) {
    if (S_ISDIR(st.st_mode)) return refused("is a folder; name a file in it");
    if (access(path.c_str(), W_OK) != 0)
      return refused(absl::StrCat("cannot be written: ", strerror(errno)));
  }
  const std::string dir = DirOf(path);
  if (access(dir.c_str(), W_OK | X_OK) != 0) {
    return refused(absl::StrCat("cannot write in ", dir, ": ", strerror(errno)));
  }
  return absl::OkStatus();
}

absl::Status CheckWritableFolder(const std::string& dir, const std::string& what) {
  struct stat st;
  if (stat(dir.c_str(), &st) == 0) {
    if (!S_ISDIR(st.st_mode)) {
      return absl::InvalidArgumentError(absl::StrCat(what, "=", dir, ": is not a folder"));
    }
    if (access(dir.c_str(), W_OK | X_OK) != 0) {
      return absl::InvalidArgumentError(
          absl::StrCat(what, "=", dir, ": cannot write in it: ", strerror(errno)));
    }
    return absl::OkStatus();
  }
  std::string parent = dir;
  while (parent.size() > 1 && parent.back() == '/') parent.pop_back();
  return CheckWritable(parent, what);
}

absl::StatusOr<std::string> SecretFrom(const std::string& value, const std::string& file,
                                       const std::string& what) {
  if (!value.empty() && !file.empty()) {
    return absl::InvalidArgumentError(absl::StrCat("give ", what, " or its file, not both"));
  }
  if (file.empty()) return value;
  absl::StatusOr<std::string> read = ReadFile(file);
  if (!read.ok()) return read.status();
  std::string secret = *std::move(read);
  while (!secret.empty() && (secret.back() == '\n' || secret.back() == '\r')) secret.pop_back();
  if (secret.empty()) return absl::InvalidArgumentError(absl::StrCat(file, " is empty"));
  return secret;
}

}  // namespace dbs
