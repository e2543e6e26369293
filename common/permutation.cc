#include "common/permutation.h"

#include <numeric>
#include <utility>

namespace dbs {
namespace {

uint64_t SplitMix64(uint64_t& state) {
  uint64_t z = (state += 0x9e3779b97f4a7c15ULL);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}

// Uniform in [0, bound) without modulo bias (Lemire's rejection on the low word).
uint64_t Below(uint64_t& state, uint64_t bound) {
  const uint64_t threshold = (0 - bound) % bound;
  while (true) {
    const uint64_t r = SplitMix64(state);
    if (r >= threshold) return r % bound;
  }
}

}  // namespace

std::vector<int64_t> EpochPermutation(int64_t n, uint64_t seed) {
  std::vector<int64_t> perm(n > 0 ? n : 0);
  std::iota(perm.begin(), perm.end(), int64_t{0});
  uint64_t state = seed;
  for (int64_t i = n - 1; i > 0; --i) {
    const auto j = static_cast<int64_t>(Below(state, static_cast<uint64_t>(i) + 1));
    std::swap(perm[i], perm[j]);
  }
  return perm;
}

uint64_t EpochSeed(uint64_t job_seed, int epoch) {
  uint64_t state = job_seed ^ (0x5851f42d4c957f2dULL * (static_cast<uint64_t>(epoch) + 1));
  return SplitMix64(state);
}

}  // namespace dbs
