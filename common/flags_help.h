// --help for a binary whose flags live in a file not named after it (Abseil's default shows only
// flags defined in a file matching the program name, so `dbs_ps --help` would list none).
#ifndef DBS_COMMON_FLAGS_HELP_H_
#define DBS_COMMON_FLAGS_HELP_H_

#include <string>

#include "absl/flags/usage_config.h"
#include "absl/strings/match.h"
#include "absl/strings/string_view.h"

namespace dbs {

// Makes --help and --helpshort list the flags defined in files ending with `main_file`
// (e.g. "ps_main.cc"). Call in main before absl::ParseCommandLine.
inline void HelpListsFlagsOf(const std::string& main_file) {
  absl::FlagsUsageConfig config;
  config.contains_help_flags = [main_file](absl::string_view file) {
    return absl::EndsWith(file, main_file);
  };
  config.contains_helpshort_flags = config.contains_help_flags;
  absl::SetFlagsUsageConfig(config);
}

}  // namespace dbs

#endif  // DBS_COMMON_FLAGS_HELP_H_
