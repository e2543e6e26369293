#include "worker/fashion_mnist.h"

#include <zlib.h>

#include <cstdlib>
#include <string>

#include "common/status_matchers.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace dbs {
namespace {

std::string Be32(uint32_t v) {
  return std::string{static_cast<char>(v >> 24), static_cast<char>(v >> 16),
                     static_cast<char>(v >> 8), static_cast<char>(v)};
}

std::string Images(uint32_t n, uint32_t rows, uint32_t cols) {
  std::string s = Be32(0x803) + Be32(n) + Be32(rows) + Be32(cols);
  for (uint32_t i = 0; i < n * rows * cols; ++i) s.push_back(static_cast<char>(i % 256));
  return s;
}

std::string Labels(uint32_t n) {
  std::string s = Be32(0x801) + Be32(n);
  for (uint32_t i = 0; i < n; ++i) s.push_back(static_cast<char>(i % 10));
  return s;
}

void WriteGz(const std::string& path, const std::string& data) {
  gzFile f = gzopen(path.c_str(), "wb");
  ASSERT_NE(f, nullptr);
  ASSERT_EQ(gzwrite(f, data.data(), data.size()), static_cast<int>(data.size()));
  gzclose(f);
}

TEST(ParseIdxTest, ParsesAndLimits) {
  auto d = ParseIdx(Images(5, 2, 3), Labels(5), 0);
  ASSERT_THAT(d, IsOk()) << d.status();
  EXPECT_EQ(d->size, 5);
  EXPECT_EQ(d->rows, 2);
  EXPECT_EQ(d->cols, 3);
  EXPECT_EQ(d->images.size(), 30u);
  EXPECT_EQ(d->images[7], 7);
  EXPECT_EQ(d->labels[3], 3);
  auto limited = ParseIdx(Images(5, 2, 3), Labels(5), 2);
  ASSERT_THAT(limited, IsOk());
  // A limited parse accepts data that stops after the samples kept.
  auto cut = ParseIdx(Images(5, 2, 3).substr(0, 16 + 12), Labels(5).substr(0, 10), 2);
  ASSERT_THAT(cut, IsOk()) << cut.status();
  EXPECT_EQ(cut->images, limited->images);
  EXPECT_EQ(limited->size, 2);
  EXPECT_EQ(limited->images.size(), 12u);
}

TEST(ParseIdxTest, RejectsMalformedFiles) {
  EXPECT_THAT(ParseIdx("junk", Labels(5), 0), StatusCodeIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(ParseIdx(Images(5, 2, 3), Labels(4), 0),
              StatusCodeIs(absl::StatusCode::kInvalidArgument));
  std::string truncated = Images(5, 2, 3);
  truncated.pop_back();
  EXPECT_THAT(ParseIdx(truncated, Labels(5), 0), StatusCodeIs(absl::StatusCode::kInvalidArgument));
  std::string bad_label = Labels(5);
  bad_label.back() = 12;
  EXPECT_THAT(ParseIdx(Images(5, 2, 3), bad_label, 0),
              StatusCodeIs(absl::StatusCode::kInvalidArgument));
}

TEST(LoadFashionMnistTest, ReadsGzippedFilesFromADirectory) {
  const std::string dir = ::testing::TempDir() + "/fmnist";
  ASSERT_EQ(std::system(("mkdir -p " + dir).c_str()), 0);
  WriteGz(dir + "/train-images-idx3-ubyte.gz", Images(6, 28, 28));
  WriteGz(dir + "/train-labels-idx1-ubyte.gz", Labels(6));
  auto d = LoadFashionMnist(dir, true, 0);
  ASSERT_THAT(d, IsOk()) << d.status();
  EXPECT_EQ(d->size, 6);
  EXPECT_EQ(d->labels[5], 5);
  // A limit reads only what it keeps, and keeps the same first samples.
  auto first = LoadFashionMnist(dir, true, 4);
  ASSERT_THAT(first, IsOk()) << first.status();
  EXPECT_EQ(first->size, 4);
  EXPECT_EQ(first->labels[3], 3);
  EXPECT_EQ(first->images,
            std::vector<uint8_t>(d->images.begin(), d->images.begin() + 4 * 28 * 28));
  EXPECT_EQ(ReadMaybeGzip(dir + "/train-labels-idx1-ubyte.gz", 10)->size(), 10u);
}

TEST(LoadFashionMnistTest, MissingDataSetSaysHowToInstallIt) {
  auto d = LoadFashionMnist("/nonexistent/fashion", false, 0);
  EXPECT_THAT(d, StatusCodeIs(absl::StatusCode::kNotFound));
  EXPECT_THAT(std::string(d.status().message()),
              ::testing::HasSubstr("apt-get install dataset-fashion-mnist"));
}

}  // namespace
}  // namespace dbs
