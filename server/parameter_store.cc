#include "server/parameter_store.h"

#include <algorithm>
#include <cmath>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"

namespace dbs {

ParameterStore::ParameterStore(std::unique_ptr<Optimizer> optimizer)
    : optimizer_(std::move(optimizer)) {}

absl::StatusOr<ParameterSnapshot> ParameterStore::Register(const ModelLayout& layout,
                                                           absl::Span<const float> initial) {
  DBS_RETURN_IF_ERROR(ValidateLayout(layout));
  absl::MutexLock lock(&mu_);
  if (!layout_.empty()) {
    DBS_RETURN_IF_ERROR(CheckSameLayout(layout_, layout, "the registered model"));
    return SnapshotLocked();
  }
  if (initial.size() != static_cast<size_t>(TotalElements(layout))) {
    return absl::InvalidArgumentError(absl::StrCat("initial values hold ", initial.size(),
                                                   " floats; the layout needs ",
                                                   TotalElements(layout)));
  }
  for (float v : initial) {
    if (!std::isfinite(v)) return absl::InvalidArgumentError("initial values are not finite");
  }
  layout_ = layout;
  values_.assign(initial.begin(), initial.end());
  cached_.reset();
  return SnapshotLocked();
}

absl::StatusOr<ParameterSnapshot> ParameterStore::Snapshot() const {
  absl::MutexLock lock(&mu_);
  if (layout_.empty()) {
    return absl::FailedPreconditionError("no model registered yet");
  }
  return SnapshotLocked();
}

absl::StatusOr<ParameterSnapshot> ParameterStore::ApplyGradient(absl::Span<const float> grad) {
  absl::MutexLock lock(&mu_);
  if (layout_.empty()) return absl::FailedPreconditionError("no model registered yet");
  if (grad.size() != values_.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("gradient holds ", grad.size(), " floats; the model has ", values_.size()));
  }
  // The values before the step (the snapshot every step hands out, so usually no copy).
  const ParameterSnapshot before = SnapshotLocked();
  optimizer_->Step(absl::MakeSpan(values_), grad);
  // Buffers are not trained: the "gradient" there is the sample-weighted mean of the values the
  // workers pushed, which every worker then holds.
  size_t offset = 0;
  for (const TensorSpec& t : layout_) {
    const size_t n = static_cast<size_t>(t.NumElements());
    if (t.buffer)
      std::copy(grad.begin() + offset, grad.begin() + offset + n, values_.begin() + offset);
    offset += n;
  }
  for (size_t i = 0; i < values_.size(); ++i) {
    if (std::isfinite(values_[i])) continue;
    // Keep the last finite parameters (what checkpoints and workers see); the optimizer's state
    // has moved, so the job must end.
    values_ = *before.values;
    return absl::DataLossError(absl::StrCat(
        "the update of parameter version ", version_ + 1, " made element ", i,
        " non-finite (the gradients were finite but too large for this learning rate); the "
        "parameters of version ",
        version_, " are kept"));
  }
  ++version_;
  cached_.reset();
  return SnapshotLocked();
}

ParameterSnapshot ParameterStore::SnapshotLocked() const {
  if (!cached_) {
    // Reuse a pooled buffer nobody outside holds any more (its pages are already mapped), so
    // a step allocates nothing.
    std::shared_ptr<std::vector<float>> buffer;
    for (const auto& b : pool_) {
      if (b.use_count() == 1 && b->size() == values_.size()) {
        buffer = b;
        break;
      }
    }
    if (buffer == nullptr) {
      buffer = std::make_shared<std::vector<float>>();
      if (pool_.size() < kSnapshotPool) pool_.push_back(buffer);
    }
    buffer->assign(values_.begin(), values_.end());
    cached_ = std::move(buffer);
  }
  return ParameterSnapshot{version_, cached_};
}

StoreState ParameterStore::SaveState() const {
  absl::MutexLock lock(&mu_);
  StoreState s;
  s.layout = layout_;
  s.values = values_;
  s.version = version_;
  s.optimizer = optimizer_->SaveState();
  return s;
}

absl::Status ParameterStore::LoadState(const StoreState& s) {
  DBS_RETURN_IF_ERROR(ValidateLayout(s.layout));
  if (s.values.size() != static_cast<size_t>(TotalElements(s.layout))) {
    return absl::InvalidArgumentError("checkpoint values do not match its layout");
  }
  absl::MutexLock lock(&mu_);
  DBS_RETURN_IF_ERROR(optimizer_->LoadState(s.optimizer, s.values.size()));
  layout_ = s.layout;
  values_ = s.values;
  version_ = s.version;
  cached_.reset();
  return absl::OkStatus();
}

bool ParameterStore::registered() const {
  absl::MutexLock lock(&mu_);
  return !layout_.empty();
}

ModelLayout ParameterStore::layout() const {
  absl::MutexLock lock(&mu_);
  return layout_;
}

int64_t ParameterStore::num_elements() const {
  absl::MutexLock lock(&mu_);
  return static_cast<int64_t>(values_.size());
}

}  // namespace dbs
