// KeepFreedMemoryMapped: under tcmalloc (the default build) the release rate becomes 0 whatever
// it was, TCMALLOC_RELEASE_RATE included, and memory freed by one round of a step-like pattern is
// reused by the next without faulting it in again; under another allocator (the sanitizer builds)
// nothing is set and nothing claims to be.
#include "common/malloc_tuning.h"

#include <sys/resource.h>

#include <cstdlib>
#include <cstring>
#include <vector>

#include "gtest/gtest.h"

namespace dbs {
namespace {

#ifdef DBS_EXPECT_TCMALLOC
constexpr bool kExpectTcmalloc = true;
#else
constexpr bool kExpectTcmalloc = false;
#endif

long MinorFaults() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  return u.ru_minflt;
}

// Minor page faults per round over `rounds` rounds, each allocating, touching and freeing the
// same 200 buffers of 16 KiB-1 MiB (about 100 MiB): what a server's step does with the buffers
// of its pushes.
long FaultsPerRound(int rounds) {
  const long before = MinorFaults();
  for (int r = 0; r < rounds; ++r) {
    unsigned seed = 1;
    std::vector<char*> buffers;
    for (int k = 0; k < 200; ++k) {
      const size_t n = (1 + rand_r(&seed) % 64) * size_t{16384};
      char* p = static_cast<char*>(std::malloc(n));
      std::memset(p, r, n);
      buffers.push_back(p);
    }
    for (char* p : buffers) std::free(p);
  }
  return (MinorFaults() - before) / rounds;
}

TEST(MallocTuningTest, TheBuildsAllocatorIsTheOneReported) {
  EXPECT_EQ(MemoryReleaseRate().has_value(), kExpectTcmalloc);
}

TEST(MallocTuningTest, FreedMemoryIsReusedWithoutFaults) {
  if (!kExpectTcmalloc) {
    EXPECT_FALSE(KeepFreedMemoryMapped());
    EXPECT_EQ(MemoryReleaseRate(), std::nullopt);
    return;
  }
  // The test runs with TCMALLOC_RELEASE_RATE=10 (its BUILD rule), tcmalloc's most eager.
  ASSERT_EQ(MemoryReleaseRate(), 10.0);
  FaultsPerRound(5);  // the heap grows to the pattern's size
  const long eager = FaultsPerRound(30);
  EXPECT_TRUE(KeepFreedMemoryMapped());
  EXPECT_EQ(MemoryReleaseRate(), 0.0);
  const long kept = FaultsPerRound(30);
  std::printf("minor faults per round: %ld handing freed memory back, %ld keeping it\n", eager,
              kept);
  EXPECT_LT(kept * 3, eager);
}

}  // namespace
}  // namespace dbs
