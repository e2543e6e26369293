// Conversion between the wire's dbs.v1.Tensor messages and flat float buffers.
//
// Decoding validates everything a peer controls (names, shapes, byte sizes, finite values) before
// touching the destination, so a bad message changes nothing. Stateless; thread-safe.
#ifndef DBS_COMMON_TENSOR_CODEC_H_
#define DBS_COMMON_TENSOR_CODEC_H_

#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "common/tensor.h"
#include "google/protobuf/repeated_ptr_field.h"
#include "proto/dbs.pb.h"

namespace dbs {

using TensorList = google::protobuf::RepeatedPtrField<v1::Tensor>;

// Appends one tensor per layout entry, taking values from `flat` (TotalElements(layout) floats).
void EncodeTensors(const ModelLayout& layout, absl::Span<const float> flat, TensorList* out);

// Reads the names and shapes of `tensors`; INVALID_ARGUMENT if the layout is invalid or a byte
// size does not match its shape (with `with_data`; without, every tensor must carry no data).
absl::StatusOr<ModelLayout> LayoutOf(const TensorList& tensors, bool with_data = true);

// Appends one tensor per layout entry with its name and shape and no data.
void EncodeLayout(const ModelLayout& layout, TensorList* out);

// Checks `tensors` against `layout` and, only if all is well, copies their values into `flat`
// (TotalElements(layout) floats). With `require_finite`, NaN or infinite values are refused.
absl::Status DecodeTensors(const TensorList& tensors, const ModelLayout& layout,
                           bool require_finite, absl::Span<float> flat);

}  // namespace dbs

#endif  // DBS_COMMON_TENSOR_CODEC_H_
