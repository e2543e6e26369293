// How many random clusters a simulator property test checks: `default_count`, or the first N
// seeds when the environment variable `variable` says N (at least `minimum`), as the sanitizer
// runs do to check the same code paths at a fraction of the time.
#ifndef DBS_TESTS_CLUSTERS_TO_CHECK_H_
#define DBS_TESTS_CLUSTERS_TO_CHECK_H_

#include <cstdlib>

#include "absl/strings/numbers.h"

namespace dbs {

inline int ClustersToCheck(const char* variable, int default_count, int minimum) {
  const char* text = std::getenv(variable);
  int n = 0;
  if (text == nullptr || !absl::SimpleAtoi(text, &n) || n < minimum) return default_count;
  return n;
}

}  // namespace dbs

#endif  // DBS_TESTS_CLUSTERS_TO_CHECK_H_
