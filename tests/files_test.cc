#include "common/files.h"

#include <dirent.h>
#include <sys/stat.h>

#include <fstream>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/status_matchers.h"

namespace dbs {
namespace {

std::string Read(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

std::vector<std::string> Files(const std::string& dir) {
  std::vector<std::string> out;
  DIR* d = opendir(dir.c_str());
  while (dirent* e = readdir(d)) {
    const std::string name = e->d_name;
    if (name != "." && name != "..") out.push_back(name);
  }
  closedir(d);
  return out;
}

TEST(WriteFileAtomicTest, WritesAndReplaces) {
  const std::string dir = ::testing::TempDir() + "/files_test_basic";
  mkdir(dir.c_str(), 0755);
  const std::string path = dir + "/f";
  ASSERT_THAT(WriteFileAtomic(path, "first"), IsOk());
  EXPECT_EQ(Read(path), "first");
  ASSERT_THAT(WriteFileAtomic(path, std::string(1 << 20, 'x')), IsOk());
  EXPECT_EQ(Read(path), std::string(1 << 20, 'x'));
  EXPECT_THAT(Files(dir), ::testing::ElementsAre("f")) << "no temporary file is left";
}

// Each writer has a temporary file of its own, so two writers of one path (the periodic and the
// end-of-epoch checkpoint, say) never interleave into one file.
TEST(WriteFileAtomicTest, ConcurrentWritersNeverMixTheirContents) {
  const std::string dir = ::testing::TempDir() + "/files_test_concurrent";
  mkdir(dir.c_str(), 0755);
  const std::string path = dir + "/f";
  std::set<std::string> written;
  for (int i = 0; i < 8; ++i) written.insert(std::string(256 << 10, static_cast<char>('a' + i)));
  for (int round = 0; round < 10; ++round) {
    std::vector<std::thread> writers;
    for (const std::string& contents : written) {
      writers.emplace_back(
          [&path, &contents] { ASSERT_THAT(WriteFileAtomic(path, contents), IsOk()); });
    }
    for (std::thread& t : writers) t.join();
    EXPECT_EQ(written.count(Read(path)), 1u) << "the file is one writer's contents, whole";
  }
  EXPECT_THAT(Files(dir), ::testing::ElementsAre("f"));
}

TEST(WriteFileAtomicTest, AnUnwritablePlaceIsAClearError) {
  EXPECT_THAT(WriteFileAtomic("/nonexistent-dir/f", "x"),
              StatusIs(absl::StatusCode::kUnavailable, ::testing::HasSubstr("/nonexistent-dir/f")));
}

}  // namespace
}  // namespace dbs
