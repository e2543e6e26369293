// Fuzz target: a step's push and reply as the server and the workers read them without copies
// (common/step_wire.h), from bytes split into segments at places the input chooses, as the
// transport may deliver them, and one chunk of a streamed answer.
#include <cstdint>
#include <vector>

#include "absl/types/span.h"
#include "common/step_wire.h"
#include "common/wire_values.h"
#include "proto/dbs.pb.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 2) return 0;
  // The first byte chooses the segment length (1..256), the second the model size (0..255).
  const size_t piece = static_cast<size_t>(data[0]) + 1;
  const size_t model = data[1];
  data += 2;
  size -= 2;
  dbs::Segments message;
  for (size_t at = 0; at < size; at += piece) {
    message.emplace_back(data + at, std::min(piece, size - at));
  }
  dbs::v1::PushGradientRequest header;
  dbs::WirePayload gradient;
  if (dbs::ParsePushRequest(message, &header, &gradient).ok() && gradient.CheckCount(model).ok()) {
    std::vector<float> values(model);
    (void)dbs::DecodePayload(gradient, absl::MakeSpan(values));
  }
  dbs::v1::PushGradientReply head;
  std::vector<float> params(model);
  int64_t version = 0;
  (void)dbs::ParsePushReply(message, &head, absl::MakeSpan(params), &version);
  // A reply that says its values are in shared memory leaves the parameters alone.
  std::vector<float> untouched(model, 7.0f);
  bool shared = false;
  if (dbs::ParsePushReply(message, &head, absl::MakeSpan(untouched), &version, &shared).ok() &&
      shared && untouched != std::vector<float>(model, 7.0f)) {
    __builtin_trap();
  }
  return 0;
}
