#include "server/epoch_record.h"

namespace dbs {

int64_t EpochRecord::SamplesOf(int worker_id) const {
  auto it = layout.find(worker_id);
  if (it == layout.end()) return 0;
  int64_t n = 0;
  for (const auto& step : it->second) n += CountSamples(step);
  return n;
}

int MostFrequentBatch(const StepRanges& steps) {
  std::map<int64_t, int> count;
  for (const auto& ranges : steps) ++count[CountSamples(ranges)];
  int64_t best = 0;
  int best_count = 0;
  for (const auto& [batch, c] : count) {
    if (c > best_count) {
      best = batch;
      best_count = c;
    }
  }
  return static_cast<int>(best);
}

std::optional<Measurement> MeasurementOf(const EpochRecord& r, int id) {
  auto report = r.reports.find(id);
  if (report == r.reports.end()) return std::nullopt;
  Measurement m;
  m.samples = report->second.samples;
  m.compute_seconds = report->second.compute_seconds;
  auto layout = r.layout.find(id);
  if (layout != r.layout.end()) {
    for (const auto& ranges : layout->second) m.steps += CountSamples(ranges) > 0 ? 1 : 0;
  }
  auto times = r.step_times.find(id);
  if (times != r.step_times.end()) m.by_batch = times->second;
  // The server's own timing of its steps, where it has it, rather than the worker's word.
  if (!m.by_batch.empty()) {
    m.compute_seconds = 0.0;
    for (const auto& [batch, t] : m.by_batch) m.compute_seconds += t.seconds;
  }
  return m;
}

}  // namespace dbs
