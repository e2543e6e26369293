#include "common/shared_memory.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace dbs {
namespace {

using ::testing::HasSubstr;

TEST(SharedRegionTest, APeerSeesTheBytesWrittenAndTheWriterSeesNoCopy) {
  auto region = SharedRegion::Create("test", 10000);
  ASSERT_TRUE(region.ok()) << region.status();
  const RegionLocation where = (*region)->location();
  EXPECT_EQ(where.bytes, 10000u);
  auto peer = SharedRegion::Open(where, "test");
  ASSERT_TRUE(peer.ok()) << peer.status();
  (*region)->data()[9999] = 42;
  EXPECT_EQ((*peer)->data()[9999], 42);
  EXPECT_EQ((*peer)->data()[0], 0);  // zero-filled
}

TEST(SharedRegionTest, AnotherProcessOpensItThroughProc) {
  auto region = SharedRegion::Create("test", 4096);
  ASSERT_TRUE(region.ok()) << region.status();
  (*region)->data()[100] = 7;
  const RegionLocation where = (*region)->location();
  const pid_t child = fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    // The child's pid differs: it opens the parent's descriptor by the parent's pid.
    auto peer = SharedRegion::Open(where, "test");
    _exit(peer.ok() && (*peer)->data()[100] == 7 ? 0 : 1);
  }
  int status = 0;
  ASSERT_EQ(waitpid(child, &status, 0), child);
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 0);
}

// Only the creator's own mapping writes a region: a process that opens it (even of the same
// user, even asking to write) can neither write it nor map it writable, so the server's slots
// (in fp32 its parameters themselves) and a worker's gradient change only as their owner
// writes them.
TEST(SharedRegionTest, NobodyButItsCreatorCanWriteIt) {
  auto region = SharedRegion::Create("test", 4096);
  ASSERT_TRUE(region.ok()) << region.status();
  (*region)->data()[0] = 1;  // the creator's mapping writes
  const RegionLocation where = (*region)->location();
  const std::string path = "/proc/" + std::to_string(where.pid) + "/fd/" + std::to_string(where.fd);
  const int fd = open(path.c_str(), O_RDWR | O_CLOEXEC);
  ASSERT_GE(fd, 0) << "the owner may open it";
  constexpr int kSealFutureWrite = 0x0010;  // F_SEAL_FUTURE_WRITE
  if ((fcntl(fd, F_GET_SEALS) & kSealFutureWrite) == 0) {
    close(fd);
    GTEST_SKIP() << "this kernel (before Linux 5.1) has no F_SEAL_FUTURE_WRITE";
  }
  EXPECT_EQ(write(fd, "x", 1), -1) << "but not write it";
  EXPECT_EQ(pwrite(fd, "x", 1, 10), -1);
  void* writable = mmap(nullptr, 4096, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  EXPECT_EQ(writable, MAP_FAILED) << "nor map it writable";
  if (writable != MAP_FAILED) munmap(writable, 4096);
  EXPECT_EQ(fcntl(fd, F_ADD_SEALS, F_SEAL_WRITE), -1) << "nor change its seals";
  close(fd);
  EXPECT_EQ((*region)->data()[10], 0);
  EXPECT_EQ((*region)->data()[0], 1);
}

TEST(SharedRegionTest, RefusesWhatIsNotASealedMemoryFileOfTheRightSize) {
  auto region = SharedRegion::Create("test", 8192);
  ASSERT_TRUE(region.ok()) << region.status();
  RegionLocation where = (*region)->location();

  where.bytes = 4096;  // the file is larger: a peer's claim that does not match
  EXPECT_THAT(SharedRegion::Open(where, "test").status().message(),
              HasSubstr("8192 bytes, not 4096"));
  where.bytes = 16384;  // or smaller: mapping it would fault past its end
  EXPECT_FALSE(SharedRegion::Open(where, "test").ok());

  // A descriptor of an ordinary file (which its owner could shrink under the mapping).
  const std::string path = ::testing::TempDir() + "/plain";
  const int fd = open(path.c_str(), O_RDWR | O_CREAT | O_TRUNC, 0600);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(ftruncate(fd, 4096), 0);
  RegionLocation plain{getpid(), fd, 4096};
  EXPECT_THAT(SharedRegion::Open(plain, "test").status().message(), HasSubstr("memory file"));
  // A memory file of another name (which a peer might point at to read it).
  auto other = SharedRegion::Create("other", 8192);
  ASSERT_TRUE(other.ok());
  EXPECT_THAT(SharedRegion::Open((*other)->location(), "test").status().message(),
              HasSubstr("not a memory file named \"test\""));
  // Unsealed: its owner could shrink it under the mapping.
  const int unsealed = memfd_create("test", MFD_CLOEXEC);
  ASSERT_GE(unsealed, 0);
  ASSERT_EQ(ftruncate(unsealed, 4096), 0);
  EXPECT_THAT(SharedRegion::Open({getpid(), unsealed, 4096}, "test").status().message(),
              HasSubstr("sealed against shrinking"));
  close(unsealed);
  close(fd);

  EXPECT_EQ(SharedRegion::Open({0, 3, 4096}, "test").status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(SharedRegion::Open({getpid(), -1, 4096}, "test").status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(SharedRegion::Open({getpid(), 3, uint64_t{1} << 50}, "test").status().code(),
            absl::StatusCode::kInvalidArgument);
  // A descriptor no process has: what a peer on another host names.
  EXPECT_EQ(SharedRegion::Open({getpid(), 100000, 4096}, "test").status().code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(SharedRegion::Create("test", 0).status().code(), absl::StatusCode::kInvalidArgument);
}

// fp32 slots of `n` values made here (`writer`, cleared) and mapped again read-only as a
// worker maps them (`reader`).
struct Slots {
  void Make(size_t n) {
    auto made = SharedRegion::Create("slots", ParameterSlots::RegionBytes(n));
    ASSERT_TRUE(made.ok());
    region = std::move(*made);
    writer = std::make_unique<ParameterSlots>(region.get(), n);
    writer->Clear();
    auto opened = SharedRegion::Open(region->location(), "slots");
    ASSERT_TRUE(opened.ok());
    peer = std::move(*opened);
    reader = std::make_unique<ParameterSlots>(peer.get(), n);
  }
  // The writer's protocol (the server's store): the slot marked empty, written, stamped.
  void Begin(int64_t version) { writer->MarkEmpty(ParameterSlots::IndexOf(version)); }
  void Write(int64_t version, size_t offset, absl::Span<const float> values) {
    std::copy(values.begin(), values.end(),
              writer->Fp32Slot(ParameterSlots::IndexOf(version)) + offset);
  }
  std::unique_ptr<SharedRegion> region, peer;
  std::unique_ptr<ParameterSlots> writer, reader;
};

TEST(ParameterSlotsTest, EachVersionInItsSlotUntilTheVersionTwoLaterIsBegun) {
  const size_t n = 1000;
  Slots slots;
  ASSERT_NO_FATAL_FAILURE(slots.Make(n));
  ParameterSlots& writer = *slots.writer;
  const ParameterSlots& reader = *slots.reader;
  std::vector<float> out(n);
  EXPECT_FALSE(reader.Read(0, absl::MakeSpan(out)));  // nothing written: not version 0's zeros

  std::vector<float> v4(n, 4.0f), v5(n, 5.0f);
  v4[n - 1] = -1.5f;
  slots.Begin(4);
  slots.Write(4, 0, absl::MakeConstSpan(v4).subspan(0, 600));
  EXPECT_FALSE(reader.Read(4, absl::MakeSpan(out)));  // half written
  slots.Write(4, 600, absl::MakeConstSpan(v4).subspan(600));
  writer.MarkHolds(4);
  ASSERT_TRUE(reader.Read(4, absl::MakeSpan(out)));
  EXPECT_EQ(out, v4);
  EXPECT_FALSE(reader.Read(5, absl::MakeSpan(out)));
  EXPECT_FALSE(reader.Read(2, absl::MakeSpan(out)));  // same slot, another version

  slots.Begin(5);
  slots.Write(5, 0, v5);
  writer.MarkHolds(5);
  ASSERT_TRUE(reader.Read(4, absl::MakeSpan(out)));  // the version before stays readable
  ASSERT_TRUE(reader.Read(5, absl::MakeSpan(out)));
  EXPECT_EQ(out, v5);

  slots.Begin(6);  // version 4's slot
  EXPECT_FALSE(reader.Read(4, absl::MakeSpan(out)));
  // abandoned (never stamped): the slot stays empty
  EXPECT_FALSE(reader.Read(6, absl::MakeSpan(out)));
  EXPECT_FALSE(writer.Holds(6));
  EXPECT_TRUE(writer.Holds(5));
  std::vector<float> wrong(n - 1);
  EXPECT_FALSE(reader.Read(5, absl::MakeSpan(wrong)));
}

// The slots hold fp32 whatever the job's wire dtype: a reader of a 16-bit job gets the values
// rounded as the wire rounds them, exactly what an answer over gRPC decodes to.
TEST(ParameterSlotsTest, AReaderOfA16BitJobRoundsAsTheWireRounds) {
  const size_t n = 5;
  Slots slots;
  ASSERT_NO_FATAL_FAILURE(slots.Make(n));
  EXPECT_EQ(ParameterSlots::RegionBytes(n), 3u * 4096u);  // head, two slots
  const std::vector<float> values = {1.0f, 1.00390625f, -3.1f, 0.0f, 65504.0f};
  slots.Begin(1);
  slots.Write(1, 0, values);
  slots.writer->MarkHolds(1);
  for (WireDtype dtype : {WireDtype::kBf16, WireDtype::kFp16, WireDtype::kFp32}) {
    std::vector<float> out(n);
    ASSERT_TRUE(slots.reader->Read(1, absl::MakeSpan(out), dtype));
    std::vector<uint8_t> wire(n * BytesPerValue(dtype));
    EncodeValues(values, dtype, wire.data());
    std::vector<float> decoded(n);
    DecodeValues(wire.data(), dtype, absl::MakeSpan(decoded));
    EXPECT_EQ(out, decoded) << WireDtypeName(dtype);
  }
  std::vector<float> out(n);
  ASSERT_TRUE(slots.reader->Read(1, absl::MakeSpan(out), WireDtype::kBf16));
  EXPECT_NE(out[2], values[2]) << "-3.1 is not a bf16 value";
  EXPECT_EQ(out[1], 1.0f) << "1 + 2^-8 rounds to even in bf16";
}

// A writer in another process rewrites the slots as fast as it can, every value of version v
// equal to v; every read that succeeds must hold one version's values only.
TEST(ParameterSlotsTest, AReadThatRacesAWriteIsRefusedNeverTorn) {
  const size_t n = 1 << 16;
  Slots slots;
  ASSERT_NO_FATAL_FAILURE(slots.Make(n));
  ParameterSlots& writer = *slots.writer;
  const ParameterSlots& reader = *slots.reader;
  // Where the writer stands: the version it is writing.
  auto progress = SharedRegion::Create("progress", 64);
  ASSERT_TRUE(progress.ok());
  auto* writing = reinterpret_cast<std::atomic<int64_t>*>((*progress)->data());
  const pid_t child = fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    std::vector<float> values(n);
    for (int64_t v = 0; v < 3000; ++v) {
      std::fill(values.begin(), values.end(), static_cast<float>(v));
      writing->store(v);
      slots.Begin(v);
      for (size_t at = 0; at < n; at += 4096) {
        slots.Write(v, at, absl::MakeConstSpan(values).subspan(at, 4096));
      }
      writer.MarkHolds(v);
    }
    writing->store(-1);
    _exit(0);
  }
  std::vector<float> out(n);
  int ok = 0, refused = 0, torn = 0;
  for (int64_t at = 0; (at = writing->load()) >= 0 && torn == 0;) {
    // The version being written (refused unless done meanwhile) and the one before it (done,
    // unless overwritten meanwhile).
    for (int64_t v : {at, at - 1}) {
      if (!reader.Read(v, absl::MakeSpan(out))) {
        ++refused;
        continue;
      }
      ++ok;
      for (float x : out) torn += x != static_cast<float>(v);
    }
  }
  int status = 0;
  ASSERT_EQ(waitpid(child, &status, 0), child);
  EXPECT_EQ(torn, 0) << "a read returned values of two versions";
  EXPECT_GT(ok, 0);
  EXPECT_GT(refused, 0);
  RecordProperty("reads_ok", ok);
  RecordProperty("reads_refused", refused);
}

}  // namespace
}  // namespace dbs
