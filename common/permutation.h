// The per-epoch permutation of the training set, identical on every worker and platform.
//
// Workers never exchange sample lists: the plan carries a seed and ranges of positions in the
// permutation that this function produces. It uses its own generator (splitmix64) and Fisher-Yates
// shuffle, so the result does not depend on the standard library's distributions.
#ifndef DBS_COMMON_PERMUTATION_H_
#define DBS_COMMON_PERMUTATION_H_

#include <cstdint>
#include <vector>

namespace dbs {

// Returns a permutation of [0, n) determined only by (n, seed).
std::vector<int64_t> EpochPermutation(int64_t n, uint64_t seed);

// The seed of `epoch`'s permutation in a job seeded with `job_seed`.
uint64_t EpochSeed(uint64_t job_seed, int epoch);

}  // namespace dbs

#endif  // DBS_COMMON_PERMUTATION_H_
