#include "common/shared_memory.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <string>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"

namespace dbs {
namespace {

constexpr size_t kPage = 4096;
// Far beyond any model (a 25M-parameter model is 100 MB); refuses a peer's absurd size before
// anything is mapped.
constexpr uint64_t kMaxRegionBytes = uint64_t{1} << 40;

// F_SEAL_FUTURE_WRITE (linux/fcntl.h; glibc 2.36 does not name it).
#ifdef F_SEAL_FUTURE_WRITE
constexpr int kSealFutureWrite = F_SEAL_FUTURE_WRITE;
#else
constexpr int kSealFutureWrite = 0x0010;
#endif

size_t RoundUp(size_t n, size_t to) { return (n + to - 1) / to * to; }

std::string Errno(const char* what) { return absl::StrCat(what, ": ", std::strerror(errno)); }

// A slot's version, at the start of the region (each on its own cache line).
std::atomic<int64_t>* VersionOf(uint8_t* region, int64_t slot) {
  static_assert(std::atomic<int64_t>::is_always_lock_free, "needs lock-free 64-bit atomics");
  return reinterpret_cast<std::atomic<int64_t>*>(region + 64 * slot);
}

}  // namespace

absl::StatusOr<std::unique_ptr<SharedRegion>> SharedRegion::Create(absl::string_view name,
                                                                   size_t bytes) {
  if (bytes == 0 || bytes > kMaxRegionBytes) {
    return absl::InvalidArgumentError(absl::StrCat("a shared region of ", bytes, " bytes"));
  }
  const int fd = memfd_create(std::string(name).c_str(), MFD_CLOEXEC | MFD_ALLOW_SEALING);
  if (fd < 0) return absl::FailedPreconditionError(Errno("memfd_create"));
  if (ftruncate(fd, static_cast<off_t>(bytes)) != 0 ||
      fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW) != 0) {
    const std::string why = Errno("sizing and sealing a memory file");
    close(fd);
    return absl::FailedPreconditionError(why);
  }
  void* data = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (data == MAP_FAILED) {
    const std::string why = Errno("mmap");
    close(fd);
    return absl::ResourceExhaustedError(why);
  }
  // From now on only this mapping writes the region: nobody who opens the file, even as its
  // owner, can write it or map it writable (F_SEAL_FUTURE_WRITE, Linux 5.1; older kernels
  // refuse the seal and keep the rest).
  if (fcntl(fd, F_ADD_SEALS, kSealFutureWrite | F_SEAL_SEAL) != 0 &&
      fcntl(fd, F_ADD_SEALS, F_SEAL_SEAL) != 0) {
    const std::string why = Errno("sealing a memory file");
    munmap(data, bytes);
    close(fd);
    return absl::FailedPreconditionError(why);
  }
  return std::unique_ptr<SharedRegion>(new SharedRegion(static_cast<uint8_t*>(data), bytes, fd));
}

absl::StatusOr<std::unique_ptr<SharedRegion>> SharedRegion::Open(const RegionLocation& where,
                                                                 absl::string_view name) {
  if (where.pid <= 0 || where.pid > INT32_MAX || where.fd < 0 || where.fd > INT32_MAX ||
      where.bytes == 0 || where.bytes > kMaxRegionBytes) {
    return absl::InvalidArgumentError(absl::StrCat("no shared region at pid ", where.pid, " fd ",
                                                   where.fd, " of ", where.bytes, " bytes"));
  }
  const std::string path = absl::StrCat("/proc/", where.pid, "/fd/", where.fd);
  const int fd = open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    // Another host, another PID namespace, another user, or a process gone: no sharing.
    return absl::FailedPreconditionError(Errno(absl::StrCat("cannot open ", path).c_str()));
  }
  // What the descriptor names: "/memfd:<name> (deleted)" for a memory file.
  char target[256];
  const ssize_t n = readlink(path.c_str(), target, sizeof target - 1);
  const std::string expected = absl::StrCat("/memfd:", name, " ");
  if (n < 0 || !absl::StartsWith(absl::string_view(target, static_cast<size_t>(n)), expected)) {
    close(fd);
    return absl::InvalidArgumentError(
        absl::StrCat(path, ": not a memory file named \"", name, "\""));
  }
  struct stat st;
  std::string refusal;
  const int seals = fcntl(fd, F_GET_SEALS);
  if (fstat(fd, &st) != 0) {
    refusal = Errno("fstat");
  } else if (!S_ISREG(st.st_mode) || st.st_uid != geteuid()) {
    refusal = "not a memory file of this user";
  } else if (seals < 0 || (seals & F_SEAL_SHRINK) == 0) {
    refusal = "not a memory file sealed against shrinking";
  } else if (static_cast<uint64_t>(st.st_size) != where.bytes) {
    refusal = absl::StrCat(st.st_size, " bytes, not ", where.bytes);
  }
  if (!refusal.empty()) {
    close(fd);
    return absl::InvalidArgumentError(absl::StrCat(path, ": ", refusal));
  }
  void* data = mmap(nullptr, where.bytes, PROT_READ, MAP_SHARED, fd, 0);
  const std::string why = data == MAP_FAILED ? Errno("mmap") : "";
  close(fd);  // the mapping keeps the file
  if (data == MAP_FAILED) return absl::ResourceExhaustedError(why);
  return std::unique_ptr<SharedRegion>(
      new SharedRegion(static_cast<uint8_t*>(data), where.bytes, -1));
}

SharedRegion::~SharedRegion() {
  munmap(data_, size_);
  if (fd_ >= 0) close(fd_);
}

RegionLocation SharedRegion::location() const {
  RegionLocation where;
  where.pid = getpid();
  where.fd = fd_;
  where.bytes = size_;
  return where;
}

size_t ParameterSlots::RegionBytes(size_t count) {
  return kPage + 2 * RoundUp(count * sizeof(float), kPage);
}

ParameterSlots::ParameterSlots(SharedRegion* region, size_t count)
    : region_(region), count_(count), slot_bytes_(RoundUp(count * sizeof(float), kPage)) {}

void ParameterSlots::Clear() {
  VersionOf(region_->data(), 0)->store(-1, std::memory_order_release);
  VersionOf(region_->data(), 1)->store(-1, std::memory_order_release);
}

const float* ParameterSlots::SlotAt(int index) const {
  return reinterpret_cast<const float*>(region_->data() + kPage +
                                        static_cast<size_t>(index % 2) * slot_bytes_);
}

float* ParameterSlots::Fp32Slot(int index) { return const_cast<float*>(SlotAt(index)); }

void ParameterSlots::MarkEmpty(int index) {
  VersionOf(region_->data(), index % 2)->store(-1, std::memory_order_relaxed);
  // Readers that see any of the new values see the slot marked empty.
  std::atomic_thread_fence(std::memory_order_release);
}

void ParameterSlots::MarkHolds(int64_t version) {
  if (version >= 0)
    VersionOf(region_->data(), IndexOf(version))->store(version, std::memory_order_release);
}

bool ParameterSlots::Holds(int64_t version) const {
  return version >= 0 &&
         VersionOf(region_->data(), IndexOf(version))->load(std::memory_order_acquire) == version;
}

bool ParameterSlots::Read(int64_t version, absl::Span<float> out, WireDtype rounded_as) const {
  if (version < 0 || out.size() != count_) return false;
  std::atomic<int64_t>* stamp = VersionOf(region_->data(), IndexOf(version));
  if (stamp->load(std::memory_order_acquire) != version) return false;
  CopyRoundedAsWire(SlotAt(IndexOf(version)), count_, rounded_as, out.data());
  std::atomic_thread_fence(std::memory_order_acquire);
  return stamp->load(std::memory_order_relaxed) == version;
}

}  // namespace dbs
