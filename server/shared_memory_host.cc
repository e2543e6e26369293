#include "server/shared_memory_host.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"

namespace dbs {
namespace {
// The names of the memory files, which the opening side checks (SharedRegion::Open).
constexpr char kGradientRegion[] = "dbs-gradient";
constexpr char kParameterRegion[] = "dbs-parameters";
}  // namespace

absl::StatusOr<RegionLocation> SharedMemoryHost::Attach(int worker, const RegionLocation& where,
                                                        size_t count) {
  const size_t bytes = count * BytesPerValue(wire_dtype_);
  if (where.bytes != bytes) {
    return absl::InvalidArgumentError(absl::StrCat("a gradient region of ", where.bytes,
                                                   " bytes; the model's ", count, " values in ",
                                                   WireDtypeName(wire_dtype_), " take ", bytes));
  }
  DBS_ASSIGN_OR_RETURN(std::unique_ptr<SharedRegion> region,
                       SharedRegion::Open(where, kGradientRegion));
  absl::MutexLock lock(&mu_);
  // Made at registration as the store's snapshot buffers (CreateSnapshotBuffers), or not at all.
  if (slots_ == nullptr || slots_->count() != count) {
    return absl::FailedPreconditionError(absl::StrCat(
        "this dbs_ps keeps no parameters in shared memory (", no_slots_, "): push over gRPC"));
  }
  gradients_[worker] = std::move(region);
  TellWorkersLocked();
  return slots_region_->location();
}

void SharedMemoryHost::Drop(const std::set<int>& workers) {
  absl::MutexLock lock(&mu_);
  for (int id : workers) gradients_.erase(id);
  TellWorkersLocked();
}

void SharedMemoryHost::TellWorkersLocked() {
  if (on_workers_) on_workers_(static_cast<int>(gradients_.size()));
}

int SharedMemoryHost::workers() const {
  absl::MutexLock lock(&mu_);
  return static_cast<int>(gradients_.size());
}

bool SharedMemoryHost::sharing() const {
  absl::MutexLock lock(&mu_);
  return slots_ != nullptr && !gradients_.empty();
}

absl::StatusOr<std::shared_ptr<const WirePayload>> SharedMemoryHost::Gradient(
    int worker, int samples, WireDtype dtype, size_t carried_bytes) const {
  if (carried_bytes > 0) {
    return absl::InvalidArgumentError(
        "a push with its gradient in shared memory carries no gradient bytes");
  }
  if (samples == 0) return std::make_shared<const WirePayload>();
  if (dtype != wire_dtype_) {
    return absl::InvalidArgumentError(absl::StrCat("the gradient is in ", WireDtypeName(dtype),
                                                   "; this job's wire dtype is ",
                                                   WireDtypeName(wire_dtype_)));
  }
  std::shared_ptr<const SharedRegion> region;
  {
    absl::MutexLock lock(&mu_);
    auto it = gradients_.find(worker);
    if (it != gradients_.end()) region = it->second;
  }
  if (region == nullptr) {
    return absl::FailedPreconditionError(absl::StrCat(
        "worker ", worker, " has no shared memory attached here: attach it, or send the gradient"));
  }
  auto payload = std::make_shared<WirePayload>();
  payload->dtype = wire_dtype_;
  payload->bytes = region->size();
  payload->segments.emplace_back(region->data(), region->size());
  payload->keepalive = std::move(region);
  payload->writable_by_sender = true;
  return payload;
}

bool SharedMemoryHost::SharesSlotOf(int64_t version, int worker) const {
  absl::MutexLock lock(&mu_);
  return slots_ != nullptr && gradients_.count(worker) > 0 && slots_->Holds(version);
}

std::array<std::shared_ptr<ValueBuffer>, 2> SharedMemoryHost::CreateSnapshotBuffers(size_t count) {
  absl::MutexLock lock(&mu_);
  // A former model size's slots (a restored checkpoint of another model) go once nothing holds
  // them; the workers attached to them attach again.
  gradients_.clear();
  TellWorkersLocked();
  slots_.reset();
  slots_region_.reset();
  if (!Fp32IsWireOrder()) {
    // The slots hold the values as they lie in memory, which a worker reads as the wire's.
    no_slots_ = "this machine's floats are not little-endian";
    return {};
  }
  absl::StatusOr<std::unique_ptr<SharedRegion>> region =
      SharedRegion::Create(kParameterRegion, ParameterSlots::RegionBytes(count));
  if (!region.ok()) {  // the snapshots stay on the heap, the answers go over gRPC
    no_slots_ = std::string(region.status().message());
    return {};
  }
  slots_region_ = std::move(*region);
  slots_ = std::make_unique<ParameterSlots>(slots_region_.get(), count);
  slots_->Clear();
  std::array<std::shared_ptr<ValueBuffer>, 2> buffers;
  for (int i = 0; i < 2; ++i) {
    buffers[i] = std::make_shared<ValueBuffer>(slots_->Fp32Slot(i), count, slots_region_);
  }
  return buffers;
}

void SharedMemoryHost::SnapshotWriting(int index) {
  absl::MutexLock lock(&mu_);
  if (slots_ != nullptr) slots_->MarkEmpty(index);
}

void SharedMemoryHost::SnapshotPublished(int index, int64_t version) {
  absl::MutexLock lock(&mu_);
  if (slots_ != nullptr && version % 2 == index) slots_->MarkHolds(version);
}

}  // namespace dbs
