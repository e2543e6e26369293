#include "common/tensor_codec.h"

#include <cmath>
#include <limits>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/status_matchers.h"

namespace dbs {
namespace {

const ModelLayout kLayout = {{"conv.weight", {2, 1, 2}}, {"conv.bias", {2}}, {"scale", {}}};

TEST(TensorCodecTest, RoundTripIsBitExact) {
  std::vector<float> values = {1.5f, -0.0f, 3e-38f, 1e38f, 0.1f, -7.25f, 42.0f};
  ASSERT_EQ(values.size(), static_cast<size_t>(TotalElements(kLayout)));
  TensorList msg;
  EncodeTensors(kLayout, values, &msg);
  ASSERT_EQ(msg.size(), 3);
  EXPECT_EQ(msg[0].name(), "conv.weight");
  EXPECT_THAT(msg[0].shape(), ::testing::ElementsAre(2, 1, 2));
  EXPECT_EQ(msg[0].data().size(), 16u);
  auto layout = LayoutOf(msg);
  ASSERT_THAT(layout, IsOk()) << layout.status();
  EXPECT_EQ(*layout, kLayout);
  std::vector<float> back(values.size());
  ASSERT_THAT(DecodeTensors(msg, kLayout, true, absl::MakeSpan(back)), IsOk());
  EXPECT_EQ(0, std::memcmp(back.data(), values.data(), values.size() * sizeof(float)));
}

TEST(TensorCodecTest, TheBufferFlagRoundTripsAndMustMatch) {
  const ModelLayout with_buffer = {{"w", {2}}, {"bn.running_var", {2}, /*buffer=*/true}};
  TensorList msg;
  EncodeTensors(with_buffer, std::vector<float>{1, 2, 3, 4}, &msg);
  EXPECT_FALSE(msg[0].buffer());
  EXPECT_TRUE(msg[1].buffer());
  absl::StatusOr<ModelLayout> layout = LayoutOf(msg);
  ASSERT_THAT(layout, IsOk());
  EXPECT_EQ(*layout, with_buffer);
  const ModelLayout without = {{"w", {2}}, {"bn.running_var", {2}}};
  std::vector<float> dest(4);
  EXPECT_THAT(DecodeTensors(msg, without, true, absl::MakeSpan(dest)),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       ::testing::HasSubstr("'bn.running_var' is a buffer")));
}

TEST(TensorCodecTest, MismatchesAreInvalidArgumentAndLeaveTheDestinationAlone) {
  std::vector<float> values(7, 1.0f);
  std::vector<float> dest(7, -5.0f);
  auto expect_refused = [&](const TensorList& msg, const char* why) {
    const absl::Status s = DecodeTensors(msg, kLayout, true, absl::MakeSpan(dest));
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << why << ": " << s;
    for (float v : dest) ASSERT_EQ(v, -5.0f) << why;
  };
  TensorList ok;
  EncodeTensors(kLayout, values, &ok);

  TensorList wrong_shape = ok;
  wrong_shape[0].set_shape(0, 4);  // [4, 1, 2] with 2 elements' worth of bytes... and 8 needed
  expect_refused(wrong_shape, "wrong shape");
  TensorList same_size_other_shape = ok;
  same_size_other_shape[0].clear_shape();
  same_size_other_shape[0].add_shape(4);  // [4]: same byte count, different shape
  expect_refused(same_size_other_shape, "reshaped");
  TensorList short_data = ok;
  short_data[1].mutable_data()->resize(4);
  expect_refused(short_data, "truncated data");
  TensorList renamed = ok;
  renamed[2].set_name("other");
  expect_refused(renamed, "renamed");
  TensorList missing = ok;
  missing.RemoveLast();
  expect_refused(missing, "missing tensor");
  TensorList nan = ok;
  const float bad = std::numeric_limits<float>::quiet_NaN();
  std::memcpy(nan[1].mutable_data()->data(), &bad, 4);
  expect_refused(nan, "NaN");
  TensorList dup = ok;
  dup[1].set_name("conv.weight");
  EXPECT_THAT(LayoutOf(dup), StatusCodeIs(absl::StatusCode::kInvalidArgument));
}

TEST(TensorCodecTest, NonFiniteValuesPassWhenNotChecked) {
  std::vector<float> values(7, std::numeric_limits<float>::infinity());
  TensorList msg;
  EncodeTensors(kLayout, values, &msg);
  std::vector<float> back(7);
  EXPECT_THAT(DecodeTensors(msg, kLayout, false, absl::MakeSpan(back)), IsOk());
  EXPECT_TRUE(std::isinf(back[3]));
}

TEST(TensorLayoutTest, ValidateAndCompare) {
  EXPECT_THAT(ValidateLayout(kLayout), IsOk());
  EXPECT_FALSE(ValidateLayout({}).ok());
  EXPECT_FALSE(ValidateLayout({{"a", {0}}}).ok());
  EXPECT_FALSE(ValidateLayout({{"", {1}}}).ok());
  EXPECT_THAT(CheckSameLayout(kLayout, kLayout, "x", "y"), IsOk());
  ModelLayout other = kLayout;
  other[1].shape = {3};
  const absl::Status s = CheckSameLayout(kLayout, other, "the job's model", "the gradient");
  EXPECT_THAT(s, StatusCodeIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(std::string(s.message()), ::testing::HasSubstr("the gradient's tensor 'conv.bias' "
                                                             "has shape [3] where the job's "
                                                             "model's has"));
  other.pop_back();
  EXPECT_THAT(
      std::string(
          CheckSameLayout(kLayout, other, "the job's model", "this worker's model").message()),
      ::testing::HasSubstr("this worker's model has 2 tensors where the job's model has 3"));
  EXPECT_EQ(TotalElements(kLayout), 7);
}

}  // namespace
}  // namespace dbs
