#include "server/parameter_store.h"

#include <algorithm>
#include <cfloat>
#include <cmath>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"

namespace dbs {
namespace {

// The index of the first of `v`'s `n` elements that is not finite, or `n`.
size_t FirstNonFinite(const float* v, size_t n) {
  for (size_t i = 0; i < n; ++i) {
    if (!std::isfinite(v[i])) return i;
  }
  return n;
}

// The value ranges [begin, end) of the layout's buffers (BatchNorm's running statistics), in
// order. Buffers are not trained: the "gradient" there is the sample-weighted mean of the values
// the workers pushed, which every worker then holds.
std::vector<std::pair<size_t, size_t>> BufferRanges(const ModelLayout& layout) {
  std::vector<std::pair<size_t, size_t>> ranges;
  size_t offset = 0;
  for (const TensorSpec& t : layout) {
    const size_t count = static_cast<size_t>(t.NumElements());
    if (t.buffer) ranges.emplace_back(offset, offset + count);
    offset += count;
  }
  return ranges;
}

}  // namespace

ParameterStore::ParameterStore(std::unique_ptr<Optimizer> optimizer)
    : optimizer_(std::move(optimizer)) {}

absl::StatusOr<ParameterSnapshot> ParameterStore::Register(const ModelLayout& layout,
                                                           absl::Span<const float> initial) {
  DBS_RETURN_IF_ERROR(ValidateLayout(layout));
  absl::MutexLock lock(&mu_);
  if (!layout_.empty()) {
    const absl::Status same =
        CheckSameLayout(layout_, layout, "the job's model", "this worker's model");
    if (!same.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat(same.message(), ": every worker trains the model the first one registered"));
    }
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
  std::shared_ptr<ValueBuffer> values = FreeBufferLocked(initial.size(), 0);
  std::copy(initial.begin(), initial.end(), values->begin());
  layout_ = layout;
  PublishLocked(std::move(values));
  return SnapshotLocked();
}

absl::StatusOr<ParameterSnapshot> ParameterStore::Snapshot() const {
  absl::MutexLock lock(&mu_);
  if (layout_.empty()) {
    return absl::FailedPreconditionError("no model registered yet");
  }
  return SnapshotLocked();
}

absl::StatusOr<ParameterSnapshot> ParameterStore::ApplyGradient(
    absl::Span<float> sum, absl::Span<const GradientScale> scales) {
  absl::MutexLock lock(&mu_);
  if (layout_.empty()) return absl::FailedPreconditionError("no model registered yet");
  const size_t n = values_->size();
  if (sum.size() != n || scales.empty() || scales.back().end != n) {
    return absl::InvalidArgumentError(
        absl::StrCat("gradient holds ", sum.size(), " floats; the model has ", n));
  }
  // The values before the step stay what Snapshot serves until the update ends, and what stays
  // should the update make a value non-finite.
  const std::shared_ptr<const ValueBuffer> before = values_;
  std::shared_ptr<ValueBuffer> after =
      next_ != nullptr ? std::move(next_) : FreeBufferLocked(n, version_ + 1);
  next_.reset();
  if (sink_ != nullptr) sink_->BeginUpdate(version_ + 1, after);
  optimizer_->Begin(n);
  const size_t bad = UpdatePassLocked(sum, scales, *before, after.get());
  optimizer_->End();
  if (bad < n) {
    // Keep the last finite parameters (what checkpoints and workers see: the update never
    // touched them); the optimizer's state has moved, so the job must end.
    if (sink_ != nullptr) sink_->EndUpdate(false, ParameterSnapshot{});
    return absl::DataLossError(absl::StrCat(
        "the update of parameter version ", version_ + 1, " made element ", bad,
        " non-finite (the gradients were finite but too large for this learning rate); the "
        "parameters of version ",
        version_, " are kept"));
  }
  ++version_;
  PublishLocked(std::move(after));
  const ParameterSnapshot snapshot{version_, values_};
  if (sink_ != nullptr) sink_->EndUpdate(true, snapshot);
  return snapshot;
}

absl::StatusOr<absl::Span<float>> ParameterStore::ReserveNextBuffer() {
  absl::MutexLock lock(&mu_);
  if (layout_.empty()) return absl::FailedPreconditionError("no model registered yet");
  if (next_ == nullptr) next_ = FreeBufferLocked(values_->size(), version_ + 1);
  return absl::MakeSpan(*next_);
}

size_t ParameterStore::UpdatePassLocked(absl::Span<float> sum,
                                        absl::Span<const GradientScale> scales,
                                        const ValueBuffer& before_values, ValueBuffer* after) {
  const size_t n = before_values.size();
  size_t bad = n;
  const std::vector<std::pair<size_t, size_t>> buffers = BufferRanges(layout_);
  // One pass, block by block, each block in the cache from its scaling to its snapshot.
  constexpr size_t kBlock = 4096;
  float* const g = sum.data();
  const float* const before = before_values.data();
  float* const p = after->data();
  // The block's scaled gradient, in the L1 cache: the sum may lie where the new values go.
  std::vector<float>& grad = block_;
  grad.resize(kBlock);
  const bool in_place = g == p;
  size_t scale = 0, buffer = 0;
  for (size_t a = 0; a < n;) {
    while (scales[scale].end <= a) ++scale;
    const size_t b = std::min({n, a + kBlock, scales[scale].end});
    const float factor = scales[scale].factor;
    float* const gb = grad.data();  // gb[i - a] is value i's
    for (size_t i = a; i < b; ++i) gb[i - a] = g[i] * factor;
    if (!in_place) std::fill(g + a, g + b, 0.0f);
    std::copy(before + a, before + b, p + a);
    optimizer_->StepRange(p + a, gb, a, b - a);
    for (; buffer < buffers.size() && buffers[buffer].first < b; ++buffer) {
      const size_t lo = std::max(a, buffers[buffer].first);
      const size_t hi = std::min(b, buffers[buffer].second);
      std::copy(gb + (lo - a), gb + (hi - a), p + lo);
      if (buffers[buffer].second > b) break;  // it goes on in the next block
    }
    int finite = 1;
    for (size_t i = a; i < b; ++i) finite &= std::fabs(p[i]) <= FLT_MAX;  // NaN fails too
    if (finite == 0 && bad == n) bad = a + FirstNonFinite(p + a, b - a);
    if (sink_ != nullptr) sink_->WriteUpdate(a, absl::MakeConstSpan(p + a, b - a));
    a = b;
  }
  return bad;
}

void ParameterStore::SetUpdateSink(UpdateSink* sink) {
  absl::MutexLock lock(&mu_);
  sink_ = sink;
}

void ParameterStore::RemoveUpdateSink(UpdateSink* sink) {
  absl::MutexLock lock(&mu_);
  if (sink_ == sink) sink_ = nullptr;
}

void ParameterStore::SetSnapshotMemory(SnapshotMemory* memory) {
  absl::MutexLock lock(&mu_);
  memory_ = memory;
  fixed_ = {};
  fixed_size_ = 0;
}

std::shared_ptr<ValueBuffer> ParameterStore::FreeBufferLocked(size_t size, int64_t version) {
  if (memory_ != nullptr && fixed_size_ != size) {
    fixed_size_ = size;
    fixed_ = memory_->CreateSnapshotBuffers(size);
    for (const auto& b : fixed_) {
      if (b == nullptr || b->size() != size) fixed_ = {};
    }
  }
  const int index = static_cast<int>(version % 2);
  if (fixed_[index] != nullptr && fixed_[index].use_count() == 1) {
    // The version's own buffer is free (what it held, two versions ago, nobody reads): the
    // pooled ones that nobody holds any more go.
    pool_.erase(
        std::remove_if(pool_.begin(), pool_.end(),
                       [](const std::shared_ptr<ValueBuffer>& b) { return b.use_count() == 1; }),
        pool_.end());
    memory_->SnapshotWriting(index);
    return fixed_[index];
  }
  // A pooled buffer nobody outside holds any more (its pages are already mapped), so a step
  // allocates nothing.
  for (const auto& b : pool_) {
    if (b.use_count() == 1 && b->size() == size) return b;
  }
  auto buffer = std::make_shared<ValueBuffer>(size);
  if (pool_.size() < kSnapshotPool) {
    pool_.push_back(buffer);
  } else {
    // Every pooled buffer is held (or of another size, after LoadState): let the oldest free one
    // go, rather than keep it mapped beside the new one.
    for (auto& b : pool_) {
      if (b.use_count() == 1) {
        b = buffer;
        break;
      }
    }
  }
  return buffer;
}

void ParameterStore::PublishLocked(std::shared_ptr<const ValueBuffer> values) {
  values_ = std::move(values);
  const int index = static_cast<int>(version_ % 2);
  if (memory_ != nullptr && values_ == fixed_[index]) memory_->SnapshotPublished(index, version_);
}

ParameterSnapshot ParameterStore::SnapshotLocked() const {
  return ParameterSnapshot{version_, values_};
}

StoreState ParameterStore::SaveState() const {
  absl::MutexLock lock(&mu_);
  StoreState s;
  s.layout = layout_;
  if (values_) s.values = std::vector<float>(values_->begin(), values_->end());
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
  // Let go of what the state replaces first: its buffers may be the new version's.
  values_.reset();
  next_.reset();
  std::shared_ptr<ValueBuffer> values = FreeBufferLocked(s.values.size(), s.version);
  std::copy(s.values.begin(), s.values.end(), values->begin());
  layout_ = s.layout;
  version_ = s.version;
  PublishLocked(std::move(values));
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
  return values_ ? static_cast<int64_t>(values_->size()) : 0;
}

}  // namespace dbs
