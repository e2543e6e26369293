#include "common/step_wire.h"

#include <algorithm>
#include <climits>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "common/tensor_codec.h"
#include "google/protobuf/io/coded_stream.h"
#include "google/protobuf/io/zero_copy_stream_impl_lite.h"
#include "google/protobuf/wire_format_lite.h"

namespace dbs {
namespace {

using google::protobuf::internal::WireFormatLite;
using google::protobuf::io::CodedInputStream;
using google::protobuf::io::CodedOutputStream;

constexpr int kGradientField = 8;  // PushGradientRequest.gradient
constexpr int kValuesField = 7;    // PushGradientReply.values
constexpr int kFlatVersion = 1;    // FlatParameters.version
constexpr int kFlatDtype = 2;      // FlatParameters.wire_dtype
constexpr int kFlatValues = 3;     // FlatParameters.values

uint32_t DelimitedTag(int field) {
  return WireFormatLite::MakeTag(field, WireFormatLite::WIRETYPE_LENGTH_DELIMITED);
}

size_t PayloadBytes(const Segments& s) {
  size_t n = 0;
  for (const auto& seg : s) n += seg.size();
  return n;
}

size_t FlatInnerSize(int64_t version, size_t count, WireDtype dtype) {
  const size_t bytes = count * BytesPerValue(dtype);
  size_t n = 0;
  if (version != 0) n += 1 + CodedOutputStream::VarintSize64(static_cast<uint64_t>(version));
  if (dtype != WireDtype::kFp32) n += 1 + CodedOutputStream::VarintSize32(static_cast<int>(dtype));
  if (bytes > 0) n += 1 + CodedOutputStream::VarintSize64(bytes) + bytes;
  return n;
}

}  // namespace

bool SegmentsInputStream::Next(const void** data, int* size) {
  while (index_ < segments_.size() && offset_ >= segments_[index_].size()) {
    ++index_;
    offset_ = 0;
  }
  if (index_ >= segments_.size()) {
    last_size_ = 0;
    return false;
  }
  const size_t left = segments_[index_].size() - offset_;
  const int n = static_cast<int>(std::min<size_t>(left, INT_MAX));
  *data = segments_[index_].data() + offset_;
  *size = n;
  offset_ += static_cast<size_t>(n);
  position_ += n;
  last_size_ = n;
  return true;
}

void SegmentsInputStream::BackUp(int count) {
  // Only the end of the buffer the last Next returned may be given back; it lies in
  // segments_[index_] (Next leaves index_ on the segment it read from).
  offset_ -= static_cast<size_t>(count);
  position_ -= count;
  last_size_ = 0;
}

bool SegmentsInputStream::Skip(int count) {
  if (count < 0) return false;
  size_t left = static_cast<size_t>(count);
  while (left > 0) {
    if (index_ >= segments_.size()) return false;
    const size_t here = segments_[index_].size() - offset_;
    const size_t take = std::min(here, left);
    offset_ += take;
    position_ += static_cast<int64_t>(take);
    left -= take;
    if (offset_ >= segments_[index_].size()) {
      ++index_;
      offset_ = 0;
    }
  }
  last_size_ = 0;
  return true;
}

absl::Status SplitField(google::protobuf::io::ZeroCopyInputStream* in, int field, std::string* rest,
                        Segments* segments, bool* present) {
  *present = false;
  rest->clear();
  segments->clear();
  google::protobuf::io::StringOutputStream rest_stream(rest);
  {
    CodedInputStream cin(in);
    CodedOutputStream cout(&rest_stream);
    while (true) {
      const uint32_t tag = cin.ReadTag();
      if (tag == 0) break;
      if (WireFormatLite::GetTagFieldNumber(tag) != field) {
        if (!WireFormatLite::SkipField(&cin, tag, &cout)) {
          return absl::InvalidArgumentError("malformed message: a field is cut short or invalid");
        }
        continue;
      }
      if (WireFormatLite::GetTagWireType(tag) != WireFormatLite::WIRETYPE_LENGTH_DELIMITED) {
        return absl::InvalidArgumentError(
            absl::StrCat("malformed message: field ", field, " is not length-delimited"));
      }
      if (*present) {
        return absl::InvalidArgumentError(
            absl::StrCat("malformed message: field ", field, " appears twice"));
      }
      uint64_t length = 0;
      if (!cin.ReadVarint64(&length)) {
        return absl::InvalidArgumentError("malformed message: a length is cut short");
      }
      while (length > 0) {
        const void* data = nullptr;
        int size = 0;
        if (!cin.GetDirectBufferPointer(&data, &size) || size <= 0) {
          return absl::InvalidArgumentError(
              absl::StrCat("malformed message: field ", field, " is cut short"));
        }
        const size_t take = std::min<uint64_t>(length, static_cast<uint64_t>(size));
        segments->emplace_back(static_cast<const uint8_t*>(data), take);
        cin.Skip(static_cast<int>(take));
        length -= take;
      }
      *present = true;
    }
    // ReadTag answers 0 at the end and for an invalid tag: only the end is well formed.
    if (!cin.ConsumedEntireMessage()) {
      return absl::InvalidArgumentError("malformed message: an invalid field tag");
    }
  }
  return absl::OkStatus();
}

absl::Status ParsePushRequest(const Segments& message, v1::PushGradientRequest* header,
                              WirePayload* gradient) {
  SegmentsInputStream in(message);
  std::string rest;
  bool present = false;
  DBS_RETURN_IF_ERROR(SplitField(&in, kGradientField, &rest, &gradient->segments, &present));
  if (!header->ParseFromString(rest)) {
    return absl::InvalidArgumentError(
        "malformed request: the bytes are not a valid dbs.v1.PushGradientRequest");
  }
  if (!v1::WireDtype_IsValid(header->wire_dtype())) {
    return absl::InvalidArgumentError(
        absl::StrCat("unknown wire dtype ", static_cast<int>(header->wire_dtype())));
  }
  gradient->dtype = static_cast<WireDtype>(header->wire_dtype());
  gradient->bytes = PayloadBytes(gradient->segments);
  return absl::OkStatus();
}

size_t WriteValuesFieldHead(int64_t version, WireDtype dtype, size_t count, uint8_t* out) {
  uint8_t* const start = out;
  const size_t bytes = count * BytesPerValue(dtype);
  out = CodedOutputStream::WriteVarint32ToArray(DelimitedTag(kValuesField), out);
  out = CodedOutputStream::WriteVarint64ToArray(FlatInnerSize(version, count, dtype), out);
  if (version != 0) {
    out = CodedOutputStream::WriteVarint32ToArray(
        WireFormatLite::MakeTag(kFlatVersion, WireFormatLite::WIRETYPE_VARINT), out);
    out = CodedOutputStream::WriteVarint64ToArray(static_cast<uint64_t>(version), out);
  }
  if (dtype != WireDtype::kFp32) {
    out = CodedOutputStream::WriteVarint32ToArray(
        WireFormatLite::MakeTag(kFlatDtype, WireFormatLite::WIRETYPE_VARINT), out);
    out = CodedOutputStream::WriteVarint32ToArray(static_cast<uint32_t>(dtype), out);
  }
  if (bytes > 0) {
    out = CodedOutputStream::WriteVarint32ToArray(DelimitedTag(kFlatValues), out);
    out = CodedOutputStream::WriteVarint64ToArray(bytes, out);
  }
  return static_cast<size_t>(out - start);
}

size_t GradientFieldSize(size_t count, WireDtype dtype) {
  const size_t bytes = count * BytesPerValue(dtype);
  return 1 + CodedOutputStream::VarintSize64(bytes) + bytes;
}

void WriteGradientField(WireDtype dtype, absl::Span<const float> values, uint8_t* out) {
  const size_t bytes = values.size() * BytesPerValue(dtype);
  out = CodedOutputStream::WriteVarint32ToArray(DelimitedTag(kGradientField), out);
  out = CodedOutputStream::WriteVarint64ToArray(bytes, out);
  EncodeValues(values, dtype, out);
}

namespace {

void AppendVarint(uint64_t v, std::string* out) {
  uint8_t buf[10];
  const uint8_t* end = CodedOutputStream::WriteVarint64ToArray(v, buf);
  out->append(reinterpret_cast<const char*>(buf), static_cast<size_t>(end - buf));
}

}  // namespace

std::string GradientFieldPrefix(size_t count, WireDtype dtype) {
  std::string out;
  AppendVarint(DelimitedTag(kGradientField), &out);
  AppendVarint(count * BytesPerValue(dtype), &out);
  return out;
}

absl::Status ParsePushReply(const Segments& message, v1::PushGradientReply* head,
                            absl::Span<float> params, int64_t* version, bool* in_shared_memory) {
  if (in_shared_memory != nullptr) *in_shared_memory = false;
  SegmentsInputStream in(message);
  std::string rest;
  Segments flat;
  bool present = false;
  DBS_RETURN_IF_ERROR(SplitField(&in, kValuesField, &rest, &flat, &present));
  // Parsed into a scratch head first: nothing is written unless the whole reply is well formed.
  v1::PushGradientReply scratch;
  if (!scratch.ParseFromString(rest)) {
    return absl::InvalidArgumentError("malformed reply: not a valid dbs.v1.PushGradientReply");
  }
  if (!present) return absl::InvalidArgumentError("the reply carries no parameters");
  SegmentsInputStream flat_in(flat);
  std::string flat_rest;
  WirePayload values;
  DBS_RETURN_IF_ERROR(SplitField(&flat_in, kFlatValues, &flat_rest, &values.segments, &present));
  v1::FlatParameters meta;
  if (!meta.ParseFromString(flat_rest) || !v1::WireDtype_IsValid(meta.wire_dtype())) {
    return absl::InvalidArgumentError("malformed reply: invalid parameters");
  }
  values.dtype = static_cast<WireDtype>(meta.wire_dtype());
  values.bytes = PayloadBytes(values.segments);
  if (meta.in_shared_memory()) {
    if (in_shared_memory == nullptr || values.bytes != 0) {
      return absl::InvalidArgumentError(
          "the reply's parameters are in shared memory, which this push did not ask for");
    }
    *in_shared_memory = true;
  } else {
    if (values.bytes != params.size() * BytesPerValue(values.dtype)) {
      return absl::InvalidArgumentError(absl::StrCat("the reply's parameters (", values.bytes,
                                                     " bytes) are not the model's ", params.size(),
                                                     " values"));
    }
    DBS_RETURN_IF_ERROR(DecodePayload(values, params));
  }
  *head = std::move(scratch);
  *version = meta.version();
  return absl::OkStatus();
}

absl::Status DecodeParameters(const v1::Parameters& message, const ModelLayout& layout,
                              absl::Span<float> params) {
  if (params.size() != static_cast<size_t>(TotalElements(layout))) {
    return absl::InternalError("the parameter buffer does not match the model");
  }
  if (!message.has_values()) return DecodeTensors(message.parameters(), layout, false, params);
  if (!v1::WireDtype_IsValid(message.values().wire_dtype())) {
    return absl::InvalidArgumentError("malformed parameters: unknown wire dtype");
  }
  const std::string& bytes = message.values().values();
  WirePayload values;
  values.dtype = static_cast<WireDtype>(message.values().wire_dtype());
  values.bytes = bytes.size();
  if (!bytes.empty()) {
    values.segments.emplace_back(reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size());
  }
  return DecodePayload(values, params);
}

}  // namespace dbs
