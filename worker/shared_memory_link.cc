#include "worker/shared_memory_link.h"

#include <cstdio>
#include <utility>

#include "absl/strings/str_cat.h"

namespace dbs {
namespace {
// The memory files' names, which the opening side checks (SharedRegion::Open).
constexpr char kGradientRegion[] = "dbs-gradient";
constexpr char kParameterRegion[] = "dbs-parameters";
}  // namespace

void SharedMemoryLink::MaybeAttach(size_t values, WireDtype dtype, const Exchange& exchange) {
  if (tried_) return;
  tried_ = true;
  const auto refused = [&](absl::string_view why) {
    Detach();
    std::fprintf(stderr, "dbs_ps at %s shares no memory with this worker (%s): pushing over gRPC\n",
                 server_.c_str(), std::string(why).c_str());
  };
  absl::StatusOr<std::unique_ptr<SharedRegion>> region =
      SharedRegion::Create(kGradientRegion, values * BytesPerValue(dtype));
  if (!region.ok()) return refused(region.status().message());
  gradient_ = std::move(*region);
  const absl::StatusOr<RegionLocation> theirs = exchange(gradient_->location());
  if (!theirs.ok()) {
    const absl::StatusCode code = theirs.status().code();
    if (code == absl::StatusCode::kUnavailable || code == absl::StatusCode::kDeadlineExceeded ||
        code == absl::StatusCode::kCancelled) {
      // Not a refusal: the push that follows meets the same trouble and reports it.
      Detach();
      tried_ = false;
      return;
    }
    return refused(theirs.status().message());
  }
  if (theirs->bytes != ParameterSlots::RegionBytes(values)) {
    return refused(absl::StrCat("its parameter slots are ", theirs->bytes, " bytes, not ",
                                ParameterSlots::RegionBytes(values)));
  }
  region = SharedRegion::Open(*theirs, kParameterRegion);
  if (!region.ok()) return refused(region.status().message());
  params_ = std::move(*region);
  slots_ = std::make_unique<ParameterSlots>(params_.get(), values);
  if (!told_) {
    told_ = true;
    std::fprintf(stderr,
                 "dbs_ps at %s shares memory with this worker: each step's gradient and "
                 "parameters pass through it, not the socket (--shared_memory)\n",
                 server_.c_str());
  }
}

void SharedMemoryLink::Forget() {
  Detach();
  tried_ = false;
  std::fprintf(stderr,
               "dbs_ps at %s no longer shares memory with this worker (restarted?): this push "
               "goes over gRPC, the next attaches again\n",
               server_.c_str());
}

void SharedMemoryLink::Detach() {
  slots_.reset();
  params_.reset();
  gradient_.reset();
}

void SharedMemoryLink::Write(absl::Span<const float> gradient, WireDtype dtype) {
  EncodeValues(gradient, dtype, gradient_->data());
}

bool SharedMemoryLink::Read(int64_t version, absl::Span<float> params, WireDtype dtype) const {
  return slots_->Read(version, params, dtype);
}

}  // namespace dbs
