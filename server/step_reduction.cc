#include "server/step_reduction.h"

#include <algorithm>

#include "absl/strings/str_cat.h"

namespace dbs {

absl::Status StepReduction::Take(int id, int samples, std::shared_ptr<const WirePayload> gradient,
                                 BlockSquares blocks) {
  Incoming& in = incoming_[id];
  if (in.gradient != nullptr) {
    return absl::InternalError(absl::StrCat("worker ", id, "'s gradient was taken twice"));
  }
  in.samples = samples;
  in.gradient = std::move(gradient);
  in.blocks = std::move(blocks);
  return absl::OkStatus();
}

float* StepReduction::SumBuffer(size_t to) {
  if (sum_.empty()) {
    absl::StatusOr<absl::Span<float>> next = store_->ReserveNextBuffer();
    if (!next.ok()) return nullptr;
    sum_ = *next;
    zeroed_ = 0;
  }
  to = std::min(to, sum_.size());
  if (to > zeroed_) {
    std::fill(sum_.begin() + zeroed_, sum_.begin() + to, 0.0f);
    zeroed_ = to;
  }
  return sum_.data();
}

absl::Status StepReduction::SumUpTo(int id, Incoming* in, size_t hi) {
  if (in->gradient == nullptr || in->summed >= hi) return absl::OkStatus();
  const size_t model = ModelSize();
  float* const sum = SumBuffer(hi);
  // Its values were checked as they arrived: they are summed without a second
  // pass over them, unless their sender can still write them (shared memory): those are read
  // once each, checked again and summed, each block against its squares.
  const bool writable = in->gradient->writable_by_sender;
  absl::Status added =
      sum == nullptr
          ? absl::InternalError("the step's sum has no buffer: the model is not registered")
          : CheckAndSum(id, in->summed, SubPayload(*in->gradient, in->summed, hi - in->summed), sum,
                        static_cast<float>(in->samples), writable, nullptr,
                        writable ? &in->blocks : nullptr);
  // Values that changed after their check: the blocks summed are those before the changed one,
  // each with the squares that were screened; the rest is left out.
  in->summed = added.ok() ? hi : model;
  if (in->summed == model) in->gradient.reset();  // releases the received message
  return added;
}

void StepReduction::ReduceReady() {
  const std::map<int, int>& quota = quota_;
  const size_t model = ModelSize();
  // What a worker has to add: its whole gradient once it has arrived, nothing before.
  auto incoming = [this](int id) -> Incoming* {
    auto it = incoming_.find(id);
    return it == incoming_.end() || it->second.gradient == nullptr ? nullptr : &it->second;
  };
  auto summed = [this](int id) -> size_t {
    auto it = incoming_.find(id);
    return it == incoming_.end() ? 0 : it->second.summed;
  };
  // In worker order, a worker adds its values only up to where every lower id's are summed (its
  // `floor`); on arrival, all of them. The sum goes window by window, every worker's values for
  // a window one after another, so that the window's part of the sum stays in the cache rather
  // than being read from memory and written back once per worker.
  while (true) {
    // The window starts at the lowest value a worker can add now.
    size_t start = model, floor = model;
    for (const auto& [id, q] : quota) {  // ascending ids
      Incoming* in = incoming(id);
      if (in != nullptr && (deterministic_ ? floor : model) > in->summed) {
        start = std::min(start, in->summed);
      }
      floor = std::min(floor, q == 0 ? model : summed(id));
    }
    if (start == model) return;
    const size_t window_end = std::min(model, start + kReduceWindow);
    floor = model;
    for (const auto& [id, q] : quota) {
      if (Incoming* in = incoming(id); in != nullptr) {
        absl::Status added = SumUpTo(id, in, std::min(window_end, deterministic_ ? floor : model));
        if (!added.ok()) changed_.emplace(id, std::move(added));
      }
      floor = std::min(floor, q == 0 ? model : summed(id));
    }
  }
}

absl::StatusOr<absl::Span<float>> StepReduction::TakeSum() {
  if (SumBuffer(ModelSize()) == nullptr) {
    return absl::InternalError("the step's sum has no buffer: the model is not registered");
  }
  absl::Span<float> sum = sum_;
  sum_ = {};  // the update writes the new parameters there
  zeroed_ = 0;
  return sum;
}

void StepReduction::Restart() {
  quota_.clear();
  incoming_.clear();
  changed_.clear();
  zeroed_ = 0;
}

void StepReduction::Reset() {
  Restart();
  sum_ = {};
}

}  // namespace dbs
