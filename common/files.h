// Small file helpers shared by the server and the worker.
#ifndef DBS_COMMON_FILES_H_
#define DBS_COMMON_FILES_H_

#include <string>

#include "absl/status/status.h"

namespace dbs {

// Writes `contents` to `path` via a temporary file and rename, so readers never see half a file.
// UNAVAILABLE (naming the path) when it cannot.
absl::Status WriteFileAtomic(const std::string& path, const std::string& contents);

}  // namespace dbs

#endif  // DBS_COMMON_FILES_H_
