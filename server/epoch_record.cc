#include "server/epoch_record.h"

#include <algorithm>

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

IdleRun IdleRunOf(const std::vector<EpochRecord>& records, int id, int epoch, int step,
                  int max_epochs) {
  IdleRun run;
  bool idle = true;
  for (int e = std::min(epoch, static_cast<int>(records.size()) - 1);
       e >= 0 && e > epoch - max_epochs; --e) {
    const EpochRecord& r = records[e];
    auto layout = r.layout.find(id);
    if (layout == r.layout.end() || r.dead.count(id) > 0) return run;
    const StepRanges& steps = layout->second;
    const int end = e == epoch ? std::min<int>(step, steps.size()) : static_cast<int>(steps.size());
    for (int s = end - 1; s >= 0; --s) {
      const int64_t samples = CountSamples(steps[s]);
      if (samples > 1) return run;
      idle = idle && samples == 0;
      run.idle_steps += idle ? 1 : 0;
      run.out_steps += 1;
    }
  }
  return run;
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
