// ValuesFieldBytes: the bytes of PushGradientReply field `values` as dbs_ps writes them (its
// head, WriteValuesFieldHead, then the values), for tests and seed corpora that build answers.
#ifndef DBS_TESTS_VALUES_FIELD_H_
#define DBS_TESTS_VALUES_FIELD_H_

#include <cstdint>
#include <string>

#include "absl/types/span.h"
#include "common/step_wire.h"
#include "common/wire_values.h"

namespace dbs {

inline std::string ValuesFieldBytes(int64_t version, WireDtype dtype,
                                    absl::Span<const float> values) {
  constexpr size_t kMaxHead = 64;  // tags and varints: at most 39 bytes
  const size_t bytes = values.size() * BytesPerValue(dtype);
  std::string out(kMaxHead + bytes, '\0');
  uint8_t* const start = reinterpret_cast<uint8_t*>(out.data());
  const size_t head = WriteValuesFieldHead(version, dtype, values.size(), start);
  EncodeValues(values, dtype, start + head);
  out.resize(head + bytes);
  return out;
}

}  // namespace dbs

#endif  // DBS_TESTS_VALUES_FIELD_H_
