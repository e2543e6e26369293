// Small file helpers shared by the server and the worker.
#ifndef DBS_COMMON_FILES_H_
#define DBS_COMMON_FILES_H_

#include <initializer_list>
#include <string>
#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace dbs {

// Writes `contents` to `path` via a uniquely named temporary file, fsync and rename, then syncs the
// directory: readers never see half a file, and a crash leaves the old or the new one.
// UNAVAILABLE (naming the path) when it cannot.
absl::Status WriteFileAtomic(const std::string& path, const std::string& contents);

// The whole file; NOT_FOUND (naming the path) when it cannot be read.
absl::StatusOr<std::string> ReadFile(const std::string& path);

// Reads each named file into its string; an empty path leaves the string empty. NOT_FOUND naming
// the first file that cannot be read.
absl::Status ReadFilesInto(std::initializer_list<std::pair<std::string, std::string*>> files);

// OK when this process can write a file at `path`: its folder exists and lets it write there, and
// `path` is not a folder or a read-only file. INVALID_ARGUMENT naming `what` (the flag), the
// path and the reason otherwise. Creates nothing.
absl::Status CheckWritable(const std::string& path, const std::string& what);

// OK when this process can keep files in the folder `dir`: it exists and lets it write, or it
// does not exist and its parent does (it is created on first use). INVALID_ARGUMENT otherwise.
absl::Status CheckWritableFolder(const std::string& dir, const std::string& what);

// A secret given directly or as a file (whose trailing newlines are dropped); at most one of the
// two may be set. INVALID_ARGUMENT naming `what` otherwise.
absl::StatusOr<std::string> SecretFrom(const std::string& value, const std::string& file,
                                       const std::string& what);

}  // namespace dbs

#endif  // DBS_COMMON_FILES_H_
