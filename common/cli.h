// The command-line contract both binaries share (docs/deploying.md), for people and for
// orchestrators:
//   - `--help` lists every flag of the binary with its help text and default, and exits 0;
//   - every flag can come from an environment variable DBS_<FLAG_IN_UPPER_CASE>; a flag given
//     on the command line wins, and a DBS_* variable that names no flag is a configuration
//     error naming the variable;
//   - exit codes say whether a restart can help (ExitCode).
#ifndef DBS_COMMON_CLI_H_
#define DBS_COMMON_CLI_H_

#include <map>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace dbs {

// What a process's exit code tells whoever started it.
enum ExitCode : int {
  kExitOk = 0,             // the job is done
  kExitFailed = 1,         // the job failed for good (diverged, audit failed): look, do not retry
  kExitBadConfig = 2,      // a flag, variable, file or data set is wrong: permanent, never retry
  kExitUnavailable = 200,  // a peer or port could not be had in time: restart
  kExitRemoved = 201,      // the worker was removed from the job and could not rejoin: restart
  kExitStalled = 202,      // dbs_ps: the job stalled (workers missing): restart with --restore
  kExitInterrupted = 130,  // SIGINT (128 + 2)
  kExitTerminated = 143,   // SIGTERM (128 + 15)
};

// The exit code for a run that ended with `status` (a signal's CANCELLED is the caller's to
// map, since only it knows which signal).
ExitCode ExitCodeFor(const absl::Status& status);

// The environment variable of flag `flag`: DBS_ and the name in upper case.
std::string EnvVarOf(const std::string& flag);

// The command line with the environment folded in: argv[0], then `--flag=value` for every DBS_*
// variable in `env` (and for each of `fallbacks`, flag -> value, unless that flag's variable is
// set), then the real arguments, so that the command line wins. INVALID_ARGUMENT naming the
// variable when a DBS_* variable names none of `flags`.
absl::StatusOr<std::vector<std::string>> ArgsWithEnvironment(
    const std::vector<std::string>& argv, const std::map<std::string, std::string>& env,
    const std::vector<std::string>& flags, const std::map<std::string, std::string>& fallbacks);

// Every flag defined in a file whose name ends with `main_file`, sorted by name.
std::vector<std::string> FlagsOf(const std::string& main_file);

// Whether a binary's flags also come from DBS_* variables. A helper that runs beside another
// binary, in its environment (dbs_health_probe in dbs_ps's container), takes its command line
// alone: the variables there are the other binary's.
enum class FlagSources { kCommandLineAndEnvironment, kCommandLineOnly };

// The --help text: `usage`, then each flag of `main_file` with its default, its variable (when
// read from the environment) and its help.
std::string HelpText(const std::string& usage, const std::string& main_file,
                     FlagSources sources = FlagSources::kCommandLineAndEnvironment);

// Parses the command line of a binary whose flags are defined in `main_file`: prints HelpText
// and exits 0 for --help/-h/--helpfull; folds the environment in (ArgsWithEnvironment, from
// the process's environment) unless `sources` says not to; on a bad variable or flag prints the
// reason and exits kExitBadConfig. Returns the positional arguments.
std::vector<char*> ParseCommandLine(int argc, char** argv, const std::string& usage,
                                    const std::string& main_file,
                                    const std::map<std::string, std::string>& fallbacks = {},
                                    FlagSources sources = FlagSources::kCommandLineAndEnvironment);

// Turns Abseil's mutex deadlock detector off for this process. Debian builds Abseil without
// NDEBUG, which leaves the detector on: every Mutex::Lock then looks its mutex up in one global
// graph under one spin lock, and every destroyed Mutex is removed from it. The binaries call
// this at the start of main; the unit tests, which run the same code without those mains, keep
// the detector.
void SkipDeadlockDetection();

// The process's environment as a map.
std::map<std::string, std::string> Environment();

}  // namespace dbs

#endif  // DBS_COMMON_CLI_H_
