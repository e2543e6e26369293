#ifndef DBS_COMMON_MULTIVERSION_H_
#define DBS_COMMON_MULTIVERSION_H_

// DBS_WIDE_VECTORS on a loop over every parameter: GCC compiles it twice, for x86-64's
// baseline (SSE2, which the binaries target so that they run on any x86-64) and for AVX2, and
// the loader picks the AVX2 copy on a CPU that has it (an ifunc). No FMA: the two copies do the
// same IEEE operations in the same order, so they give the same bits. Off under the sanitizers
// (their runtimes and ifunc resolvers do not mix well); those builds run the baseline copy,
// which keeps it tested.
#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && \
    !defined(__SANITIZE_ADDRESS__) && !defined(__SANITIZE_THREAD__)
#define DBS_WIDE_VECTORS __attribute__((target_clones("avx2", "default")))
#else
#define DBS_WIDE_VECTORS
#endif

#endif  // DBS_COMMON_MULTIVERSION_H_
