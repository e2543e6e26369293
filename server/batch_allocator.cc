#include "server/batch_allocator.h"

#include <algorithm>
#include <cmath>
#include <numeric>

#include "absl/strings/str_cat.h"

namespace dbs {

std::vector<int64_t> LargestRemainder(int64_t total, absl::Span<const double> shares) {
  const size_t n = shares.size();
  std::vector<int64_t> out(n, 0);
  if (n == 0 || total <= 0) return out;
  double sum = 0.0;
  for (double s : shares) sum += s;
  std::vector<double> frac(n, 0.0);
  int64_t assigned = 0;
  for (size_t i = 0; i < n; ++i) {
    const double exact = static_cast<double>(total) * (shares[i] / sum);
    out[i] = std::min<int64_t>(total, static_cast<int64_t>(std::floor(exact)));
    frac[i] = exact - static_cast<double>(out[i]);
    assigned += out[i];
  }
  // Floating-point rounding can in principle overshoot; take units back from the smallest parts.
  while (assigned > total) {
    size_t k = 0;
    for (size_t i = 0; i < n; ++i) {
      if (out[i] > 0 && (out[k] == 0 || frac[i] < frac[k])) k = i;
    }
    --out[k];
    frac[k] += 1.0;
    --assigned;
  }
  std::vector<size_t> order(n);
  std::iota(order.begin(), order.end(), size_t{0});
  std::stable_sort(order.begin(), order.end(),
                   [&](size_t a, size_t b) { return frac[a] > frac[b]; });
  for (size_t k = 0; assigned < total; k = (k + 1) % n) {
    ++out[order[k]];
    ++assigned;
  }
  return out;
}

absl::StatusOr<EpochAllocation> AllocateEpoch(int64_t train_samples, int64_t test_samples,
                                              int global_batch, absl::Span<const double> shares) {
  if (train_samples <= 0) return absl::InvalidArgumentError("the training set is empty");
  if (test_samples < 0) return absl::InvalidArgumentError("negative test set size");
  if (global_batch <= 0) return absl::InvalidArgumentError("global batch must be positive");
  if (shares.empty()) return absl::InvalidArgumentError("no workers to allocate to");
  double sum = 0.0;
  for (double s : shares) {
    if (!std::isfinite(s) || s < 0.0) {
      return absl::InvalidArgumentError(absl::StrCat("invalid share ", s));
    }
    sum += s;
  }
  if (sum <= 0.0) return absl::InvalidArgumentError("shares sum to zero");

  const int64_t full_steps = train_samples / global_batch;
  const int64_t remainder = train_samples % global_batch;
  const std::vector<int64_t> batch = LargestRemainder(global_batch, shares);
  const std::vector<int64_t> last = remainder > 0 ? LargestRemainder(remainder, shares) : batch;
  const std::vector<int64_t> test = LargestRemainder(test_samples, shares);

  EpochAllocation out;
  out.num_steps = static_cast<int>(full_steps + (remainder > 0 ? 1 : 0));
  out.workers.resize(shares.size());
  int64_t test_offset = 0;
  for (size_t i = 0; i < shares.size(); ++i) {
    WorkerAllocation& w = out.workers[i];
    w.share = shares[i] / sum;
    w.batch_size = static_cast<int>(batch[i]);
    w.final_batch_size = static_cast<int>(last[i]);
    w.test = {test_offset, test_offset + test[i]};
    test_offset += test[i];
  }
  for (int step = 0; step < out.num_steps; ++step) {
    const bool final_step = step == out.num_steps - 1;
    int64_t offset = static_cast<int64_t>(step) * global_batch;
    for (size_t i = 0; i < shares.size(); ++i) {
      const int64_t b = final_step ? last[i] : batch[i];
      if (b > 0) out.workers[i].train.push_back({offset, offset + b});
      offset += b;
    }
  }
  return out;
}

int64_t WorkerAllocation::train_samples() const {
  int64_t n = 0;
  for (const SampleRange& r : train) n += r.size();
  return n;
}

}  // namespace dbs
