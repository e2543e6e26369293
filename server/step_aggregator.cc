#include "server/step_aggregator.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/multiversion.h"
#include "common/status_macros.h"
#include "glog/logging.h"

namespace dbs {

StepAggregator::StepAggregator(ParameterStore* store, const Clock* clock, AggregatorOptions options)
    : store_(store), clock_(clock), options_(options), screen_(options.screen) {}

void StepAggregator::BeginEpoch(int epoch, StepQuotas quotas) {
  std::vector<Done> orphans;
  Notices notices;
  {
    absl::MutexLock lock(&mu_);
    // Cannot happen while reports wait for the steps (TrainingJob::CanReport); if it did, the
    // pushes still waiting are answered with an error rather than crashing the server.
    if (!pending_.empty()) {
      LOG(ERROR) << "epoch " << epoch << " begun while step " << step_ << " of epoch " << epoch_
                 << " had " << pending_.size() << " pushes waiting; they are refused";
      TakePendingLocked(&orphans);
      stats_ = StepStats();
    }
    AbandonUpdateLocked();  // cannot be open: its step's pushes would still wait
    zeroed_ = 0;            // the sum starts again
    DropIncomingLocked(absl::FailedPreconditionError("the epoch ended before this push completed"),
                       &notices);
    BeginEpochLocked(epoch, std::move(quotas));
    // The plans go out now: each worker's first push of the epoch is timed from here.
    if (clock_ != nullptr) {
      released_ = clock_->Now();
      released_epoch_ = epoch;
      released_step_ = -1;
    }
  }
  Notify(&notices);
  for (Done& d : orphans) {
    d(absl::FailedPreconditionError("the epoch ended while this push waited for its step"));
  }
}

void StepAggregator::BeginEpochLocked(int epoch, StepQuotas quotas) {
  epoch_ = epoch;
  step_ = 0;
  quotas_ = std::move(quotas);
  samples_ = 0;
  streamed_step_ = false;
  epoch_loss_[epoch];
}

void StepAggregator::TakePendingLocked(std::vector<Done>* to_run) {
  for (auto& [id, p] : pending_) {
    if (!p.done) continue;
    auto refused = refused_.find(id);
    if (refused == refused_.end()) {
      to_run->push_back(std::move(p.done));
    } else {
      to_run->push_back([done = std::move(p.done),
                         why = refused->second](const absl::StatusOr<StepResult>&) { done(why); });
    }
  }
  pending_.clear();
  refused_.clear();
  for (auto& [id, s] : suspects_) {
    if (s.pending.done) to_run->push_back(std::move(s.pending.done));
  }
  suspects_.clear();
  step_norms_.clear();
}

bool StepAggregator::IsRetryLocked(const GradientPush& push) const {
  if (!aborted_.ok()) return false;
  if (last_.has_value() && push.epoch == last_->epoch && push.step == last_->step &&
      last_participants_.count(push.worker_id) > 0) {
    return true;
  }
  return push.epoch == epoch_ && push.step == step_ && pending_.count(push.worker_id) > 0;
}

absl::Status StepAggregator::Precheck(const GradientPush& header) const {
  absl::MutexLock lock(&mu_);
  if (IsRetryLocked(header)) return absl::OkStatus();
  return ValidateHeader(header);
}

absl::Status StepAggregator::Validate(const GradientPush& push) const {
  DBS_RETURN_IF_ERROR(ValidateHeader(push));
  if (push.num_samples > 0 && !store_->registered()) {
    return absl::FailedPreconditionError("no model registered yet");
  }
  return absl::OkStatus();
}

absl::Status StepAggregator::CheckGradient(const GradientPush& push, double* sum_squares,
                                           bool* bad_values) const {
  if (push.num_samples <= 0) return absl::OkStatus();  // nothing of it is summed
  if (push.gradient == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat("a push of ", push.num_samples, " samples carries no gradient"));
  }
  const size_t model = static_cast<size_t>(store_->num_elements());
  if (absl::Status count = push.gradient.get()->CheckCount(model); !count.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("gradient rejected: ", count.message()));
  }
  DBS_RETURN_IF_ERROR(
      CheckChunk(push.worker_id, 0, push.gradient.get(), model, /*check_values=*/false));
  const absl::Status values = SumChecked(push.worker_id, 0, *push.gradient, 0, nullptr, 0.0f,
                                         nullptr, /*check=*/true, sum_squares);
  if (bad_values != nullptr) *bad_values = !values.ok();
  return values;
}

absl::Status StepAggregator::CheckChunk(int worker_id, size_t offset, const WirePayload* values,
                                        size_t model, bool check_values) {
  if (values == nullptr || values->bytes == 0) {
    return absl::InvalidArgumentError("a piece of a streamed push carries no values");
  }
  const size_t width = BytesPerValue(values->dtype);
  if (values->bytes % width != 0) {
    return absl::InvalidArgumentError(absl::StrCat("gradient rejected: ", values->bytes,
                                                   " bytes are not a whole number of ",
                                                   WireDtypeName(values->dtype), " values"));
  }
  const size_t count = values->bytes / width;
  if (offset > model || count > model - offset) {
    return absl::InvalidArgumentError(absl::StrCat("gradient rejected: values ", offset, "..",
                                                   offset + count, " lie beyond the model's ",
                                                   model));
  }
  if (!check_values) return absl::OkStatus();
  return SumChecked(worker_id, offset, *values, 0, nullptr, 0.0f, nullptr);
}

namespace {

// The check and the sum over every pushed value, free functions over raw little-endian bytes
// (unaligned loads), so that each is compiled for AVX2 too (multiversion.h), and branch-free, so
// that the compiler vectorizes them.
// Whether every one of the n fp32 values is finite and at most `limit` in magnitude.
DBS_WIDE_VECTORS bool AllWithin(const uint8_t* values, size_t n, float limit) {
  int bad = 0;
  for (size_t i = 0; i < n; ++i) bad |= !(std::fabs(LoadFp32(values, i)) <= limit);
  return bad == 0;
}

// The sum of the squares of n fp32 values, in 16 lanes (a loop the compiler vectorizes without
// reordering a single sum).
DBS_WIDE_VECTORS double SumOfSquares(const uint8_t* values, size_t n) {
  float lanes[16] = {};
  size_t i = 0;
  for (; i + 16 <= n; i += 16) {
    for (size_t k = 0; k < 16; ++k) {
      const float v = LoadFp32(values, i + k);
      lanes[k] += v * v;
    }
  }
  double total = 0.0;
  for (float l : lanes) total += l;
  for (; i < n; ++i) {
    const double v = LoadFp32(values, i);
    total += v * v;
  }
  return total;
}

// sum[i] += weight * values[i], fp32 values.
DBS_WIDE_VECTORS void AddScaled(float* sum, const uint8_t* values, size_t n, float weight) {
  for (size_t i = 0; i < n; ++i) sum[i] += weight * LoadFp32(values, i);
}

uint16_t LoadBf16(const uint8_t* values, size_t i) {
  uint16_t h;
  std::memcpy(&h, values + 2 * i, sizeof h);
  return h;
}

// The same check on bf16 values, on their bits: a bf16 value's magnitude grows with its bits
// without the sign, infinities and NaNs above every finite value. `limit_bits`: the bits of
// the largest bf16 value at most the limit.
DBS_WIDE_VECTORS bool AllWithinBf16(const uint8_t* values, size_t n, uint16_t limit_bits) {
  int bad = 0;
  for (size_t i = 0; i < n; ++i) bad |= (LoadBf16(values, i) & 0x7fffu) > limit_bits;
  return bad == 0;
}

// sum[i] += weight * values[i], bf16 values decoded on the way (a bf16 value is the top half of
// the fp32 one, exactly): the same additions as decoding them first, in one pass.
DBS_WIDE_VECTORS void AddScaledBf16(float* sum, const uint8_t* values, size_t n, float weight) {
  for (size_t i = 0; i < n; ++i) {
    const uint32_t bits = static_cast<uint32_t>(LoadBf16(values, i)) << 16;
    float v;
    std::memcpy(&v, &bits, sizeof v);
    sum[i] += weight * v;
  }
}

// The same on bf16 values.
DBS_WIDE_VECTORS double SumOfSquaresBf16(const uint8_t* values, size_t n) {
  float lanes[16] = {};
  size_t i = 0;
  for (; i + 16 <= n; i += 16) {
    for (size_t k = 0; k < 16; ++k) {
      const uint32_t bits = static_cast<uint32_t>(LoadBf16(values, i + k)) << 16;
      float v;
      std::memcpy(&v, &bits, sizeof v);
      lanes[k] += v * v;
    }
  }
  double total = 0.0;
  for (float l : lanes) total += l;
  for (; i < n; ++i) {
    const uint32_t bits = static_cast<uint32_t>(LoadBf16(values, i)) << 16;
    float v;
    std::memcpy(&v, &bits, sizeof v);
    total += static_cast<double>(v) * v;
  }
  return total;
}

// The bits of the largest bf16 value at most `limit` (positive, finite): fp32's bits cut to
// their top half, which rounds toward zero.
uint16_t Bf16LimitBits(float limit) {
  uint32_t bits;
  std::memcpy(&bits, &limit, sizeof bits);
  return static_cast<uint16_t>(bits >> 16);
}

}  // namespace

absl::Status StepAggregator::SumChecked(int worker_id, size_t offset, const WirePayload& values,
                                        size_t skip, float* sum, float weight, size_t* summed,
                                        bool check, double* sum_squares) {
  // Block by block: each block is checked while it is in the L1 cache, the culprit named only
  // when there is one, and then added. A bad value stops the sum at the start of its block.
  // `raw` holds the block's values as they arrived, little-endian in the payload's dtype:
  // fp32 and bf16 are checked and summed where they lie, fp16 is decoded into `decoded` first.
  static const uint16_t kBf16Limit = Bf16LimitBits(kMaxAbsGradient);
  const WireDtype dtype = values.dtype;
  float decoded[kSumBlock];
  // Values their sender can still write (shared memory) are copied first, block by block, so
  // that what is summed is what was checked.
  alignas(64) uint8_t copy[kSumBlock * sizeof(float)];
  const bool copy_first = check && sum != nullptr && values.writable_by_sender;
  auto block = [&](size_t first, size_t count, const uint8_t* raw) {
    if (copy_first) {
      std::memcpy(copy, raw, count * BytesPerValue(dtype));
      raw = copy;
    }
    const uint8_t* fp32 = raw;
    if (dtype == WireDtype::kFp16) {
      DecodeValues(raw, dtype, absl::MakeSpan(decoded, count));
      fp32 = reinterpret_cast<const uint8_t*>(decoded);
    }
    const bool ok = !check || (dtype == WireDtype::kBf16 ? AllWithinBf16(raw, count, kBf16Limit)
                                                         : AllWithin(fp32, count, kMaxAbsGradient));
    if (!ok) {
      if (summed != nullptr) *summed = first;
      for (size_t i = 0;; ++i) {
        const float x =
            dtype == WireDtype::kBf16 ? Bf16ToFloat(LoadBf16(raw, i)) : LoadFp32(fp32, i);
        if (!(std::fabs(x) <= kMaxAbsGradient)) {  // NaN fails too
          return absl::InvalidArgumentError(absl::StrCat(
              "gradient rejected: worker ", worker_id, "'s element ", offset + first + i, " is ", x,
              " (not finite, or beyond ", kMaxAbsGradient, "); the push is refused"));
        }
      }
    }
    if (sum_squares != nullptr) {
      *sum_squares +=
          dtype == WireDtype::kBf16 ? SumOfSquaresBf16(raw, count) : SumOfSquares(fp32, count);
    }
    if (sum != nullptr) {
      if (dtype == WireDtype::kBf16) {
        AddScaledBf16(sum + offset + first, raw, count, weight);
      } else {
        AddScaled(sum + offset + first, fp32, count, weight);
      }
    }
    return absl::OkStatus();
  };
  const size_t width = BytesPerValue(dtype);
  // Values [from, from + count) of the piece; those before `skip` were summed already.
  auto range = [&](size_t from, const uint8_t* data, size_t count) -> absl::Status {
    for (size_t b = 0; b < count; b += kSumBlock) {
      size_t lo = b, hi = std::min(count, b + kSumBlock);
      if (from + hi <= skip) continue;
      if (from + lo < skip) lo = skip - from;
      DBS_RETURN_IF_ERROR(block(from + lo, hi - lo, data + width * lo));
    }
    return absl::OkStatus();
  };
  const absl::Status status = ForEachRun(values, range);
  if (status.ok() && summed != nullptr) *summed = values.bytes / width;
  return status;
}

absl::Status StepAggregator::ValidateHeader(const GradientPush& push) const {
  if (!aborted_.ok()) return aborted_;
  const int num_steps = static_cast<int>(quotas_.size());
  if (evicted_.count(push.worker_id) > 0) {
    return absl::NotFoundError(absl::StrCat("worker ", push.worker_id,
                                            " was declared dead after missing a step deadline; "
                                            "its samples went to the other workers"));
  }
  const std::map<int, int>* step_quota =
      step_ < num_steps ? &quotas_[step_] : (quotas_.empty() ? nullptr : &quotas_.back());
  if (step_quota == nullptr || step_quota->count(push.worker_id) == 0) {
    return absl::NotFoundError(absl::StrCat("worker ", push.worker_id, " is not part of epoch ",
                                            epoch_, "; register with the scheduler first"));
  }
  if (push.epoch != epoch_ || push.step != step_ || step_ >= num_steps) {
    return absl::FailedPreconditionError(absl::StrCat(
        "push for epoch ", push.epoch, " step ", push.step, " does not match the current step (",
        step_ >= num_steps ? absl::StrCat("epoch ", epoch_, " has ended")
                           : absl::StrCat("epoch ", epoch_, " step ", step_),
        ")"));
  }
  const int want = step_quota->at(push.worker_id);
  if (push.num_samples != want) {
    return absl::InvalidArgumentError(absl::StrCat("worker ", push.worker_id, " pushed ",
                                                   push.num_samples, " samples at step ", step_,
                                                   "; its plan says ", want));
  }
  return absl::OkStatus();
}

void StepAggregator::Notify(Notices* notices) {
  for (auto& [taken, status] : *notices) {
    if (taken) taken(status);
  }
  notices->clear();
}

absl::Status StepAggregator::PushChunk(const GradientPush& header, size_t offset,
                                       std::shared_ptr<const WirePayload> values, Taken taken) {
  // Its shape is checked before the lock; its values as they are summed (SumChecked), so that
  // each received byte is read from memory once.
  const size_t model = static_cast<size_t>(store_->num_elements());
  DBS_RETURN_IF_ERROR(
      CheckChunk(header.worker_id, offset, values.get(), model, /*check_values=*/false));
  const size_t end = offset + values->bytes / BytesPerValue(values->dtype);
  Notices notices;
  absl::Status status;
  std::optional<ValuesReady> ready;
  {
    absl::MutexLock lock(&mu_);
    if (IsRetryLocked(header)) {
      // The push was counted already: its values are not used again.
      notices.emplace_back(std::move(taken), absl::OkStatus());
    } else {
      status = Validate(header);
      if (status.ok() && header.num_samples <= 0) {
        status = absl::InvalidArgumentError("a push of 0 samples carries no gradient");
      }
      if (status.ok()) {
        Incoming& in = incoming_[header.worker_id];
        if (end <= in.received) {
          notices.emplace_back(std::move(taken), absl::OkStatus());  // sent again by a retry
        } else if (offset > in.received) {
          status = absl::InvalidArgumentError(
              absl::StrCat("worker ", header.worker_id, " sent values ", offset, "..", end,
                           " of step ", header.step, " when ", in.received,
                           " of them had arrived: a push's pieces must be consecutive"));
        } else {
          // A retry may resend values summed before a refusal inside its piece: they are
          // skipped.
          const uint64_t serial = ++last_piece_;
          streamed_step_ = true;
          in.samples = header.num_samples;
          in.queued.push_back(
              Piece{offset, std::move(values), std::move(taken), in.received - offset, serial});
          in.received = end;
          // Refused when its turn has come at once: the refusal is returned and `taken` never
          // runs; later, `taken` gets it.
          ReduceReadyLocked(&notices, serial, &status);
          AdvanceUpdateLocked();
        }
      }
    }
    ready = std::exchange(ready_, std::nullopt);
  }
  Notify(&notices);
  TellReady(ready);
  return status;
}

absl::Status StepAggregator::TakeGradientLocked(const GradientPush& push) {
  if (push.num_samples <= 0) return absl::OkStatus();
  Incoming& in = incoming_[push.worker_id];
  const size_t model = ModelSize();
  if (push.streamed) {
    if (in.received == model) return absl::OkStatus();
    return absl::InvalidArgumentError(absl::StrCat("worker ", push.worker_id, "'s push of step ",
                                                   push.step, " ended after ", in.received,
                                                   " of the model's ", model, " values"));
  }
  if (in.received > 0) {
    return absl::FailedPreconditionError(
        absl::StrCat("worker ", push.worker_id, " began step ", push.step,
                     "'s push as a stream: finish it as a stream"));
  }
  in.samples = push.num_samples;
  in.received = model;
  // Its values were checked before the lock (CheckGradient): they are summed without a second
  // pass over them, unless its sender can still write them (shared memory): those are checked
  // again, one read of each value, as they are summed.
  in.queued.push_back(Piece{0, push.gradient.shared(), nullptr, 0, ++last_piece_,
                            /*checked=*/!(*push.gradient).writable_by_sender, /*whole=*/true});
  return absl::OkStatus();
}

uint64_t StepAggregator::Push(const GradientPush& push, Done done) {
  // The values are checked before the lock, so pushes arriving together check in parallel. A
  // retry's gradient is not used (the first push's was counted), whatever it holds.
  CheckedGradient checked;
  if (!push.streamed) {
    checked.status = CheckGradient(push, &checked.sum_squares, &checked.bad_values);
  }
  PushOutcome out;
  Done superseded;
  uint64_t retry_ticket = 0;
  std::optional<ValuesReady> ready;
  {
    absl::MutexLock lock(&mu_);
    Pending* earlier = aborted_.ok() && push.epoch == epoch_ && push.step == step_
                           ? PendingOfLocked(push.worker_id)
                           : nullptr;
    if (last_.has_value() && push.epoch == last_->epoch && push.step == last_->step &&
        last_participants_.count(push.worker_id) > 0 && aborted_.ok()) {
      // A retry of the step that just completed: answer with its result.
      out.result = *last_;
      out.to_run.push_back(std::move(done));
    } else if (earlier != nullptr) {
      // A retry of a pending push: it waits for the same result in the earlier call's place;
      // the gradient is not added again.
      superseded = std::move(earlier->done);
      earlier->done = std::move(done);
      earlier->ticket = retry_ticket = ++last_ticket_;
    } else {
      TakeNewPushLocked(push, checked, std::move(done), &out);
    }
    ready = std::exchange(ready_, std::nullopt);
  }
  Notify(&out.notices);
  TellReady(ready);
  TellFaulty(out.faulty, &out.refusals);
  if (out.waiting != 0) return out.waiting;
  if (retry_ticket != 0) {
    if (superseded) {
      superseded(
          absl::AbortedError(absl::StrCat("a retry of worker ", push.worker_id, "'s push of step ",
                                          push.step, " took this call's place")));
    }
    return retry_ticket;
  }
  if (out.completed) AfterStep(out.stats, &out.result);
  for (Done& d : out.to_run) d(out.result);
  return 0;
}

StepAggregator::Pending* StepAggregator::PendingOfLocked(int worker) {
  if (auto p = pending_.find(worker); p != pending_.end()) return &p->second;
  if (auto s = suspects_.find(worker); s != suspects_.end()) return &s->second.pending;
  return nullptr;
}

absl::Status StepAggregator::ScreenLocked(const GradientPush& push, const CheckedGradient& checked,
                                          std::vector<FaultyPush>* faulty) const {
  if (push.streamed || push.num_samples <= 0 || options_.screen.mode == FaultyGradients::kOff) {
    return absl::OkStatus();
  }
  if (checked.bad_values && options_.screen.mode == FaultyGradients::kEvict) {
    // A value no GPU computes: its worker is removed as a dead one is.
    faulty->push_back(FaultyPush{push.worker_id, push.epoch, push.step, checked.status, true});
    return Quarantined(push.worker_id, push.epoch, push.step, checked.status);
  }
  return absl::OkStatus();
}

void StepAggregator::TakeNewPushLocked(const GradientPush& push, const CheckedGradient& checked,
                                       Done done, PushOutcome* out) {
  const bool screened =
      !push.streamed && push.num_samples > 0 && options_.screen.mode != FaultyGradients::kOff;
  const PushNorm norm{std::sqrt(checked.sum_squares), push.num_samples};
  absl::Status valid = Validate(push);
  if (valid.ok()) valid = ScreenLocked(push, checked, &out->faulty);
  // A norm far above the job's recent ones: held until the step's other pushes tell a spike
  // they share from this one's outlier.
  const absl::Status suspicion =
      valid.ok() && screened && checked.status.ok() ? screen_.Judge(norm) : absl::OkStatus();
  if (valid.ok()) valid = checked.status;
  if (valid.ok() && suspicion.ok()) valid = TakeGradientLocked(push);
  if (!valid.ok()) {
    out->result = valid;
    out->to_run.push_back(std::move(done));
    return;
  }
  uint64_t mine = 0;
  if (!suspicion.ok()) {
    suspects_[push.worker_id] =
        Suspect{push, Pending{std::move(done), ++last_ticket_}, norm, suspicion};
    mine = last_ticket_;
  } else {
    // A push summed (a log-only outlier too) is part of what the job's gradients have been.
    if (screened) screen_.Accepted(norm);
    AcceptLocked(push, std::move(done));
    mine = last_ticket_;
    ReduceReadyLocked(&out->notices);
  }
  if (screened) step_norms_[push.worker_id] = norm;
  ResolveSuspectsLocked(&out->faulty, &out->refusals, &out->notices);
  if (!pending_.empty() && pending_.size() == quotas_[step_].size()) {
    out->stats = TakeStepStatsLocked();
    out->completed = true;
    CompleteStepLocked(&out->to_run, &out->result, &out->notices);
    return;
  }
  if (suspicion.ok()) AdvanceUpdateLocked();
  out->waiting = mine;
}

absl::Status StepAggregator::Quarantined(int worker, int epoch, int step, const absl::Status& why) {
  return absl::AbortedError(absl::StrCat(
      "worker ", worker, " is quarantined: its gradient of epoch ", epoch + 1, " step ", step + 1,
      " is faulty (", why.message(), "); the job goes on without it"));
}

void StepAggregator::ResolveSuspectsLocked(std::vector<FaultyPush>* faulty, Refusals* refusals,
                                           Notices* notices) {
  if (suspects_.empty() || step_ >= static_cast<int>(quotas_.size()) ||
      pending_.size() + suspects_.size() < quotas_[step_].size()) {
    return;
  }
  const bool evict = options_.screen.mode == FaultyGradients::kEvict;
  for (auto& [id, s] : suspects_) {
    std::vector<PushNorm> others;
    for (const auto& [w, n] : step_norms_) {
      if (w != id) others.push_back(n);
    }
    // Alone at its step, the job's history is all there is to judge it by.
    absl::Status verdict = s.verdict;
    if (!others.empty()) {
      verdict = JudgeNorm(s.norm, others, options_.screen.norm_ratio,
                          absl::StrCat("the other ", others.size(), " workers' at this step"));
      if (!verdict.ok()) {
        verdict = absl::InvalidArgumentError(absl::StrCat(
            verdict.message(), "; against the job's recent pushes: ", s.verdict.message()));
      }
    }
    if (verdict.ok() || !evict) {
      if (!verdict.ok()) faulty->push_back(FaultyPush{id, epoch_, step_, verdict, false});
      const uint64_t ticket = s.pending.ticket;
      AcceptLocked(s.push, std::move(s.pending.done));
      pending_[id].ticket = ticket;
      screen_.Accepted(s.norm);
      const absl::Status taken = TakeGradientLocked(s.push);
      if (!taken.ok()) LOG(ERROR) << "worker " << id << "'s held push: " << taken;
    } else {
      faulty->push_back(FaultyPush{id, epoch_, step_, verdict, true});
      step_norms_.erase(id);
      refusals->emplace_back(std::move(s.pending.done), Quarantined(id, epoch_, step_, verdict));
    }
  }
  suspects_.clear();
  ReduceReadyLocked(notices);
}

void StepAggregator::TellFaulty(const std::vector<FaultyPush>& faulty, Refusals* refusals) {
  for (const FaultyPush& f : faulty) {
    LOG(WARNING) << "worker " << f.worker_id << "'s gradient of epoch " << f.epoch + 1 << " step "
                 << f.step + 1 << " is faulty: " << f.why.message()
                 << (f.quarantine ? "; not summed, the worker is quarantined"
                                  : "; summed (--faulty_gradients=log)");
    if (faulty_hook_) faulty_hook_(f);
  }
  for (auto& [done, why] : *refusals) {
    if (done) done(why);
  }
  refusals->clear();
}

void StepAggregator::AfterStep(const StepStats& stats, absl::StatusOr<StepResult>* result) {
  if (!result->ok()) {
    if (failure_hook_) failure_hook_(result->status());
    return;
  }
  // Nobody can push the next step before these answers go out, so a re-plan made here is in
  // place for it.
  if (hook_) {
    std::optional<PlanChange> replan = hook_(stats);
    if (replan.has_value() && !stats.last_of_epoch) {
      auto revisions =
          std::make_shared<const std::map<int, PlanRevision>>(std::move(replan->revisions));
      absl::MutexLock lock(&mu_);
      quotas_.resize(static_cast<size_t>(step_));
      for (auto& q : replan->later_quotas) quotas_.push_back(std::move(q));
      (*result)->revisions = revisions;
      if (last_.has_value()) last_->revisions = revisions;
    }
  }
  // The answers go out now: each worker's next push measures its cycle from here (the hook's
  // checkpoints and re-plans above are the server's time, not the workers').
  MarkReleased(stats.epoch, stats.step);
}

void StepAggregator::AcceptLocked(const GradientPush& push, Done done) {
  samples_ += push.num_samples;
  losses_[push.worker_id] = push.loss_sum;
  ++accepted_pushes_;
  pending_[push.worker_id] = Pending{std::move(done), ++last_ticket_};
  accepted_[epoch_].insert({push.worker_id, step_});
  stats_.workers[push.worker_id] = {push.num_samples, push.compute_seconds};
  if (clock_ != nullptr && released_epoch_ == epoch_ && released_step_ == step_ - 1) {
    const double cycle = absl::ToDoubleSeconds(clock_->Now() - released_);
    stats_.cycle[push.worker_id] = cycle;
  }
}

StepStats StepAggregator::TakeStepStatsLocked() {
  StepStats stats;
  stats.epoch = epoch_;
  stats.step = step_;
  stats.workers = std::move(stats_.workers);
  stats_.workers.clear();
  stats.cycle = std::move(stats_.cycle);
  stats_.cycle.clear();
  stats.last_of_epoch = step_ + 1 >= static_cast<int>(quotas_.size());
  return stats;
}

void StepAggregator::MarkReleased(int epoch, int step) {
  if (clock_ == nullptr) return;
  absl::MutexLock lock(&mu_);
  released_ = clock_->Now();
  released_epoch_ = epoch;
  released_step_ = step;
}

bool StepAggregator::CancelWait(uint64_t ticket) {
  absl::MutexLock lock(&mu_);
  for (auto& [id, p] : pending_) {
    if (p.ticket == ticket && p.done) {
      p.done = nullptr;
      return true;
    }
  }
  for (auto& [id, s] : suspects_) {
    if (s.pending.ticket == ticket && s.pending.done) {
      s.pending.done = nullptr;
      return true;
    }
  }
  return false;
}

void StepAggregator::SumUpToLocked(int id, Incoming* in, size_t hi, Notices* notices,
                                   uint64_t watch, absl::Status* watched) {
  while (in->summed < hi && !in->queued.empty()) {
    Piece& piece = in->queued.front();
    const size_t end = piece.offset + piece.values->bytes / BytesPerValue(piece.values->dtype);
    // Its values [from, to): those before `skip` were summed before (a retry after a refusal).
    const size_t from = std::max(in->summed, piece.offset + piece.skip) - piece.offset;
    const size_t to = std::min(hi, end) - piece.offset;
    size_t summed = 0;
    float* const sum = from < to && in->samples > 0 ? SumLocked(piece.offset + to) : nullptr;
    const absl::Status added =
        from >= to ? absl::OkStatus()
        : in->samples > 0 && sum == nullptr
            ? absl::InternalError("the step's sum has no buffer: the model is not registered")
            : SumChecked(id, piece.offset + from, SubPayload(*piece.values, from, to - from), 0,
                         sum, static_cast<float>(in->samples), &summed, !piece.checked);
    if (!added.ok() && piece.whole) {
      // A whole push checked before the lock whose values then changed (its sender's shared
      // memory): the values summed are the checked ones before the bad block; the rest of it
      // is left out, so that the step completes with every other worker's values, and the
      // push is refused when it does.
      LOG(WARNING) << "worker " << id << "'s gradient changed after it was checked; its push of "
                   << "epoch " << epoch_ << " step " << step_ << " is refused: " << added;
      refused_.emplace(id, absl::InvalidArgumentError(absl::StrCat(
                               "the gradient in shared memory changed after it was checked: ",
                               added.message())));
      in->summed = in->received = end;
      in->queued.pop_front();
      continue;
    }
    if (!added.ok()) {
      // The values before the bad one's block stay summed, as the pieces before a refused
      // piece do; the rest of the push must come again (a retry resumes from there).
      in->summed = in->received = piece.offset + from + summed;
      if (piece.serial == watch) {
        *watched = added;
      } else {
        notices->emplace_back(std::move(piece.taken), added);
      }
      in->queued.pop_front();
      for (Piece& later : in->queued) {
        notices->emplace_back(std::move(later.taken),
                              absl::InvalidArgumentError(absl::StrCat("an earlier piece of worker ",
                                                                      id, "'s push was refused")));
      }
      in->queued.clear();
      return;
    }
    in->summed = piece.offset + to;
    if (in->summed < end) break;  // the rest of it waits for the next window
    notices->emplace_back(std::move(piece.taken), absl::OkStatus());
    in->queued.pop_front();  // releases the received message
  }
}

void StepAggregator::ReduceReadyLocked(Notices* notices, uint64_t watch, absl::Status* watched) {
  if (step_ >= static_cast<int>(quotas_.size())) return;
  const size_t model = ModelSize();
  const std::map<int, int>& quota = quotas_[step_];
  auto incoming = [this](int id) -> Incoming* {
    auto it = incoming_.find(id);
    return it == incoming_.end() ? nullptr : &it->second;
  };
  // In worker order, a worker adds its values only up to where every lower id's are summed (its
  // `floor`); on arrival (not deterministic), as far as they have come. The sum goes window by
  // window (kReduceWindow values), every worker's values for a window one after another, so
  // that the window's part of the sum stays in the cache from the first worker's values to the
  // last's and to the (pipelined) update after them, rather than being read from memory and
  // written back once per worker.
  while (true) {
    // The window starts at the lowest value a worker can add now.
    size_t start = model, floor = model;
    for (const auto& [id, q] : quota) {  // ascending ids
      Incoming* in = incoming(id);
      if (in != nullptr && !in->queued.empty() &&
          std::min(in->received, options_.deterministic ? floor : model) > in->summed) {
        start = std::min(start, in->summed);
      }
      floor = std::min(floor, q == 0 ? model : (in == nullptr ? 0 : in->summed));
    }
    if (start == model) return;
    const size_t window_end = std::min(model, start + kReduceWindow);
    floor = model;
    for (const auto& [id, q] : quota) {
      Incoming* in = incoming(id);
      if (in != nullptr) {
        const size_t hi =
            std::min({window_end, in->received, options_.deterministic ? floor : model});
        if (hi > in->summed) SumUpToLocked(id, in, hi, notices, watch, watched);
      }
      floor = std::min(floor, q == 0 ? model : (in == nullptr ? 0 : in->summed));
    }
    AdvanceUpdateLocked();  // while the window's sum is in the cache
  }
}

void StepAggregator::DropIncomingLocked(const absl::Status& status, Notices* notices) {
  for (auto& [id, in] : incoming_) {
    for (Piece& piece : in.queued) notices->emplace_back(std::move(piece.taken), status);
  }
  incoming_.clear();
  losses_.clear();
}

bool StepAggregator::MeanScalesLocked(std::vector<GradientScale>* scales) {
  // The step's workers' samples (each push's samples are its quota; once the step completes,
  // they are the samples pushed). An evicted worker may have streamed part of its gradient: its
  // values up to where they were summed count, with its samples, in that range's mean (nothing
  // accepted is lost).
  const std::map<int, int>& quota = quotas_[step_];
  int64_t samples = 0;
  for (const auto& [id, q] : quota) samples += q;
  std::vector<std::pair<size_t, int>> partial;  // (summed prefix, samples), ascending prefix
  int64_t extra = 0;                            // the partial pushes' samples
  for (const auto& [id, in] : incoming_) {
    if (quota.count(id) == 0 && in.summed > 0) {
      partial.emplace_back(in.summed, in.samples);
      extra += in.samples;
    }
  }
  if (samples + extra == 0) return false;
  std::sort(partial.begin(), partial.end());
  // Values before `end` were summed over `samples` samples.
  auto scale = [&](size_t end, int64_t samples) {
    const float inv = samples > 0 ? 1.0f / static_cast<float>(samples) : 0.0f;
    if (scales->empty() || scales->back().end < end) scales->push_back({end, inv});
  };
  for (const auto& [summed, part] : partial) {
    scale(summed, samples + extra);
    extra -= part;
  }
  scale(ModelSize(), samples);
  return true;
}

void StepAggregator::AdvanceUpdateLocked() {
  // Whole pushes gain nothing: their answers go out with the step's result in any case.
  if (!options_.pipelined || !streamed_step_ || !aborted_.ok() ||
      step_ >= static_cast<int>(quotas_.size())) {
    return;
  }
  if (quiescing_ && !updating_) return;
  // The values every worker of the step has summed (in worker order or not, each worker's
  // summed values are a prefix).
  size_t ready = ModelSize();
  bool any = false;
  for (const auto& [id, quota] : quotas_[step_]) {
    if (quota == 0) continue;
    any = true;
    auto it = incoming_.find(id);
    ready = std::min(ready, it == incoming_.end() ? size_t{0} : it->second.summed);
  }
  std::vector<GradientScale> scales;
  if (!any || ready <= updated_ || !MeanScalesLocked(&scales)) return;
  float* const sum = SumLocked(ready);  // reserved before the update takes the buffer
  if (sum == nullptr) return;
  if (!updating_) {
    absl::StatusOr<int64_t> version = store_->BeginUpdate();
    if (!version.ok()) return;  // the step's end reports what is wrong
    updating_ = true;
    updating_version_ = *version;
  }
  const bool finite = store_->UpdateRange(sum_, scales, ready);
  updated_ = ready;
  // Values after a non-finite one are not sent: the step will fail.
  if (finite) ready_ = ValuesReady{epoch_, step_, updating_version_, ready};
}

size_t StepAggregator::ModelSize() const { return static_cast<size_t>(store_->num_elements()); }

float* StepAggregator::SumLocked(size_t to) {
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

void StepAggregator::AbandonUpdateLocked() {
  if (!updating_) return;
  store_->AbandonUpdate();
  updating_ = false;
  updated_ = 0;
  ready_.reset();
  sum_ = {};  // the store dropped the update's buffer, and the sum in it
  zeroed_ = 0;
}

void StepAggregator::TellReady(std::optional<ValuesReady> ready) const {
  if (ready.has_value() && values_hook_) {
    values_hook_(ready->epoch, ready->step, ready->version, ready->ready);
  }
}

void StepAggregator::CompleteStepLocked(std::vector<Done>* to_run,
                                        absl::StatusOr<StepResult>* result, Notices* notices) {
  // Every worker of the step has pushed (or was evicted): apply the sample-weighted mean.
  ReduceReadyLocked(notices);
  double loss_sum = 0.0;
  for (const auto& [id, loss] : losses_) loss_sum += loss;  // in worker order: repeatable
  StepResult r;
  r.epoch = epoch_;
  r.step = step_;
  r.global_samples = samples_;
  r.global_loss = samples_ > 0 ? loss_sum / samples_ : 0.0;
  r.revisions = std::move(revisions_);
  revisions_.reset();
  // The mean and the update in one pass, which leaves the sum cleared for the next step.
  std::vector<GradientScale> scales;
  const bool update = MeanScalesLocked(&scales);
  absl::StatusOr<ParameterSnapshot> snap;
  if (!update) {
    AbandonUpdateLocked();  // cannot be open: its values had samples
    snap = store_->Snapshot();
  } else {
    // The rest of a pipelined update, or all of it. The values no push reached (an evicted
    // worker's) are zeroed first.
    const size_t model = ModelSize();
    absl::Status begun =
        SumLocked(model) == nullptr
            ? absl::InternalError("the step's sum has no buffer: the model is not registered")
        : updating_ ? absl::OkStatus()
                    : store_->BeginUpdate().status();
    if (begun.ok()) {
      store_->UpdateRange(sum_, scales, model);
      snap = store_->EndUpdate();
    } else {
      snap = begun;
    }
    sum_ = {};  // now the new parameters (or dropped with the failed update)
    zeroed_ = 0;
    updating_ = false;
    updated_ = 0;
    ready_.reset();
  }
  streamed_step_ = false;
  if (snap.ok()) {
    r.parameters = *snap;
    *result = r;
    EpochLoss& el = epoch_loss_[epoch_];
    el.loss_sum += loss_sum;
    el.samples += samples_;
    el.steps_completed += 1;
    last_ = r;
    last_participants_.clear();
    for (const auto& [id, unused] : pending_) {
      if (refused_.count(id) == 0) last_participants_[id] = 1;
    }
  } else {
    *result = snap.status();
  }
  TakePendingLocked(to_run);
  if (!update) zeroed_ = 0;                       // nothing was summed; the buffer stays reserved
  DropIncomingLocked(absl::OkStatus(), notices);  // none is left queued
  samples_ = 0;
  ++step_;
}

bool StepAggregator::Evict(int epoch, int step, const std::set<int>& dead) {
  absl::MutexLock lock(&mu_);
  if (!aborted_.ok() || epoch != epoch_ || step != step_ ||
      step_ >= static_cast<int>(quotas_.size()) || dead.empty()) {
    return false;
  }
  for (int id : dead) {
    if (pending_.count(id) > 0 || quotas_[step_].count(id) == 0) return false;
  }
  evicted_.insert(dead.begin(), dead.end());
  return true;
}

void StepAggregator::CompleteEviction(PlanChange change) {
  std::vector<FaultyPush> faulty;
  Refusals refusals;
  std::vector<Done> to_run;
  absl::StatusOr<StepResult> result;
  Notices notices;
  bool completed = false;
  std::optional<ValuesReady> ready;
  {
    absl::MutexLock lock(&mu_);
    for (int id : evicted_) {
      quotas_[step_].erase(id);
      // Its pieces not yet summed are dropped; those summed stay (CompleteStepLocked).
      auto in = incoming_.find(id);
      if (in == incoming_.end()) continue;
      for (Piece& piece : in->second.queued) {
        notices.emplace_back(
            std::move(piece.taken),
            absl::NotFoundError(
                absl::StrCat("worker ", id, " was declared dead after missing a step deadline")));
      }
      in->second.queued.clear();
      in->second.received = in->second.summed;
    }
    quotas_.resize(static_cast<size_t>(step_) + 1);
    for (auto& q : change.later_quotas) quotas_.push_back(std::move(q));
    revisions_ = std::make_shared<const std::map<int, PlanRevision>>(std::move(change.revisions));
    ReduceReadyLocked(&notices);  // an evicted worker may have been the one the sum waited for
    ResolveSuspectsLocked(&faulty, &refusals, &notices);
    if (pending_.size() >= quotas_[step_].size()) {  // else the survivors are still pushing
      CompleteStepLocked(&to_run, &result, &notices);
      completed = true;
    } else {
      AdvanceUpdateLocked();
    }
    ready = std::exchange(ready_, std::nullopt);
  }
  Notify(&notices);
  TellReady(ready);
  TellFaulty(faulty, &refusals);
  if (!completed) return;
  for (Done& d : to_run) d(result);
}

bool StepAggregator::ReviseFrom(int epoch, int step, StepQuotas later_quotas) {
  absl::MutexLock lock(&mu_);
  if (epoch != epoch_ || step < 0 || step_ < step || step_ > step + 1 ||
      step >= static_cast<int>(quotas_.size())) {
    return false;
  }
  if (step_ == step + 1 && !pending_.empty()) return false;  // the next step has begun
  quotas_.resize(static_cast<size_t>(step) + 1);
  for (auto& q : later_quotas) quotas_.push_back(std::move(q));
  return true;
}

std::set<std::pair<int, int>> StepAggregator::AcceptedPushes(int epoch) const {
  absl::MutexLock lock(&mu_);
  auto it = accepted_.find(epoch);
  return it == accepted_.end() ? std::set<std::pair<int, int>>{} : it->second;
}

void StepAggregator::Abort(const absl::Status& status) {
  std::vector<Done> to_run;
  Notices notices;
  {
    absl::MutexLock lock(&mu_);
    if (aborted_.ok()) aborted_ = status;
    TakePendingLocked(&to_run);
    DropIncomingLocked(status, &notices);
    AbandonUpdateLocked();
  }
  Notify(&notices);
  for (Done& d : to_run) d(status);
}

bool StepAggregator::Quiesce(absl::Duration timeout) {
  absl::MutexLock lock(&mu_);
  quiescing_ = true;
  auto ended = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return !updating_ || !aborted_.ok(); };
  mu_.AwaitWithTimeout(absl::Condition(&ended), timeout);
  return !updating_;
}

std::map<int, int> StepAggregator::Quota(int epoch, int step) const {
  absl::MutexLock lock(&mu_);
  if (epoch != epoch_ || step < 0 || step >= static_cast<int>(quotas_.size())) return {};
  return quotas_[step];
}

StepProgress StepAggregator::Progress() const {
  absl::MutexLock lock(&mu_);
  StepProgress p;
  p.epoch = epoch_;
  p.step = step_;
  p.num_steps = static_cast<int>(quotas_.size());
  p.accepted_pushes = accepted_pushes_;
  p.pushed = static_cast<int>(pending_.size());
  if (step_ < p.num_steps) {
    for (const auto& [id, quota] : quotas_[step_]) {
      if (pending_.count(id) == 0) p.waiting_for.push_back(id);
    }
  }
  return p;
}

StepAggregator::State StepAggregator::SaveState() const {
  absl::MutexLock lock(&mu_);
  State s;
  s.epoch = epoch_;
  s.step = step_;
  s.losses = epoch_loss_;
  auto it = accepted_.find(epoch_);
  if (it != accepted_.end()) s.accepted = it->second;
  s.store = store_->SaveState();  // under our lock: no step can complete meanwhile
  s.updating = updating_;
  return s;
}

void StepAggregator::LoadState(const State& s, StepQuotas quotas) {
  absl::MutexLock lock(&mu_);
  epoch_ = s.epoch;
  step_ = s.step;
  quotas_ = std::move(quotas);
  epoch_loss_ = s.losses;
  accepted_.clear();
  accepted_[s.epoch] = s.accepted;
  pending_.clear();
  sum_ = {};  // the store's LoadState dropped its reservation
  zeroed_ = 0;
  incoming_.clear();  // restored before any call is served: no stream waits on them
  losses_.clear();
  samples_ = 0;
  last_.reset();
  evicted_.clear();
  updating_ = false;
  updated_ = 0;
  ready_.reset();
  streamed_step_ = false;
}

EpochLoss StepAggregator::LossOf(int epoch) const {
  absl::MutexLock lock(&mu_);
  auto it = epoch_loss_.find(epoch);
  return it == epoch_loss_.end() ? EpochLoss{} : it->second;
}

}  // namespace dbs
