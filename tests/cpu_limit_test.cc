#include "common/cpu_limit.h"

#include <sys/stat.h>

#include <fstream>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/status_matchers.h"

namespace dbs {
namespace {

// A file tree laid out like /proc and /sys/fs/cgroup, under a test's own directory.
class FakeRoot {
 public:
  explicit FakeRoot(const std::string& name)
      : root_(absl::StrCat(::testing::TempDir(), "/cpu_limit_test_", name)) {
    Dir("/proc/self");
  }
  const std::string& path() const { return root_; }

  void Dir(const std::string& rel) {
    std::string at = root_;
    mkdir(at.c_str(), 0755);
    for (absl::string_view part : absl::StrSplit(rel, '/', absl::SkipEmpty())) {
      absl::StrAppend(&at, "/", part);
      mkdir(at.c_str(), 0755);
    }
  }
  void File(const std::string& rel, const std::string& text) {
    Dir(rel.substr(0, rel.find_last_of('/')));
    std::ofstream(root_ + rel) << text;
  }

 private:
  std::string root_;
};

// The limit the tree names; fails the test on an error.
double LimitOf(const FakeRoot& fs) {
  absl::StatusOr<double> cores = CgroupCpuLimitCores(fs.path());
  EXPECT_THAT(cores.status(), IsOk());
  return cores.value_or(-1.0);
}

constexpr char kV1Mounts[] =
    "31 23 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755\n"
    "32 31 0:29 / /sys/fs/cgroup/cpu,cpuacct rw,relatime - cgroup cgroup rw,cpu,cpuacct\n"
    "35 31 0:32 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory\n";

TEST(CgroupCpuLimitTest, ReadsTheV1QuotaOfTheProcesssCgroup) {
  FakeRoot fs("v1");
  fs.File("/proc/self/mountinfo", kV1Mounts);
  fs.File("/proc/self/cgroup", "4:memory:/job\n2:cpu,cpuacct:/job/worker0\n0::/\n");
  fs.File("/sys/fs/cgroup/cpu,cpuacct/cpu.cfs_quota_us", "-1\n");
  fs.File("/sys/fs/cgroup/cpu,cpuacct/cpu.cfs_period_us", "100000\n");
  fs.File("/sys/fs/cgroup/cpu,cpuacct/job/worker0/cpu.cfs_quota_us", "1000\n");
  fs.File("/sys/fs/cgroup/cpu,cpuacct/job/worker0/cpu.cfs_period_us", "11000\n");
  const double cores = LimitOf(fs);
  EXPECT_NEAR(cores, 1.0 / 11, 1e-12);
}

TEST(CgroupCpuLimitTest, AParentsTighterLimitApplies) {
  FakeRoot fs("v1_parent");
  fs.File("/proc/self/mountinfo", kV1Mounts);
  fs.File("/proc/self/cgroup", "2:cpu,cpuacct:/job/worker0\n");
  fs.File("/sys/fs/cgroup/cpu,cpuacct/job/cpu.cfs_quota_us", "50000\n");
  fs.File("/sys/fs/cgroup/cpu,cpuacct/job/cpu.cfs_period_us", "100000\n");
  fs.File("/sys/fs/cgroup/cpu,cpuacct/job/worker0/cpu.cfs_quota_us", "150000\n");
  fs.File("/sys/fs/cgroup/cpu,cpuacct/job/worker0/cpu.cfs_period_us", "100000\n");
  const double cores = LimitOf(fs);
  EXPECT_DOUBLE_EQ(cores, 0.5);
  // And the other way round: the child's own limit is the tighter one.
  fs.File("/sys/fs/cgroup/cpu,cpuacct/job/worker0/cpu.cfs_quota_us", "25000\n");
  EXPECT_DOUBLE_EQ(LimitOf(fs), 0.25);
}

TEST(CgroupCpuLimitTest, ReadsV2CpuMaxInsideAContainersNamespace) {
  // In a container the cgroup namespace shows the container's cgroup as "/", mounted at the
  // root of /sys/fs/cgroup; Kubernetes writes the pod's CPU limit there.
  FakeRoot fs("v2");
  fs.File("/proc/self/mountinfo",
          "29 23 0:26 / /sys/fs/cgroup rw,nosuid - cgroup2 cgroup2 rw,nsdelegate\n");
  fs.File("/proc/self/cgroup", "0::/\n");
  fs.File("/sys/fs/cgroup/cpu.max", "250000 100000\n");
  const double cores = LimitOf(fs);
  EXPECT_DOUBLE_EQ(cores, 2.5);
}

TEST(CgroupCpuLimitTest, V2MaxAndAMissingFileAreNoLimit) {
  FakeRoot fs("v2_max");
  fs.File("/proc/self/mountinfo", "29 23 0:26 / /sys/fs/cgroup rw - cgroup2 cgroup2 rw\n");
  fs.File("/proc/self/cgroup", "0::/user.slice/session-1.scope\n");
  fs.File("/sys/fs/cgroup/user.slice/session-1.scope/cpu.max", "max 100000\n");
  const double cores = LimitOf(fs);
  EXPECT_EQ(cores, 0.0);  // user.slice and the root have no cpu.max here: no limit at all
}

TEST(CgroupCpuLimitTest, AMountOfASubtreeMapsTheCgroupPath) {
  // A v2 hierarchy bind-mounted from /kubepods (mountinfo's root field) with the process in
  // /kubepods/pod1/c1: its directory is the mount point plus /pod1/c1.
  FakeRoot fs("v2_subtree");
  fs.File("/proc/self/mountinfo",
          "29 23 0:26 /kubepods /sys/fs/cgroup\\040x rw - cgroup2 cgroup2 rw\n");
  fs.File("/proc/self/cgroup", "0::/kubepods/pod1/c1\n");
  fs.File("/sys/fs/cgroup x/pod1/c1/cpu.max", "max\n");
  fs.File("/sys/fs/cgroup x/pod1/cpu.max", "50000 100000\n");
  const double cores = LimitOf(fs);
  EXPECT_DOUBLE_EQ(cores, 0.5);
}

TEST(CgroupCpuLimitTest, NoCgroupFileSystemIsNoLimit) {
  FakeRoot fs("none");
  const double none = LimitOf(fs);
  EXPECT_EQ(none, 0.0);
  // A v2 line in /proc/self/cgroup without a cgroup2 mount (hybrid hosts) is not read either.
  fs.File("/proc/self/mountinfo", kV1Mounts);
  fs.File("/proc/self/cgroup", "0::/\n1:cpu,cpuacct:/\n");
  fs.File("/sys/fs/cgroup/cpu,cpuacct/cpu.cfs_quota_us", "-1\n");
  fs.File("/sys/fs/cgroup/cpu,cpuacct/cpu.cfs_period_us", "100000\n");
  const double unlimited = LimitOf(fs);
  EXPECT_EQ(unlimited, 0.0);
}

TEST(CgroupCpuLimitTest, AnUnreadableLimitIsAnErrorNamingTheFile) {
  FakeRoot fs("bad");
  fs.File("/proc/self/mountinfo", "29 23 0:26 / /sys/fs/cgroup rw - cgroup2 cgroup2 rw\n");
  fs.File("/proc/self/cgroup", "0::/\n");
  fs.File("/sys/fs/cgroup/cpu.max", "lots 100000\n");
  absl::StatusOr<double> cores = CgroupCpuLimitCores(fs.path());
  ASSERT_FALSE(cores.ok());
  EXPECT_EQ(cores.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(cores.status().message().find("cpu.max"), std::string::npos);
  EXPECT_NE(cores.status().message().find("lots 100000"), std::string::npos);
}

TEST(EffectiveCpuLimitTest, ALimitOfAllTheCpusIsNone) {
  EXPECT_EQ(EffectiveCpuLimit(0.0, 4), 0.0);
  EXPECT_EQ(EffectiveCpuLimit(4.0, 4), 0.0);
  EXPECT_EQ(EffectiveCpuLimit(8.0, 4), 0.0);
  EXPECT_DOUBLE_EQ(EffectiveCpuLimit(1.5, 4), 1.5);
  EXPECT_DOUBLE_EQ(EffectiveCpuLimit(1.5, 0), 1.5);  // CPU count unknown: the limit stands
}

}  // namespace
}  // namespace dbs
