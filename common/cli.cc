#include "common/cli.h"

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <iostream>

#include "absl/container/flat_hash_set.h"
#include "absl/flags/commandlineflag.h"
#include "absl/flags/parse.h"
#include "absl/flags/reflection.h"
#include "absl/flags/usage.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"

extern char** environ;

namespace dbs {
namespace {

constexpr char kPrefix[] = "DBS_";

// Abseil ends the process with exit(1) on an unknown flag or a bad value; while it parses,
// this turns that into kExitBadConfig (a configuration error is permanent).
std::atomic<bool> g_parsing{false};

void ExitBadConfigWhileParsing() {
  if (!g_parsing.load()) return;
  std::fflush(stdout);
  std::fflush(stderr);
  _exit(kExitBadConfig);
}

bool IsHelp(const std::string& arg) {
  return arg == "--help" || arg == "-help" || arg == "-h" || arg == "--helpfull" ||
         arg == "-helpfull" || arg == "--helpshort" || arg == "-helpshort";
}

}  // namespace

ExitCode ExitCodeFor(const absl::Status& status) {
  switch (status.code()) {
    case absl::StatusCode::kOk:
      return kExitOk;
    case absl::StatusCode::kInvalidArgument:
    case absl::StatusCode::kUnauthenticated:
    case absl::StatusCode::kFailedPrecondition:
    case absl::StatusCode::kOutOfRange:
      return kExitBadConfig;
    case absl::StatusCode::kUnavailable:
    case absl::StatusCode::kDeadlineExceeded:
    case absl::StatusCode::kResourceExhausted:
    case absl::StatusCode::kAlreadyExists:
      return kExitUnavailable;
    case absl::StatusCode::kNotFound:
    case absl::StatusCode::kPermissionDenied:
      return kExitRemoved;
    default:
      return kExitFailed;
  }
}

std::string EnvVarOf(const std::string& flag) {
  return absl::StrCat(kPrefix, absl::AsciiStrToUpper(flag));
}

absl::StatusOr<std::vector<std::string>> ArgsWithEnvironment(
    const std::vector<std::string>& argv, const std::map<std::string, std::string>& env,
    const std::vector<std::string>& flags, const std::map<std::string, std::string>& fallbacks) {
  std::map<std::string, std::string> by_var;  // DBS_X -> x
  for (const std::string& f : flags) by_var[EnvVarOf(f)] = f;
  std::vector<std::string> out;
  if (!argv.empty()) out.push_back(argv[0]);
  for (const auto& [flag, value] : fallbacks) {
    if (env.count(EnvVarOf(flag)) == 0) out.push_back(absl::StrCat("--", flag, "=", value));
  }
  for (const auto& [var, value] : env) {
    if (!absl::StartsWith(var, kPrefix)) continue;
    auto it = by_var.find(var);
    if (it == by_var.end()) {
      return absl::InvalidArgumentError(
          absl::StrCat("unknown environment variable ", var, ": no flag --",
                       absl::AsciiStrToLower(var.substr(sizeof(kPrefix) - 1)),
                       " (see --help for the flags and their variables)"));
    }
    out.push_back(absl::StrCat("--", it->second, "=", value));
  }
  // The command line comes last: a flag given twice takes its last value.
  for (size_t i = 1; i < argv.size(); ++i) out.push_back(argv[i]);
  return out;
}

std::vector<std::string> FlagsOf(const std::string& main_file) {
  std::vector<std::string> names;
  for (const auto& [name, flag] : absl::GetAllFlags()) {
    if (absl::EndsWith(flag->Filename(), main_file)) names.emplace_back(name);
  }
  std::sort(names.begin(), names.end());
  return names;
}

std::string HelpText(const std::string& usage, const std::string& main_file, FlagSources sources) {
  const bool env = sources == FlagSources::kCommandLineAndEnvironment;
  std::string out =
      absl::StrCat(usage, env ? "\n\nFlags (each also read from the environment variable "
                                "shown; the command line wins):\n"
                              : "\n\nFlags (from the command line only):\n");
  for (const std::string& name : FlagsOf(main_file)) {
    const absl::CommandLineFlag* flag = absl::FindCommandLineFlag(name);
    absl::StrAppend(&out, "  --", name, "=", flag->DefaultValue(),
                    env ? absl::StrCat("  [", EnvVarOf(name), "]") : "", "\n      ", flag->Help(),
                    "\n");
  }
  return out;
}

std::map<std::string, std::string> Environment() {
  std::map<std::string, std::string> env;
  for (char** e = environ; e != nullptr && *e != nullptr; ++e) {
    const std::string kv(*e);
    const size_t eq = kv.find('=');
    if (eq != std::string::npos) env[kv.substr(0, eq)] = kv.substr(eq + 1);
  }
  return env;
}

void SkipDeadlockDetection() {
  absl::SetMutexDeadlockDetectionMode(absl::OnDeadlockCycle::kIgnore);
}

std::vector<char*> ParseCommandLine(int argc, char** argv, const std::string& usage,
                                    const std::string& main_file,
                                    const std::map<std::string, std::string>& fallbacks,
                                    FlagSources sources) {
  absl::SetProgramUsageMessage(usage);
  std::vector<std::string> args(argv, argv + argc);
  for (size_t i = 1; i < args.size() && args[i] != "--"; ++i) {
    if (IsHelp(args[i])) {
      std::cout << HelpText(usage, main_file, sources) << std::flush;
      std::exit(kExitOk);
    }
  }
  absl::StatusOr<std::vector<std::string>> folded = ArgsWithEnvironment(
      args,
      sources == FlagSources::kCommandLineAndEnvironment ? Environment()
                                                         : std::map<std::string, std::string>{},
      FlagsOf(main_file), fallbacks);
  if (!folded.ok()) {
    std::cerr << args[0] << ": " << folded.status().message() << std::endl;
    std::exit(kExitBadConfig);
  }
  // Abseil keeps pointers into argv for the positional arguments: the storage lives on.
  static std::vector<std::string>* storage = new std::vector<std::string>(std::move(*folded));
  static std::vector<char*>* pointers = new std::vector<char*>();
  for (std::string& s : *storage) pointers->push_back(s.data());
  std::atexit(ExitBadConfigWhileParsing);
  g_parsing.store(true);
  std::vector<char*> rest =
      absl::ParseCommandLine(static_cast<int>(pointers->size()), pointers->data());
  g_parsing.store(false);
  return rest;
}

}  // namespace dbs
