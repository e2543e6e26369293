// The command-line contract: environment variables fold in under the command line, unknown
// DBS_* variables are refused by name, --help lists every flag, exit codes by outcome.
#include "common/cli.h"

#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/synchronization/mutex.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/status_matchers.h"

ABSL_FLAG(int, cli_test_batch, 128, "A test flag: the batch.");
ABSL_FLAG(std::string, cli_test_server, "127.0.0.1:50051", "A test flag: the server.");

namespace dbs {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

const std::vector<std::string> kFlags = {"cli_test_batch", "cli_test_server"};

TEST(CliTest, EnvironmentVariablesComeBeforeTheCommandLineSoItWins) {
  absl::StatusOr<std::vector<std::string>> args =
      ArgsWithEnvironment({"prog", "--cli_test_batch=64", "positional"},
                          {{"DBS_CLI_TEST_BATCH", "96"}, {"HOME", "/root"}}, kFlags, {});
  ASSERT_THAT(args, IsOk());
  EXPECT_THAT(*args,
              ElementsAre("prog", "--cli_test_batch=96", "--cli_test_batch=64", "positional"));
  // Abseil keeps the last value: the command line's.
  std::vector<char*> argv;
  for (std::string& a : *args) argv.push_back(a.data());
  absl::ParseCommandLine(static_cast<int>(argv.size()), argv.data());
  EXPECT_EQ(absl::GetFlag(FLAGS_cli_test_batch), 64);
}

TEST(CliTest, AnUnknownDbsVariableIsAnErrorNamingIt) {
  EXPECT_THAT(ArgsWithEnvironment({"prog"}, {{"DBS_GLOBAL_BACH", "96"}}, kFlags, {}),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("unknown environment variable DBS_GLOBAL_BACH")));
}

TEST(CliTest, FallbacksYieldToTheirOwnVariableAndToTheCommandLine) {
  const std::map<std::string, std::string> torchrun = {{"cli_test_server", "master:29500"}};
  EXPECT_THAT(*ArgsWithEnvironment({"prog"}, {}, kFlags, torchrun),
              ElementsAre("prog", "--cli_test_server=master:29500"));
  EXPECT_THAT(*ArgsWithEnvironment({"prog"}, {{"DBS_CLI_TEST_SERVER", "ps:1"}}, kFlags, torchrun),
              ElementsAre("prog", "--cli_test_server=ps:1"));
  EXPECT_THAT(*ArgsWithEnvironment({"prog", "--cli_test_server=cli:2"}, {}, kFlags, torchrun),
              ElementsAre("prog", "--cli_test_server=master:29500", "--cli_test_server=cli:2"));
}

TEST(CliTest, HelpListsEveryFlagOfTheFileWithItsVariableAndDefault) {
  EXPECT_THAT(FlagsOf("cli_test.cc"), ElementsAre("cli_test_batch", "cli_test_server"));
  const std::string help = HelpText("usage line", "cli_test.cc");
  EXPECT_THAT(help, HasSubstr("usage line"));
  EXPECT_THAT(help, HasSubstr("--cli_test_batch=128  [DBS_CLI_TEST_BATCH]"));
  EXPECT_THAT(help, HasSubstr("A test flag: the server."));
  EXPECT_EQ(EnvVarOf("global_batch"), "DBS_GLOBAL_BATCH");
}

TEST(CliTest, ExitCodesSayWhetherARestartCanHelp) {
  EXPECT_EQ(ExitCodeFor(absl::OkStatus()), kExitOk);
  EXPECT_EQ(ExitCodeFor(absl::InvalidArgumentError("flag")), kExitBadConfig);
  EXPECT_EQ(ExitCodeFor(absl::UnauthenticatedError("secret")), kExitBadConfig);
  EXPECT_EQ(ExitCodeFor(absl::FailedPreconditionError("data set")), kExitBadConfig);
  EXPECT_EQ(ExitCodeFor(absl::UnavailableError("unreachable")), kExitUnavailable);
  EXPECT_EQ(ExitCodeFor(absl::DeadlineExceededError("timeout")), kExitUnavailable);
  EXPECT_EQ(ExitCodeFor(absl::NotFoundError("evicted")), kExitRemoved);
  EXPECT_EQ(ExitCodeFor(absl::DataLossError("audit")), kExitFailed);
  for (int code : {kExitUnavailable, kExitRemoved, kExitStalled, kExitTerminated}) {
    EXPECT_GE(code, 128);
    EXPECT_LE(code, 255);
  }
}

// Locks a then b, then b then a: an order the deadlock detector reports (one thread, so it
// never actually deadlocks).
void InvertLockOrder() {
  absl::Mutex a, b;
  {
    absl::MutexLock la(&a);
    absl::MutexLock lb(&b);
  }
  absl::MutexLock lb(&b);
  absl::MutexLock la(&a);
}

TEST(CliTest, TheBinariesTurnTheDeadlockDetectorOff) {
#if defined(__SANITIZE_THREAD__)
  GTEST_SKIP() << "ThreadSanitizer reports the inverted lock order itself (and should); the plain "
                  "and AddressSanitizer builds run this test";
#endif
  // The premise: this Abseil runs the detector on every lock (Debian builds it without
  // NDEBUG), and it aborts on an inverted order.
  EXPECT_DEATH(InvertLockOrder(), "deadlock");
  SkipDeadlockDetection();
  InvertLockOrder();  // no longer looked at
}

}  // namespace
}  // namespace dbs
