// Fuzz target: a RegisterModelRequest's tensors, as the parameter service decodes them.
#include <cstdint>
#include <vector>

#include "common/tensor.h"
#include "common/tensor_codec.h"
#include "proto/dbs.pb.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  dbs::v1::RegisterModelRequest req;
  if (!req.ParseFromArray(data, static_cast<int>(size))) return 0;
  absl::StatusOr<dbs::ModelLayout> layout = dbs::LayoutOf(req.parameters());
  if (!layout.ok()) return 0;
  std::vector<float> flat(static_cast<size_t>(dbs::TotalElements(*layout)));
  (void)dbs::DecodeTensors(req.parameters(), *layout, /*require_finite=*/true,
                           absl::MakeSpan(flat));
  return 0;
}
