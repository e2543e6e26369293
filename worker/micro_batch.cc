#include "worker/micro_batch.h"

#include <algorithm>

#include "common/status_macros.h"

namespace dbs {

int MicroBatches(int batch, int max_batch) {
  if (max_batch <= 0 || batch <= max_batch) return 1;
  return (batch + max_batch - 1) / max_batch;
}

absl::StatusOr<double> ComputeInMicroBatches(const ModelLayout& layout,
                                             absl::Span<const int64_t> indices, int max_batch,
                                             const ComputeFn& compute, absl::Span<float> grad,
                                             std::vector<float>* scratch) {
  const int b = static_cast<int>(indices.size());
  const int k = MicroBatches(b, max_batch);
  if (k == 1) return compute(indices, grad);
  scratch->resize(grad.size());
  std::vector<double> sum(grad.size(), 0.0);
  double loss = 0.0;
  size_t begin = 0;
  for (int i = 0; i < k; ++i) {
    const size_t n = static_cast<size_t>(b / k + (i < b % k ? 1 : 0));
    DBS_ASSIGN_OR_RETURN(const double l,
                         compute(indices.subspan(begin, n), absl::MakeSpan(*scratch)));
    loss += l;
    const double weight = static_cast<double>(n) / b;
    size_t from = 0;
    for (const TensorSpec& t : layout) {
      const size_t to = from + static_cast<size_t>(t.NumElements());
      for (size_t j = from; j < to; ++j) {
        sum[j] = t.buffer ? (*scratch)[j] : sum[j] + weight * (*scratch)[j];
      }
      from = to;
    }
    begin += n;
  }
  std::transform(sum.begin(), sum.end(), grad.begin(),
                 [](double v) { return static_cast<float>(v); });
  return loss;
}

}  // namespace dbs
