#include "common/tensor_codec.h"

#include <cmath>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"

namespace dbs {

static_assert(sizeof(float) == 4, "float32 expected");
static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "the wire format is little-endian");

void EncodeTensors(const ModelLayout& layout, absl::Span<const float> flat, TensorList* out) {
  size_t offset = 0;
  for (const TensorSpec& spec : layout) {
    v1::Tensor* t = out->Add();
    t->set_name(spec.name);
    for (int64_t d : spec.shape) t->add_shape(d);
    if (spec.buffer) t->set_buffer(true);
    const size_t n = static_cast<size_t>(spec.NumElements());
    t->set_data(reinterpret_cast<const char*>(flat.data() + offset), n * sizeof(float));
    offset += n;
  }
}

absl::StatusOr<ModelLayout> LayoutOf(const TensorList& tensors, bool with_data) {
  ModelLayout layout;
  layout.reserve(tensors.size());
  for (const v1::Tensor& t : tensors) {
    TensorSpec spec{t.name(), {t.shape().begin(), t.shape().end()}, t.buffer()};
    layout.push_back(spec);
  }
  DBS_RETURN_IF_ERROR(ValidateLayout(layout));
  for (int i = 0; i < tensors.size(); ++i) {
    const uint64_t want =
        with_data ? static_cast<uint64_t>(layout[i].NumElements()) * sizeof(float) : 0;
    if (tensors[i].data().size() != want) {
      return absl::InvalidArgumentError(
          absl::StrCat("tensor '", layout[i].name, "' of shape ", layout[i].ShapeString(),
                       " carries ", tensors[i].data().size(), " bytes; expected ", want));
    }
  }
  return layout;
}

absl::Status DecodeTensors(const TensorList& tensors, const ModelLayout& layout,
                           bool require_finite, absl::Span<float> flat) {
  DBS_ASSIGN_OR_RETURN(ModelLayout got, LayoutOf(tensors));
  DBS_RETURN_IF_ERROR(CheckSameLayout(layout, got, "the model", "the message"));
  if (flat.size() != static_cast<size_t>(TotalElements(layout))) {
    return absl::InternalError("destination buffer does not match the layout");
  }
  if (require_finite) {
    for (int i = 0; i < tensors.size(); ++i) {
      const std::string& data = tensors[i].data();
      for (size_t k = 0; k < data.size(); k += sizeof(float)) {
        float v;
        std::memcpy(&v, data.data() + k, sizeof(float));
        if (!std::isfinite(v)) {
          return absl::InvalidArgumentError(absl::StrCat("tensor '", layout[i].name,
                                                         "' holds a non-finite value at element ",
                                                         k / sizeof(float)));
        }
      }
    }
  }
  size_t offset = 0;
  for (const v1::Tensor& t : tensors) {
    std::memcpy(flat.data() + offset, t.data().data(), t.data().size());
    offset += t.data().size() / sizeof(float);
  }
  return absl::OkStatus();
}

void EncodeLayout(const ModelLayout& layout, TensorList* out) {
  for (const TensorSpec& spec : layout) {
    v1::Tensor* t = out->Add();
    t->set_name(spec.name);
    for (int64_t d : spec.shape) t->add_shape(d);
    if (spec.buffer) t->set_buffer(true);
  }
}

}  // namespace dbs
