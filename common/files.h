// Small file helpers shared by the server and the worker.
#ifndef DBS_COMMON_FILES_H_
#define DBS_COMMON_FILES_H_

#include <string>

#include "absl/status/status.h"

namespace dbs {

// Writes `contents` to `path` via a uniquely named temporary file, fsync and rename, then syncs the
// directory: readers never see half a file, and a crash leaves the old or the new one.
// UNAVAILABLE (naming the path) when it cannot.
absl::Status WriteFileAtomic(const std::string& path, const std::string& contents);

}  // namespace dbs

#endif  // DBS_COMMON_FILES_H_
