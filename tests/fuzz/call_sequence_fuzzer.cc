// Fuzz target: any sequence of the calls a peer can make (register, register the model, fetch a
// plan, push (fp32 values, or raw bytes in any wire dtype), report, leave, resume, a follower
// shard's report of pushes it never got) plus time passing and the server's liveness checks,
// against a real TrainingJob with three workers, the leader of a two-shard job. Whatever
// the order, the server must not crash, and a job that ends ok must have trained on every sample of
// every epoch exactly once.
#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <optional>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/clock.h"
#include "server/training_job.h"

namespace {

class Bytes {
 public:
  Bytes(const uint8_t* data, size_t size) : data_(data), size_(size) {}
  bool empty() const { return pos_ >= size_; }
  uint8_t Next() { return pos_ < size_ ? data_[pos_++] : 0; }
  int Small(int n) { return Next() % n; }  // in [0, n)

 private:
  const uint8_t* data_;
  size_t size_;
  size_t pos_ = 0;
};

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  Bytes in(data, size);
  dbs::FakeClock clock;
  dbs::JobConfig config;
  config.scheduler.expected_workers = 3;
  config.scheduler.epochs = 2;
  config.scheduler.global_batch = 6;
  config.policy = static_cast<dbs::PolicyKind>(in.Small(3));
  config.worker_timeout = absl::Seconds(10);
  config.stall_timeout = absl::Seconds(100);
  // The leader of a two-shard job whose follower has joined, so that a follower's report of
  // pushes it never got (ShardService.ReportMissing) is one of the calls.
  dbs::ShardLog log(2, dbs::TrainingSettings(config), &clock, config.worker_timeout);
  if (!log.Join(1, 2, dbs::TrainingSettings(config)).ok()) std::abort();
  auto job = dbs::TrainingJob::Create(config, &clock);
  if (!job.ok()) std::abort();
  dbs::TrainingJob* j = job->get();
  j->SetShardLog(&log);
  const std::vector<float> grads[] = {{0.5f}, {-1.0f}, {3e38f}, {1e-30f}};
  int ops = 0;
  while (!in.empty() && ++ops < 400) {
    const int worker = in.Small(5) - 1;  // -1 and 3 are not members
    const int epoch = in.Small(4) - 1;
    const int step = in.Small(5) - 1;
    switch (in.Small(10)) {
      case 0:
        (void)j->scheduler()->Register(
            {absl::StrCat("w", in.Small(5)), 10 + in.Small(3), in.Small(4), "cpu"});
        break;
      case 1:
        (void)j->store()->Register({{"w", {1}}}, std::vector<float>{0.0f});
        break;
      case 2:
        j->scheduler()->AwaitPlan(worker, epoch, [](const absl::StatusOr<dbs::WorkerPlan>&) {});
        break;
      case 3:
        j->aggregator()->Push({worker, epoch, step, in.Small(5), 1.0, grads[in.Small(4)]},
                              [](const absl::StatusOr<dbs::StepResult>&) {});
        break;
      case 4: {
        // A gradient as it comes off the wire: 0-5 raw bytes in any wire dtype, cut into two
        // segments anywhere (any bit pattern: NaN, infinities, beyond the limit; of the model's
        // size or not).
        auto bytes = std::make_shared<std::vector<uint8_t>>(in.Small(6));
        for (uint8_t& b : *bytes) b = in.Next();
        auto payload = std::make_shared<dbs::WirePayload>();
        payload->dtype = static_cast<dbs::WireDtype>(in.Small(3));
        const size_t cut = std::min<size_t>(in.Small(6), bytes->size());
        if (cut > 0) payload->segments.emplace_back(bytes->data(), cut);
        if (cut < bytes->size()) {
          payload->segments.emplace_back(bytes->data() + cut, bytes->size() - cut);
        }
        payload->bytes = bytes->size();
        payload->keepalive = bytes;
        std::shared_ptr<const dbs::WirePayload> wire = payload;
        j->aggregator()->Push({worker, epoch, step, in.Small(5), 1.0, wire},
                              [](const absl::StatusOr<dbs::StepResult>&) {});
        break;
      }
      case 5: {
        dbs::EpochTiming t;
        t.worker_id = worker;
        t.epoch = epoch;
        t.samples = in.Small(12);
        t.compute_seconds = in.Small(3);
        t.test_samples = in.Small(3);
        t.test_correct = in.Small(3);
        (void)j->scheduler()->Report(t);
        break;
      }
      case 6:
        (void)j->scheduler()->Leave(worker);
        break;
      case 7: {
        dbs::ParameterSnapshot parameters;
        (void)j->Resume(worker, &parameters);
        break;
      }
      case 8:
        clock.Advance(absl::Seconds(in.Small(30)));
        j->CheckDeadWorkers();
        j->CheckStall();
        (void)j->RemoveMissingAtShard(1, epoch, step, {worker});
        break;
      default:
        (void)j->Run();
        break;
    }
  }
  if (j->WaitFor(absl::ZeroDuration()) && j->Wait().ok()) {
    for (const auto& [e, audit] : j->Run().audits) {
      if (!audit.ok()) std::abort();  // an ok job must have used every sample exactly once
    }
  }
  j->Abort(absl::CancelledError("fuzz input done"));
  return 0;
}
