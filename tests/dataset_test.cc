#include "worker/dataset.h"

#include <zlib.h>

#include <cstdlib>
#include <cstring>
#include <fstream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/status_matchers.h"

namespace dbs {
namespace {

using ::testing::DoubleNear;
using ::testing::ElementsAre;
using ::testing::HasSubstr;

std::string Be32(uint32_t v) {
  return std::string{static_cast<char>(v >> 24), static_cast<char>(v >> 16),
                     static_cast<char>(v >> 8), static_cast<char>(v)};
}

std::string Images(uint32_t n, uint32_t rows, uint32_t cols) {
  std::string s = Be32(0x803) + Be32(n) + Be32(rows) + Be32(cols);
  for (uint32_t i = 0; i < n * rows * cols; ++i) s.push_back(static_cast<char>(i % 256));
  return s;
}

std::string Labels(uint32_t n, uint32_t classes = 10) {
  std::string s = Be32(0x801) + Be32(n);
  for (uint32_t i = 0; i < n; ++i) s.push_back(static_cast<char>(i % classes));
  return s;
}

std::string Dir(const std::string& name) {
  const std::string dir = ::testing::TempDir() + "/" + name;
  EXPECT_EQ(std::system(("rm -rf " + dir + " && mkdir -p " + dir).c_str()), 0);
  return dir;
}

void WriteGz(const std::string& path, const std::string& data) {
  gzFile f = gzopen(path.c_str(), "wb");
  ASSERT_NE(f, nullptr);
  ASSERT_EQ(gzwrite(f, data.data(), data.size()), static_cast<int>(data.size()));
  gzclose(f);
}

void Write(const std::string& path, const std::string& data) {
  std::ofstream(path, std::ios::binary) << data;
}

template <typename T>
std::string Bytes(const std::vector<T>& values) {
  return std::string(reinterpret_cast<const char*>(values.data()), values.size() * sizeof(T));
}

// A .npy file as NumPy writes it: magic, version, header length, a padded dict, the data.
std::string Npy(const std::string& descr, const std::vector<int64_t>& shape,
                const std::string& data, int version = 1, bool fortran = false) {
  std::string dims = absl::StrJoin(shape, ", ");
  if (shape.size() == 1) dims += ",";
  std::string header =
      absl::StrCat("{'descr': '", descr, "', 'fortran_order': ", fortran ? "True" : "False",
                   ", 'shape': (", dims, "), }");
  const size_t prefix = version == 1 ? 10 : 12;
  while ((prefix + header.size() + 1) % 64 != 0) header.push_back(' ');
  header.push_back('\n');
  std::string out = "\x93NUMPY";
  out.push_back(static_cast<char>(version));
  out.push_back('\0');
  const size_t len = header.size();
  out.push_back(static_cast<char>(len & 0xFF));
  out.push_back(static_cast<char>(len >> 8));
  if (version != 1) out += std::string(2, '\0');
  return out + header + data;
}

std::vector<int64_t> Labels64(const Array& a) {
  return std::vector<int64_t>(a.values<int64_t>(), a.values<int64_t>() + a.rows());
}

// ------------------------------------------------------------------------------------ IDX

TEST(ParseIdxTest, ParsesAndLimits) {
  auto d = ParseIdx(Images(5, 2, 3), Labels(5), 0);
  ASSERT_THAT(d, IsOk()) << d.status();
  EXPECT_THAT(d->inputs.shape(), ElementsAre(5, 1, 2, 3));
  EXPECT_EQ(d->inputs.dtype(), DType::kUint8);
  EXPECT_EQ(d->inputs.values<uint8_t>()[7], 7);
  EXPECT_EQ(Labels64(d->targets)[3], 3);
  // A limited parse accepts images that stop after the samples kept.
  auto cut = ParseIdx(Images(5, 2, 3).substr(0, 16 + 12), Labels(5), 2);
  ASSERT_THAT(cut, IsOk()) << cut.status();
  EXPECT_THAT(cut->inputs.shape(), ElementsAre(2, 1, 2, 3));
  EXPECT_EQ(std::memcmp(cut->inputs.data(), d->inputs.data(), 12), 0);
  EXPECT_THAT(Labels64(cut->targets), ElementsAre(0, 1));
  EXPECT_EQ(cut->max_label, 4);  // over the whole label file
}

TEST(ParseIdxTest, RejectsMalformedFiles) {
  EXPECT_THAT(ParseIdx("junk", Labels(5), 0), StatusCodeIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(ParseIdx(Images(5, 2, 3), Labels(4), 0),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("5 images")));
  std::string truncated = Images(5, 2, 3);
  truncated.pop_back();
  EXPECT_THAT(ParseIdx(truncated, Labels(5), 0),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("truncated")));
  const std::string huge = Be32(0x803) + Be32(0xFFFFFFFF) + Be32(0xFFFFFFFF) + Be32(0xFFFFFFFF);
  EXPECT_THAT(ParseIdx(huge, Labels(5), 0),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("impossible size")));
}

TEST(LoadDataTest, FashionMnistReadsGzippedFilesAndLimits) {
  const std::string dir = Dir("fmnist");
  WriteGz(dir + "/train-images-idx3-ubyte.gz", Images(6, 28, 28));
  WriteGz(dir + "/train-labels-idx1-ubyte.gz", Labels(6));
  Write(dir + "/t10k-images-idx3-ubyte", Images(3, 28, 28));  // plain files work too
  Write(dir + "/t10k-labels-idx1-ubyte", Labels(3));
  auto d = LoadData("fashion-mnist", dir, 0, 0);
  ASSERT_THAT(d, IsOk()) << d.status();
  EXPECT_EQ(d->train.inputs.rows(), 6);
  EXPECT_EQ(d->test.inputs.rows(), 3);
  EXPECT_EQ(d->num_classes, 10);
  EXPECT_THAT(d->published.mean, ElementsAre(0.2860));
  // A limit reads only what it keeps, and keeps the same first samples.
  auto first = LoadData("fashion-mnist:" + dir, "/elsewhere", 4, 0);
  ASSERT_THAT(first, IsOk()) << first.status();
  EXPECT_EQ(first->train.inputs.rows(), 4);
  EXPECT_EQ(std::memcmp(first->train.inputs.data(), d->train.inputs.data(), 4 * 28 * 28), 0);
  EXPECT_EQ(ReadMaybeGzip(dir + "/train-labels-idx1-ubyte.gz", 10)->size(), 10u);
}

TEST(LoadDataTest, MissingFashionMnistSaysHowToInstallIt) {
  auto d = LoadData("fashion-mnist", "/nonexistent/fashion", 0, 0);
  EXPECT_THAT(
      d, StatusIs(absl::StatusCode::kNotFound, HasSubstr("apt-get install dataset-fashion-mnist")));
}

TEST(LoadDataTest, FashionMnistRefusesALabelAboveNine) {
  const std::string dir = Dir("fmnist_bad");
  Write(dir + "/train-images-idx3-ubyte", Images(12, 28, 28));
  Write(dir + "/train-labels-idx1-ubyte", Labels(12, 12));
  Write(dir + "/t10k-images-idx3-ubyte", Images(3, 28, 28));
  Write(dir + "/t10k-labels-idx1-ubyte", Labels(3));
  EXPECT_THAT(LoadData("fashion-mnist", dir, 0, 0),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("label 10 of sample 10 is out of range (10 classes")));
}

TEST(LoadDataTest, IdxFindsAnyMnistFamilyNamesAndCountsTheClasses) {
  const std::string dir = Dir("emnist");
  WriteGz(dir + "/emnist-letters-train-images-idx3-ubyte.gz", Images(30, 20, 20));
  WriteGz(dir + "/emnist-letters-train-labels-idx1-ubyte.gz", Labels(30, 26));
  WriteGz(dir + "/emnist-letters-test-images-idx3-ubyte.gz", Images(5, 20, 20));
  WriteGz(dir + "/emnist-letters-test-labels-idx1-ubyte.gz", Labels(5, 26));
  auto d = LoadData("idx:" + dir, "", 10, 0);
  ASSERT_THAT(d, IsOk()) << d.status();
  EXPECT_EQ(d->num_classes, 26);  // from the whole files, not the 10 samples kept
  EXPECT_THAT(d->train.inputs.shape(), ElementsAre(10, 1, 20, 20));
  EXPECT_TRUE(d->published.mean.empty());
}

TEST(LoadDataTest, IdxSaysWhatIsMissingOrAmbiguous) {
  const std::string dir = Dir("idx_bad");
  WriteGz(dir + "/train-images-idx3-ubyte.gz", Images(3, 20, 20));
  EXPECT_THAT(LoadData("idx:" + dir, "", 0, 0),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("no training labels file")));
  WriteGz(dir + "/train-labels-idx1-ubyte.gz", Labels(3));
  WriteGz(dir + "/other-train-labels-idx1-ubyte.gz", Labels(3));
  EXPECT_THAT(LoadData("idx:" + dir, "", 0, 0),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("several training labels")));
}

TEST(LoadDataTest, IdxTruncatedFileNamesTheFile) {
  const std::string dir = Dir("idx_cut");
  Write(dir + "/train-images-idx3-ubyte", Images(4, 20, 20).substr(0, 500));
  Write(dir + "/train-labels-idx1-ubyte", Labels(4));
  Write(dir + "/t10k-images-idx3-ubyte", Images(2, 20, 20));
  Write(dir + "/t10k-labels-idx1-ubyte", Labels(2));
  EXPECT_THAT(LoadData("idx:" + dir, "", 0, 0),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("train-images-idx3-ubyte: IDX file is truncated")));
}

// ------------------------------------------------------------------------------------ CIFAR-10

std::string CifarRecords(int n, int first_label) {
  std::string s;
  for (int i = 0; i < n; ++i) {
    s.push_back(static_cast<char>((first_label + i) % 10));
    for (int p = 0; p < 3 * 32 * 32; ++p) s.push_back(static_cast<char>((i + p) % 251));
  }
  return s;
}

std::string CifarDir(const std::string& name) {
  const std::string dir = Dir(name);
  for (int b = 1; b <= 5; ++b) {
    Write(absl::StrCat(dir, "/data_batch_", b, ".bin"), CifarRecords(3, b));
  }
  Write(dir + "/test_batch.bin", CifarRecords(2, 0));
  return dir;
}

TEST(LoadDataTest, Cifar10ReadsTheBinaryBatches) {
  const std::string dir = CifarDir("cifar");
  auto d = LoadData("cifar10:" + dir, "", 0, 0);
  ASSERT_THAT(d, IsOk()) << d.status();
  EXPECT_THAT(d->train.inputs.shape(), ElementsAre(15, 3, 32, 32));
  EXPECT_THAT(d->test.inputs.shape(), ElementsAre(2, 3, 32, 32));
  EXPECT_EQ(d->num_classes, 10);
  EXPECT_EQ(d->published.mean.size(), 3u);
  // Batch 2's first record is sample 3, its label 2, its first pixel 0 and its second 1.
  EXPECT_EQ(Labels64(d->train.targets)[3], 2);
  EXPECT_EQ(d->train.inputs.values<uint8_t>()[3 * 3072 + 1], 1);
  auto limited = LoadData("cifar10:" + dir, "", 4, 1);
  ASSERT_THAT(limited, IsOk());
  EXPECT_EQ(limited->train.inputs.rows(), 4);
  EXPECT_EQ(limited->test.inputs.rows(), 1);
}

TEST(LoadDataTest, Cifar10RefusesBadFiles) {
  const std::string dir = CifarDir("cifar_bad");
  Write(dir + "/data_batch_2.bin", CifarRecords(3, 0).substr(0, 5000));
  EXPECT_THAT(LoadData("cifar10:" + dir, "", 0, 0),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("data_batch_2.bin: not CIFAR-10 binary records")));
  std::string bad_label = CifarRecords(3, 0);
  bad_label[3073] = 10;
  Write(dir + "/data_batch_2.bin", bad_label);
  EXPECT_THAT(LoadData("cifar10:" + dir, "", 0, 0),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("label 10 of sample 1")));
  std::remove((dir + "/data_batch_4.bin").c_str());
  EXPECT_THAT(LoadData("cifar10:" + dir, "", 0, 0),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("data_batch_4.bin")));
}

// ------------------------------------------------------------------------------------ .npy

TEST(MapNpyTest, MapsEachSupportedTypeAndVersion) {
  const std::string dir = Dir("npy_types");
  Write(dir + "/f.npy", Npy("<f4", {2, 3}, Bytes<float>({1, 2, 3, 4, 5, 6})));
  Write(dir + "/u.npy", Npy("|u1", {4}, "abcd", /*version=*/2));
  Write(dir + "/i.npy", Npy("<i8", {2}, Bytes<int64_t>({7, 9}), /*version=*/3));
  auto f = MapNpy(dir + "/f.npy");
  ASSERT_THAT(f, IsOk()) << f.status();
  EXPECT_EQ(f->dtype(), DType::kFloat32);
  EXPECT_THAT(f->shape(), ElementsAre(2, 3));
  EXPECT_EQ(f->values<float>()[5], 6.0f);
  auto u = MapNpy(dir + "/u.npy");
  ASSERT_THAT(u, IsOk()) << u.status();
  EXPECT_THAT(u->shape(), ElementsAre(4));
  EXPECT_EQ(u->values<uint8_t>()[3], 'd');
  auto i = MapNpy(dir + "/i.npy");
  ASSERT_THAT(i, IsOk()) << i.status();
  EXPECT_EQ(i->values<int64_t>()[1], 9);
}

TEST(MapNpyTest, RefusesWhatItCannotReadWithTheReason) {
  const std::string dir = Dir("npy_bad");
  const std::string data = Bytes<float>({1, 2, 3, 4});
  Write(dir + "/short.npy", Npy("<f4", {2, 3}, data));
  EXPECT_THAT(MapNpy(dir + "/short.npy"),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("short.npy: truncated: shape [2, 3] of float32 needs 24 bytes")));
  Write(dir + "/fortran.npy", Npy("<f4", {2, 2}, data, 1, /*fortran=*/true));
  EXPECT_THAT(MapNpy(dir + "/fortran.npy"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("np.ascontiguousarray")));
  Write(dir + "/big.npy", Npy(">f4", {4}, data));
  EXPECT_THAT(MapNpy(dir + "/big.npy"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr(">f4 is not supported")));
  Write(dir + "/huge.npy", Npy("<f4", {int64_t{1} << 40, int64_t{1} << 40}, data));
  EXPECT_THAT(MapNpy(dir + "/huge.npy"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("impossible shape")));
  Write(dir + "/text.npy", "x,y\n1,2\n");
  EXPECT_THAT(MapNpy(dir + "/text.npy"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("not a NumPy .npy file")));
  EXPECT_THAT(MapNpy(dir + "/absent.npy"), StatusCodeIs(absl::StatusCode::kNotFound));
}

struct NpySet {
  std::string x, y, tx, ty;
  std::string Spec(bool with_test = true) const {
    return "npy:" + x + "," + y + (with_test ? "," + tx + "," + ty : "");
  }
};

NpySet WriteNpySet(const std::string& name, const std::string& y_descr, const std::string& y_data,
                   const std::vector<int64_t>& y_shape) {
  const std::string dir = Dir(name);
  NpySet s{dir + "/x.npy", dir + "/y.npy", dir + "/tx.npy", dir + "/ty.npy"};
  std::vector<float> x(4 * 3);
  for (size_t i = 0; i < x.size(); ++i) x[i] = static_cast<float>(i);
  Write(s.x, Npy("<f4", {4, 3}, Bytes(x)));
  Write(s.y, Npy(y_descr, y_shape, y_data));
  Write(s.tx, Npy("<f4", {1, 3}, Bytes<float>({1, 2, 3})));
  std::vector<int64_t> ty_shape = y_shape;
  ty_shape[0] = 1;
  Write(s.ty, Npy(y_descr, ty_shape, y_data.substr(0, y_data.size() / 4)));
  return s;
}

TEST(LoadDataTest, NpyWithLabels) {
  const NpySet s = WriteNpySet("npy_labels", "<i8", Bytes<int64_t>({0, 4, 2, 1}), {4});
  auto d = LoadData(s.Spec(), "", 3, 0);
  ASSERT_THAT(d, IsOk()) << d.status();
  EXPECT_EQ(d->num_classes, 5);
  EXPECT_THAT(d->train.inputs.shape(), ElementsAre(3, 3));
  EXPECT_THAT(Labels64(d->train.targets), ElementsAre(0, 4, 2));
  EXPECT_EQ(d->test.inputs.rows(), 1);
  // Without test files the test set is empty.
  auto no_test = LoadData(s.Spec(false), "", 0, 0);
  ASSERT_THAT(no_test, IsOk()) << no_test.status();
  EXPECT_EQ(no_test->test.inputs.rows(), 0);
  EXPECT_THAT(no_test->test.inputs.shape(), ElementsAre(0, 3));
}

TEST(LoadDataTest, NpyWithRealValuedTargets) {
  // float64 targets are converted to float32; the inputs stay mapped.
  const NpySet s =
      WriteNpySet("npy_real", "<f8", Bytes<double>({0.5, 1, 1.5, 2, 2.5, 3, 3.5, 4}), {4, 2});
  auto d = LoadData(s.Spec(), "", 0, 0);
  ASSERT_THAT(d, IsOk()) << d.status();
  EXPECT_EQ(d->num_classes, 0);
  EXPECT_EQ(d->train.targets.dtype(), DType::kFloat32);
  EXPECT_THAT(d->train.targets.shape(), ElementsAre(4, 2));
  EXPECT_EQ(d->train.targets.values<float>()[7], 4.0f);
}

TEST(LoadDataTest, NpyRefusesInconsistentFiles) {
  const NpySet s = WriteNpySet("npy_bad_set", "<i8", Bytes<int64_t>({0, -1, 2, 1}), {4});
  EXPECT_THAT(LoadData(s.Spec(), "", 0, 0),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("y.npy: label -1 of sample 1 is negative")));
  Write(s.y, Npy("<i8", {3}, Bytes<int64_t>({0, 1, 2})));
  EXPECT_THAT(LoadData(s.Spec(), "", 0, 0),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("has 4 samples but")));
  Write(s.y, Npy("<i8", {4}, Bytes<int64_t>({0, 1, 2, 3})));
  Write(s.tx, Npy("<f4", {1, 2}, Bytes<float>({1, 2})));
  EXPECT_THAT(LoadData(s.Spec(), "", 0, 0),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("samples of shape [2]")));
  Write(s.x, Npy("<f8", {4, 3}, Bytes<double>(std::vector<double>(12))));
  EXPECT_THAT(LoadData(s.Spec(), "", 0, 0),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("inputs are float64")));
  EXPECT_THAT(LoadData("npy:" + s.x, "", 0, 0),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("TRAIN_X.npy,TRAIN_Y.npy")));
}

TEST(LoadDataTest, UnknownReaderListsTheReaders) {
  EXPECT_THAT(LoadData("csv:/tmp/x.csv", "", 0, 0),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("cifar10:DIR")));
  EXPECT_THAT(LoadData("idx:", "", 0, 0), StatusCodeIs(absl::StatusCode::kInvalidArgument));
}

// ------------------------------------------------------------------------------------
// Normalisation

TEST(NormalizationTest, ChannelsOfARow) {
  EXPECT_EQ(NormalizationChannels({3, 32, 32}), 3);
  EXPECT_EQ(NormalizationChannels({1, 28, 28}), 1);
  EXPECT_EQ(NormalizationChannels({28, 28}), 1);
  EXPECT_EQ(NormalizationChannels({13}), 13);
  EXPECT_EQ(NormalizationChannels({}), 1);
}

TEST(NormalizationTest, ComputesPerChannelStatisticsOfScaledBytes) {
  // Two samples [2, 1, 2]: channel 0 holds 0, 255, 0, 255; channel 1 holds 51 four times.
  const Array x =
      Array::Of(DType::kUint8, {2, 2, 1, 2}, std::string{0, '\xff', 51, 51, 0, '\xff', 51, 51});
  const Normalization n = ComputeNormalization(x);
  EXPECT_THAT(n.mean, ElementsAre(DoubleNear(0.5, 1e-12), DoubleNear(0.2, 1e-12)));
  EXPECT_THAT(n.std, ElementsAre(DoubleNear(0.5, 1e-12), 1.0));  // a constant channel: std 1
}

TEST(NormalizationTest, ChoosesFromTheFlag) {
  Data data;
  data.train.inputs = Array::Of(DType::kFloat32, {2, 2}, Bytes<float>({1, 2, 3, 6}));
  data.train.targets = Array::Of(DType::kInt64, {2}, Bytes<int64_t>({0, 1}));
  auto none = ChooseNormalization("auto", data);  // float inputs, no published figures
  ASSERT_THAT(none, IsOk());
  EXPECT_TRUE(none->mean.empty());
  auto train = ChooseNormalization("train", data);
  ASSERT_THAT(train, IsOk());
  EXPECT_THAT(train->mean, ElementsAre(2.0, 4.0));
  EXPECT_THAT(train->std, ElementsAre(1.0, 2.0));
  auto given = ChooseNormalization("0.5/0.25", data);  // one figure for every channel
  ASSERT_THAT(given, IsOk()) << given.status();
  EXPECT_THAT(given->mean, ElementsAre(0.5, 0.5));
  EXPECT_THAT(ChooseNormalization("1,2,3/1,1,1", data),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("have 2 channels")));
  EXPECT_THAT(ChooseNormalization("0.5/0", data),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("standard deviations > 0")));
  data.published = {{0.1, 0.2}, {0.3, 0.4}, "known"};
  EXPECT_THAT(ChooseNormalization("auto", data)->mean, ElementsAre(0.1, 0.2));
  EXPECT_TRUE(ChooseNormalization("none", data)->mean.empty());
}

}  // namespace
}  // namespace dbs
