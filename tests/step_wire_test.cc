// The flat values on the wire (common/wire_values.h) and the zero-copy step messages
// (common/step_wire.h, common/rpc/grpc_step_wire.h): conversions, values split anywhere across
// segments, malformed messages refused, and byte-for-byte agreement with protobuf's own encoding.
#include "common/step_wire.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "common/rpc/grpc_step_wire.h"
#include "common/wire_values.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/status_matchers.h"
#include "tests/values_field.h"

namespace dbs {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

Segments Split(const std::string& bytes, size_t piece) {
  Segments s;
  const auto* p = reinterpret_cast<const uint8_t*>(bytes.data());
  for (size_t at = 0; at < bytes.size(); at += piece) {
    s.emplace_back(p + at, std::min(piece, bytes.size() - at));
  }
  return s;
}

TEST(WireValuesTest, Bf16RoundsToNearestEven) {
  EXPECT_EQ(FloatToBf16(1.0f), 0x3f80);
  EXPECT_EQ(Bf16ToFloat(0x3f80), 1.0f);
  EXPECT_EQ(Bf16ToFloat(FloatToBf16(-2.5f)), -2.5f);
  // 1 + 2^-8 is halfway between 1 and 1 + 2^-7: ties to the even (1).
  EXPECT_EQ(Bf16ToFloat(FloatToBf16(1.0f + 1.0f / 256)), 1.0f);
  // 1 + 3 * 2^-8 is halfway between 1 + 2^-7 and 1 + 2^-6: ties to the even (1 + 2^-6).
  EXPECT_EQ(Bf16ToFloat(FloatToBf16(1.0f + 3.0f / 256)), 1.0f + 1.0f / 64);
  EXPECT_TRUE(std::isnan(Bf16ToFloat(FloatToBf16(std::nanf("")))));
  EXPECT_TRUE(std::isinf(Bf16ToFloat(FloatToBf16(std::numeric_limits<float>::max()))));
}

TEST(WireValuesTest, Fp16CoversNormalsSubnormalsAndOverflow) {
  EXPECT_EQ(FloatToFp16(1.0f), 0x3c00);
  EXPECT_EQ(FloatToFp16(-2.0f), 0xc000);
  EXPECT_EQ(Fp16ToFloat(FloatToFp16(65504.0f)), 65504.0f);      // the largest half
  EXPECT_TRUE(std::isinf(Fp16ToFloat(FloatToFp16(65520.0f))));  // rounds past it
  EXPECT_EQ(Fp16ToFloat(FloatToFp16(std::ldexp(1.0f, -24))), std::ldexp(1.0f, -24));
  EXPECT_EQ(Fp16ToFloat(FloatToFp16(std::ldexp(1.0f, -26))), 0.0f);  // below half the least
  EXPECT_EQ(Fp16ToFloat(FloatToFp16(std::ldexp(3.0f, -20))), std::ldexp(3.0f, -20));
  EXPECT_EQ(Fp16ToFloat(FloatToFp16(1.0f + 1.0f / 2048)), 1.0f);  // a tie, to the even
  EXPECT_TRUE(std::isnan(Fp16ToFloat(FloatToFp16(std::nanf("")))));
  // Every half converts to float and back unchanged.
  for (uint32_t h = 0; h < 0x10000; ++h) {
    const float f = Fp16ToFloat(static_cast<uint16_t>(h));
    if (std::isnan(f)) continue;
    ASSERT_EQ(FloatToFp16(f), h) << h;
  }
}

TEST(WireValuesTest, SixteenBitRoundTripsStayWithinHalfAnUlp) {
  std::mt19937 rng(7);
  std::normal_distribution<float> n(0.0f, 1e-2f);
  for (int i = 0; i < 10000; ++i) {
    const float v = n(rng);
    EXPECT_LE(std::fabs(Bf16ToFloat(FloatToBf16(v)) - v), std::fabs(v) * (1.0f / 256));
    if (std::fabs(v) > 1e-4f) {
      EXPECT_LE(std::fabs(Fp16ToFloat(FloatToFp16(v)) - v), std::fabs(v) * (1.0f / 2048));
    }
  }
}

TEST(WireValuesTest, ArraysEncodeAndDecodeExactlyAsValueByValue) {
  // The array loops (bf16's encode has an AVX2 copy) against the one-value conversions, over
  // random bit patterns (NaNs, infinities, subnormals and halfway cases among them) and a
  // length that leaves a tail after every vector width.
  std::mt19937 rng(11);
  std::vector<float> values(100003);
  for (float& v : values) {
    const uint32_t bits = rng() & (rng() % 2 == 0 ? 0xffffffffu : 0xffff8000u);  // ties too
    std::memcpy(&v, &bits, sizeof v);
  }
  const float special[] = {0.0f,
                           -0.0f,
                           std::numeric_limits<float>::infinity(),
                           -std::numeric_limits<float>::infinity(),
                           std::numeric_limits<float>::quiet_NaN(),
                           std::numeric_limits<float>::denorm_min(),
                           65504.0f,
                           65520.0f};
  std::copy(std::begin(special), std::end(special), values.begin());
  for (WireDtype dtype : {WireDtype::kBf16, WireDtype::kFp16}) {
    std::vector<uint8_t> bytes(2 * values.size());
    EncodeValues(values, dtype, bytes.data());
    std::vector<float> decoded(values.size());
    DecodeValues(bytes.data(), dtype, absl::MakeSpan(decoded));
    for (size_t i = 0; i < values.size(); ++i) {
      uint16_t h;
      std::memcpy(&h, bytes.data() + 2 * i, 2);
      const bool bf16 = dtype == WireDtype::kBf16;
      ASSERT_EQ(h, bf16 ? FloatToBf16(values[i]) : FloatToFp16(values[i]))
          << WireDtypeName(dtype) << " value " << i << " = " << values[i];
      const float one = bf16 ? Bf16ToFloat(h) : Fp16ToFloat(h);
      ASSERT_EQ(std::memcmp(&decoded[i], &one, sizeof one), 0)
          << WireDtypeName(dtype) << " value " << i;
    }
  }
}

TEST(WireValuesTest, ValuesSplitAnywhereAcrossSegmentsDecodeTheSame) {
  std::vector<float> values(5000);
  for (size_t i = 0; i < values.size(); ++i) values[i] = 0.25f * static_cast<float>(i) - 100;
  for (WireDtype dtype : {WireDtype::kFp32, WireDtype::kBf16, WireDtype::kFp16}) {
    std::string bytes(values.size() * BytesPerValue(dtype), '\0');
    EncodeValues(values, dtype, reinterpret_cast<uint8_t*>(bytes.data()));
    std::vector<float> whole(values.size());
    DecodeValues(reinterpret_cast<const uint8_t*>(bytes.data()), dtype, absl::MakeSpan(whole));
    for (size_t piece : {1, 3, 4, 7, 4096, 8198, 100000}) {
      WirePayload p;
      p.dtype = dtype;
      p.segments = Split(bytes, piece);
      p.bytes = bytes.size();
      std::vector<float> got(values.size(), -1.0f);
      ASSERT_THAT(DecodePayload(p, absl::MakeSpan(got)), IsOk());
      EXPECT_EQ(got, whole) << WireDtypeName(dtype) << " in pieces of " << piece;
    }
  }
}

TEST(WireValuesTest, Fp32RunsReadTheValuesWhereTheyLieAlignedOrNot) {
  std::vector<float> values(3000);
  for (size_t i = 0; i < values.size(); ++i) values[i] = 0.5f * static_cast<float>(i) - 7;
  // One byte in front: every run starts unaligned.
  std::string bytes(1 + 4 * values.size(), '\0');
  std::memcpy(bytes.data() + 1, values.data(), 4 * values.size());
  for (size_t piece : {1, 3, 4, 5, 4096, 100000}) {
    WirePayload p;
    const auto* start = reinterpret_cast<const uint8_t*>(bytes.data()) + 1;
    for (size_t at = 0; at < 4 * values.size(); at += piece) {
      p.segments.emplace_back(start + at, std::min(piece, 4 * values.size() - at));
    }
    p.bytes = 4 * values.size();
    std::vector<float> got(values.size(), -1.0f);
    size_t runs = 0;
    ASSERT_THAT(ForEachRun(p,
                           [&](size_t first, const uint8_t* run, size_t count) {
                             for (size_t i = 0; i < count; ++i) {
                               got[first + i] = LoadFp32(run, i);
                             }
                             ++runs;
                             return absl::OkStatus();
                           }),
                IsOk());
    EXPECT_EQ(got, values) << "in pieces of " << piece;
    EXPECT_LE(runs, 2 * p.segments.size());
  }
  WirePayload cut;
  cut.segments.emplace_back(reinterpret_cast<const uint8_t*>(bytes.data()) + 1, 6);
  cut.bytes = 6;
  EXPECT_THAT(ForEachRun(cut, [](size_t, const uint8_t*, size_t) { return absl::OkStatus(); }),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("inside a value")));
}

TEST(WireValuesTest, APayloadOfTheWrongSizeIsNamedAndNothingIsWritten) {
  auto p = WirePayload::FromFloats(std::vector<float>{1, 2, 3});
  std::vector<float> out(4, 9.0f);
  EXPECT_THAT(DecodePayload(*p, absl::MakeSpan(out)),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("holds 12 bytes (fp32); the model needs 4 values = 16 bytes")));
  EXPECT_THAT(out, ElementsAre(9, 9, 9, 9));
  EXPECT_FALSE(ParseWireDtype("fp8").ok());
}

std::string PushBytes(const v1::PushGradientRequest& head, const std::vector<float>& g,
                      WireDtype dtype) {
  std::string bytes = head.SerializeAsString();
  std::string field(GradientFieldSize(g.size(), dtype), '\0');
  WriteGradientField(dtype, g, reinterpret_cast<uint8_t*>(field.data()));
  return bytes + field;
}

TEST(StepWireTest, APushIsReadWithItsGradientLeftInPlace) {
  v1::PushGradientRequest head;
  head.set_worker_id(3);
  head.set_epoch(1);
  head.set_step(17);
  head.set_num_samples(12);
  head.set_loss_sum(2.5);
  head.set_compute_seconds(0.125);
  head.set_wire_dtype(v1::WIRE_BF16);
  const std::vector<float> g = {1.5f, -2.0f, 0.0f, 1e-3f};
  const std::string bytes = PushBytes(head, g, WireDtype::kBf16);
  for (size_t piece : {1, 2, 5, 1000}) {
    const Segments message = Split(bytes, piece);
    v1::PushGradientRequest got;
    WirePayload gradient;
    ASSERT_THAT(ParsePushRequest(message, &got, &gradient), IsOk());
    EXPECT_EQ(got.worker_id(), 3);
    EXPECT_EQ(got.step(), 17);
    EXPECT_EQ(got.num_samples(), 12);
    EXPECT_EQ(got.compute_seconds(), 0.125);
    EXPECT_TRUE(got.gradient().empty()) << "the payload is not copied into the header";
    EXPECT_EQ(gradient.dtype, WireDtype::kBf16);
    EXPECT_EQ(gradient.bytes, 8u);
    // The segments point into the message itself.
    for (const auto& seg : gradient.segments) {
      EXPECT_GE(seg.data(), reinterpret_cast<const uint8_t*>(bytes.data()));
      EXPECT_LE(seg.data() + seg.size(),
                reinterpret_cast<const uint8_t*>(bytes.data()) + bytes.size());
    }
    std::vector<float> values(4);
    ASSERT_THAT(DecodePayload(gradient, absl::MakeSpan(values)), IsOk());
    EXPECT_EQ(values[0], 1.5f);
    EXPECT_EQ(values[1], -2.0f);
    EXPECT_NEAR(values[3], 1e-3f, 1e-5f);
  }
  // The same bytes are an ordinary message for protobuf.
  v1::PushGradientRequest parsed;
  ASSERT_TRUE(parsed.ParseFromString(bytes));
  EXPECT_EQ(parsed.gradient().size(), 8u);
}

TEST(StepWireTest, MalformedPushesAreRefused) {
  v1::PushGradientRequest head;
  head.set_worker_id(1);
  const std::string good = PushBytes(head, {1, 2}, WireDtype::kFp32);
  v1::PushGradientRequest got;
  WirePayload gradient;
  // Cut short inside the gradient.
  EXPECT_THAT(ParsePushRequest(Split(good.substr(0, good.size() - 3), 4), &got, &gradient),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("cut short")));
  // The gradient twice.
  const std::string twice = good + PushBytes(v1::PushGradientRequest(), {3}, WireDtype::kFp32);
  EXPECT_THAT(ParsePushRequest(Split(twice, 3), &got, &gradient),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("appears twice")));
  // Field 8 as a varint.
  EXPECT_THAT(ParsePushRequest(Split(std::string("\x40\x01", 2), 1), &got, &gradient),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("not length-delimited")));
  // A zero tag, and garbage.
  EXPECT_FALSE(ParsePushRequest(Split(std::string("\x00\x01", 2), 1), &got, &gradient).ok());
  EXPECT_FALSE(ParsePushRequest(Split("\xff\xff\xff\xff\xff\xff", 2), &got, &gradient).ok());
  // An unknown dtype.
  head.set_wire_dtype(static_cast<v1::WireDtype>(9));
  EXPECT_THAT(ParsePushRequest(Split(head.SerializeAsString(), 3), &got, &gradient),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("unknown wire dtype 9")));
  // Unknown fields of a newer client are skipped.
  v1::PushGradientRequest plain;
  plain.set_step(4);
  const std::string unknown = plain.SerializeAsString() + std::string("\xf8\x07\x05", 3);
  ASSERT_THAT(ParsePushRequest(Split(unknown, 1), &got, &gradient), IsOk());
  EXPECT_EQ(got.step(), 4);
}

TEST(StepWireTest, TheSharedValuesFieldIsWhatProtobufWouldWrite) {
  const std::vector<float> values = {0.5f, -1.0f, 3.0f};
  for (WireDtype dtype : {WireDtype::kFp32, WireDtype::kBf16}) {
    for (int64_t version : {int64_t{0}, int64_t{1}, int64_t{300}, int64_t{1} << 40}) {
      v1::PushGradientReply head;
      head.set_epoch(2);
      head.set_step(5);
      head.set_global_loss(0.75);
      head.set_global_samples(64);
      head.mutable_revision()->set_from_step(6);
      const std::string field = ValuesFieldBytes(version, dtype, values);
      const std::string ours = head.SerializeAsString() + field;

      v1::PushGradientReply full = head;
      full.mutable_values()->set_version(version);
      full.mutable_values()->set_wire_dtype(static_cast<v1::WireDtype>(dtype));
      std::string encoded(values.size() * BytesPerValue(dtype), '\0');
      EncodeValues(values, dtype, reinterpret_cast<uint8_t*>(encoded.data()));
      full.mutable_values()->set_values(encoded);
      EXPECT_EQ(ours, full.SerializeAsString()) << WireDtypeName(dtype) << " v" << version;

      v1::PushGradientReply got;
      std::vector<float> params(3);
      int64_t got_version = -1;
      ASSERT_THAT(ParsePushReply(Split(ours, 3), &got, absl::MakeSpan(params), &got_version),
                  IsOk());
      EXPECT_EQ(got_version, version);
      EXPECT_EQ(got.step(), 5);
      EXPECT_EQ(got.revision().from_step(), 6);
      EXPECT_EQ(params, values);  // exact in both dtypes
    }
  }
}

TEST(StepWireTest, AReplyWithoutOrWithTheWrongParametersLeavesTheModelAlone) {
  v1::PushGradientReply head;
  head.set_step(1);
  std::vector<float> params = {7, 7};
  int64_t version = 0;
  v1::PushGradientReply got;
  EXPECT_THAT(
      ParsePushReply(Split(head.SerializeAsString(), 2), &got, absl::MakeSpan(params), &version),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("no parameters")));
  const std::string field = ValuesFieldBytes(3, WireDtype::kFp32, std::vector<float>{1, 2, 3});
  EXPECT_THAT(ParsePushReply(Split(head.SerializeAsString() + field, 2), &got,
                             absl::MakeSpan(params), &version),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("not the model's 2 values")));
  EXPECT_THAT(params, ElementsAre(7, 7));
}

TEST(StepWireTest, APushsPrefixThenItsValuesIsWhatProtobufWouldWrite) {
  v1::PushGradientRequest req;
  req.set_worker_id(2);
  const std::vector<float> g = {1.5f, -2.0f};
  const std::string push = req.SerializeAsString() + GradientFieldPrefix(2, WireDtype::kFp32) +
                           std::string(reinterpret_cast<const char*>(g.data()), 8);
  v1::PushGradientRequest parsed;
  ASSERT_TRUE(parsed.ParseFromString(push));
  EXPECT_EQ(parsed.worker_id(), 2);
  EXPECT_EQ(parsed.gradient().size(), 8u);
  v1::PushGradientRequest header;
  WirePayload gradient;
  ASSERT_THAT(ParsePushRequest(Split(push, 3), &header, &gradient), IsOk());
  std::vector<float> got(2);
  ASSERT_THAT(DecodePayload(gradient, absl::MakeSpan(got)), IsOk());
  EXPECT_EQ(got, g);
}

// A pool's buffer lent to gRPC as a slice comes back when gRPC lets go of the last reference,
// however many answers shared it, and serves the next step.
TEST(BytePoolTest, BuffersComeBackWhenTheLastSliceGoesAndAreReused) {
  auto pool = BytePool::Create(2);
  for (int step = 0; step < 10; ++step) {
    std::shared_ptr<uint8_t> buffer = pool->Acquire(1 << 20);
    uint8_t* data = buffer.get();
    std::memset(data, step, 1 << 20);
    grpc::Slice s = SliceOfMemory(data, 1 << 20, std::move(buffer));
    grpc::Slice shared = s;  // N replies share one buffer
    grpc::ByteBuffer reply(&shared, 1);
    EXPECT_EQ(reply.Length(), 1u << 20);
  }
  EXPECT_EQ(pool->allocations(), 1) << "one buffer served every step";
  // Two held at once need two buffers.
  std::shared_ptr<uint8_t> first = pool->Acquire(100);
  std::shared_ptr<uint8_t> second = pool->Acquire(100);
  EXPECT_NE(first.get(), second.get());
}

// DropFree lets go of the free buffers only: the next Acquire allocates again, and a buffer
// still held comes back to the pool when its last reference goes.
TEST(BytePoolTest, DropFreeLetsGoOfTheFreeBuffersOnly) {
  auto pool = BytePool::Create(2);
  { std::shared_ptr<uint8_t> gone = pool->Acquire(1000); }
  std::shared_ptr<uint8_t> held = pool->Acquire(1000);
  EXPECT_EQ(pool->allocations(), 1);
  std::memset(held.get(), 7, 1000);
  EXPECT_EQ(pool->DropFree(), 0u) << "none free: the held one stays valid";
  EXPECT_EQ(held.get()[999], 7);
  held.reset();
  { std::shared_ptr<uint8_t> again = pool->Acquire(1000); }
  EXPECT_EQ(pool->allocations(), 1) << "the held buffer came back to the pool";
  EXPECT_EQ(pool->DropFree(), 1u);
  { std::shared_ptr<uint8_t> fresh = pool->Acquire(1000); }
  EXPECT_EQ(pool->allocations(), 2) << "the free buffer was let go";
}

// A buffer much larger than asked for is not handed out: a 16-bit model's buffer does not
// serve a push's few bytes.
TEST(BytePoolTest, AFarLargerFreeBufferIsNotUsed) {
  auto pool = BytePool::Create(2);
  { std::shared_ptr<uint8_t> big = pool->Acquire(1 << 20); }
  { std::shared_ptr<uint8_t> small = pool->Acquire(100); }
  EXPECT_EQ(pool->allocations(), 2);
  { std::shared_ptr<uint8_t> big_again = pool->Acquire(1 << 19); }
  EXPECT_EQ(pool->allocations(), 2) << "half the size or more reuses it";
}

TEST(BytePoolTest, BuffersOutliveThePoolsOwner) {
  grpc::Slice kept;
  {
    auto pool = BytePool::Create();
    std::shared_ptr<uint8_t> buffer = pool->Acquire(16);
    uint8_t* data = buffer.get();
    std::memset(data, 0xab, 16);
    kept = SliceOfMemory(data, 16, std::move(buffer));
  }
  EXPECT_EQ(kept.begin()[15], 0xab);  // still valid; freed with the slice
}

// A gradient lent to gRPC: its slices are its own memory, and the lender learns when gRPC has
// let go of every one (sub-slices and copies included), however late.
TEST(LentValuesTest, SlicesAreTheMemoryItselfAndTheLenderLearnsWhenTheyAreBack) {
  std::vector<float> gradient = {1, 2, 3, 4, 5};
  std::optional<LentValues> lent(absl::MakeConstSpan(gradient));
  EXPECT_TRUE(lent->AwaitReturned(absl::ZeroDuration())) << "nothing lent yet";
  grpc::Slice a = lent->Range(1, 3);
  EXPECT_EQ(a.begin(), reinterpret_cast<const uint8_t*>(gradient.data() + 1));
  EXPECT_EQ(a.size(), 3 * sizeof(float));
  grpc::Slice b = lent->Range(4, 1);
  grpc::Slice part = a.sub(4, 8);  // holds `a`'s memory on its own
  grpc::ByteBuffer message(&b, 1);
  b = grpc::Slice();
  a = grpc::Slice();
  EXPECT_FALSE(lent->AwaitReturned(absl::Milliseconds(10))) << "`part` and `message` hold them";
  part = grpc::Slice();
  EXPECT_FALSE(lent->AwaitReturned(absl::Milliseconds(10))) << "`message` holds one";
  message.Clear();
  EXPECT_TRUE(lent->AwaitReturned(absl::ZeroDuration()));
  // A slice let go after the lender is gone touches nothing of it.
  grpc::Slice late = lent->Range(0, 5);
  lent.reset();
  EXPECT_EQ(reinterpret_cast<const float*>(late.begin())[4], 5.0f);
  late = grpc::Slice();
}

std::string BytesOf(const grpc::Slice& slice) {
  return std::string(reinterpret_cast<const char*>(slice.begin()), slice.size());
}

TEST(GradientOnWireTest, Fp32IsTheGradientsOwnMemoryWhichIsWaitedFor) {
  if (!Fp32IsWireOrder()) GTEST_SKIP() << "fp32 is encoded on a big-endian machine";
  std::vector<float> gradient = {1.5f, -2, 3, 4};
  auto pool = BytePool::Create(1);
  GradientOnWire bytes(gradient, WireDtype::kFp32, pool.get());
  grpc::Slice whole = bytes.Range(0, 4);
  EXPECT_EQ(whole.begin(), reinterpret_cast<const uint8_t*>(gradient.data()));
  // The field's tag and length, then these bytes: the field a whole-message push writes.
  std::string field(GradientFieldSize(4, WireDtype::kFp32), '\0');
  WriteGradientField(WireDtype::kFp32, gradient, reinterpret_cast<uint8_t*>(field.data()));
  EXPECT_EQ(GradientFieldPrefix(4, WireDtype::kFp32) + BytesOf(whole), field);
  EXPECT_EQ(BytesOf(bytes.Range(2, 2)), field.substr(field.size() - 8));
  EXPECT_EQ(pool->allocations(), 0) << "nothing copied";
  EXPECT_FALSE(bytes.AwaitReturned(absl::Milliseconds(10))) << "`whole` still holds it";
  whole = grpc::Slice();
  EXPECT_TRUE(bytes.AwaitReturned(absl::ZeroDuration()));
}

TEST(GradientOnWireTest, Bf16IsEncodedOnceAndTheGradientIsFreeAtOnce) {
  std::vector<float> gradient = {1.5f, -2, 3, 4};
  auto pool = BytePool::Create(1);
  GradientOnWire bytes(gradient, WireDtype::kBf16, pool.get());
  std::string field(GradientFieldSize(4, WireDtype::kBf16), '\0');
  WriteGradientField(WireDtype::kBf16, gradient, reinterpret_cast<uint8_t*>(field.data()));
  grpc::Slice whole = bytes.Range(0, 4);
  grpc::Slice tail = bytes.Range(1, 3);
  EXPECT_EQ(pool->allocations(), 1);
  EXPECT_TRUE(bytes.AwaitReturned(absl::ZeroDuration())) << "the slices hold a copy";
  gradient.assign(4, 0.0f);
  EXPECT_EQ(GradientFieldPrefix(4, WireDtype::kBf16) + BytesOf(whole), field);
  EXPECT_EQ(BytesOf(tail), field.substr(field.size() - 6));
}

}  // namespace
}  // namespace dbs
