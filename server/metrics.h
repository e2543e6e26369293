// Metrics: the job's Prometheus metrics and its live status, for dbs_ps's HTTP endpoint
// (server/status_http.h). Counters and histograms of what happens (steps, checkpoints, calls)
// come through the observer interfaces; everything else is read from the run record when
// scraped. Free of HTTP and gRPC. Thread-safe.
#ifndef DBS_SERVER_METRICS_H_
#define DBS_SERVER_METRICS_H_

#include <memory>
#include <string>

#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/call_observer.h"
#include "nlohmann/json.hpp"
#include "prometheus/counter.h"
#include "prometheus/family.h"
#include "prometheus/gauge.h"
#include "prometheus/histogram.h"
#include "prometheus/registry.h"
#include "server/job_observer.h"
#include "server/run_summary.h"
#include "server/step_aggregator.h"

namespace dbs {

class Metrics : public JobObserver, public CallObserver {
 public:
  Metrics();

  void OnStep(absl::Duration wall, const StepStats& stats) override;
  void OnCheckpoint(absl::Duration took, bool ok) override;
  void OnCall(const char* method, size_t received, size_t sent, int code) override;
  void OnSharedMemoryWorkers(int workers) override;
  void OnSharedAnswerOverGrpc() override;

  // The Prometheus text format of every metric, the scrape-time ones set from `run` and
  // `progress` (see docs/deploying.md#metrics for the list).
  std::string Render(const RunInfo& run, const StepProgress& progress);

  // The live state for /status.json: the run summary's fields, plus where the job stands
  // (epoch, step, steps per second, ETA) at `now`.
  static nlohmann::json Status(const RunInfo& run, const StepProgress& progress, absl::Time now);

 private:
  void SetFromRun(const RunInfo& run, const StepProgress& progress);
  // The worker label of id `id`: its name.
  static std::string WorkerLabel(const RunInfo& run, int id);
  // Learns the workers' names and labels the barrier waits counted before them.
  void NameWorkers(const RunInfo& run);
  // Workers by id (the barrier-wait counters are labelled by name once it is known).
  absl::Mutex names_mu_;
  std::map<int, std::string> names_ ABSL_GUARDED_BY(names_mu_);
  std::map<int, double> unnamed_wait_ ABSL_GUARDED_BY(names_mu_);  // by id, until named

  std::shared_ptr<prometheus::Registry> registry_;
  prometheus::Histogram& step_seconds_;
  prometheus::Family<prometheus::Counter>& barrier_wait_;
  prometheus::Counter& checkpoint_writes_;
  prometheus::Counter& checkpoint_failures_;
  prometheus::Histogram& checkpoint_seconds_;
  prometheus::Counter& received_bytes_;
  prometheus::Counter& sent_bytes_;
  prometheus::Family<prometheus::Counter>& calls_;
  prometheus::Family<prometheus::Counter>& refused_;
  prometheus::Counter& steps_;
  prometheus::Gauge& shared_memory_workers_;
  prometheus::Counter& shared_answers_over_grpc_;
  prometheus::Gauge& epochs_completed_;
  prometheus::Gauge& epoch_;
  prometheus::Gauge& epoch_seconds_;
  prometheus::Gauge& train_loss_;
  prometheus::Gauge& test_accuracy_;
  prometheus::Family<prometheus::Gauge>& workers_;
  prometheus::Counter& replans_;
  prometheus::Counter& faulty_;
  prometheus::Gauge& imbalance_;
  prometheus::Family<prometheus::Gauge>& batch_;
  prometheus::Family<prometheus::Gauge>& share_;
  prometheus::Family<prometheus::Gauge>& speed_;
  prometheus::Family<prometheus::Counter>& compute_;
  prometheus::Family<prometheus::Counter>& wait_;
  absl::Mutex render_mu_;  // one scrape at a time sets the scrape-time values
};

}  // namespace dbs

#endif  // DBS_SERVER_METRICS_H_
