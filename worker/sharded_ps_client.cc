#include "worker/sharded_ps_client.h"

#include <atomic>
#include <thread>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "common/status_macros.h"

namespace dbs {

ShardedPsClient::ShardedPsClient(std::vector<std::unique_ptr<GrpcPsClient>> shards)
    : shards_(std::move(shards)) {}

absl::Status ShardedPsClient::OnAll(const std::function<absl::Status(size_t)>& call) {
  std::vector<absl::Status> results(shards_.size());
  // The first shard to fail decides the outcome; the others' calls are abandoned rather than
  // waited for. (A follower may hold a push for a step its leader has not logged, while the
  // leader, restarted behind this worker, refused it and waits for this worker to redo the
  // step before: waiting for both would hold the job until the leader declared it dead.)
  std::atomic<int> failed{-1};
  auto run = [&](size_t i) {
    results[i] = call(i);
    int none = -1;
    if (results[i].ok() || !failed.compare_exchange_strong(none, static_cast<int>(i))) return;
    for (size_t j = 0; j < shards_.size(); ++j) {
      if (j != i) shards_[j]->Abandon();
    }
  };
  std::vector<std::thread> others;
  others.reserve(shards_.size() - 1);
  for (size_t i = 1; i < shards_.size(); ++i) others.emplace_back(run, i);
  run(0);
  for (std::thread& t : others) t.join();
  if (failed.load() < 0) return absl::OkStatus();
  for (auto& s : shards_) s->ResumeCalls();
  const size_t i = static_cast<size_t>(failed.load());
  return absl::Status(results[i].code(),
                      absl::StrCat("shard ", i, "/", shards_.size(), ": ", results[i].message()));
}

absl::Status ShardedPsClient::SameVersions(const std::vector<int64_t>& versions) const {
  for (size_t i = 1; i < versions.size(); ++i) {
    if (versions[i] != versions[0]) {
      return absl::AbortedError(absl::StrCat("the shards answered different parameter versions (",
                                             versions[0], " at shard 0, ", versions[i],
                                             " at shard ", i, ")"));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<RegistrationResult> ShardedPsClient::RegisterWorker(const WorkerRegistration& reg) {
  DBS_ASSIGN_OR_RETURN(RegistrationResult r, shards_[0]->RegisterWorker(reg));
  for (size_t i = 1; i < shards_.size(); ++i) {
    shards_[i]->AdoptRegistration(shards_[0]->token(), shards_[0]->wire_dtype());
  }
  return r;
}

absl::Status ShardedPsClient::RegisterModel(int worker_id, const ModelLayout& layout,
                                            absl::Span<const float> initial,
                                            absl::Span<float> params) {
  const size_t total = static_cast<size_t>(TotalElements(layout));
  const int k = static_cast<int>(shards_.size());
  ranges_.clear();
  std::vector<ModelLayout> pieces;
  for (int i = 0; i < k; ++i) {
    ranges_.push_back(ShardRange(total, k, i));
    if (ranges_.back().size() == 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "a model of ", total, " values is too small to split across ", k, " server shards"));
    }
    pieces.push_back(ShardLayout(layout, ranges_.back()));
  }
  return OnAll([&](size_t i) {
    const ValueRange r = ranges_[i];
    return shards_[i]->RegisterModel(worker_id, pieces[i], initial.subspan(r.begin, r.size()),
                                     params.subspan(r.begin, r.size()));
  });
}

absl::StatusOr<int64_t> ShardedPsClient::PullParameters(int worker_id, absl::Span<float> params) {
  if (ranges_.empty()) return absl::FailedPreconditionError("RegisterModel first");
  std::vector<int64_t> versions(shards_.size());
  absl::Status same;
  // While the job steps (a worker joining it), a pull may catch the shards a step apart.
  for (int attempt = 0; attempt < 5; ++attempt) {
    DBS_RETURN_IF_ERROR(OnAll([&](size_t i) -> absl::Status {
      const ValueRange r = ranges_[i];
      DBS_ASSIGN_OR_RETURN(
          versions[i], shards_[i]->PullParameters(worker_id, params.subspan(r.begin, r.size())));
      return absl::OkStatus();
    }));
    same = SameVersions(versions);
    if (same.ok()) return versions[0];
  }
  return same;
}

absl::StatusOr<WorkerPlan> ShardedPsClient::GetEpochPlan(int worker_id, int epoch) {
  return shards_[0]->GetEpochPlan(worker_id, epoch);
}

absl::StatusOr<StepOutcome> ShardedPsClient::PushGradient(int worker_id, int epoch, int step,
                                                          int num_samples, double loss_sum,
                                                          double compute_seconds,
                                                          absl::Span<const float> gradient,
                                                          absl::Span<float> params) {
  if (ranges_.empty()) return absl::FailedPreconditionError("RegisterModel first");
  std::vector<StepOutcome> outcomes(shards_.size());
  DBS_RETURN_IF_ERROR(OnAll([&](size_t i) -> absl::Status {
    const ValueRange r = ranges_[i];
    DBS_ASSIGN_OR_RETURN(
        outcomes[i],
        shards_[i]->PushGradient(worker_id, epoch, step, num_samples, loss_sum, compute_seconds,
                                 gradient.empty() ? gradient : gradient.subspan(r.begin, r.size()),
                                 params.subspan(r.begin, r.size())));
    return absl::OkStatus();
  }));
  std::vector<int64_t> versions;
  for (const StepOutcome& o : outcomes) versions.push_back(o.version);
  DBS_RETURN_IF_ERROR(SameVersions(versions));
  return outcomes[0];
}

absl::Status ShardedPsClient::ReportEpoch(const EpochTiming& timing) {
  return shards_[0]->ReportEpoch(timing);
}

absl::Status ShardedPsClient::Leave(int worker_id) { return shards_[0]->Leave(worker_id); }

absl::StatusOr<ResumePoint> ShardedPsClient::Resume(int worker_id, absl::Span<float> params) {
  if (ranges_.empty()) return absl::FailedPreconditionError("RegisterModel first");
  const ValueRange lead = ranges_[0];
  DBS_ASSIGN_OR_RETURN(ResumePoint rp,
                       shards_[0]->Resume(worker_id, params.subspan(lead.begin, lead.size())));
  DBS_RETURN_IF_ERROR(OnAll([&](size_t i) -> absl::Status {
    if (i == 0) return absl::OkStatus();
    const ValueRange r = ranges_[i];
    return shards_[i]->PullParameters(worker_id, params.subspan(r.begin, r.size())).status();
  }));
  return rp;
}

bool ShardedPsClient::TakeReconnected() {
  bool any = false;
  for (auto& s : shards_) any = s->TakeReconnected() || any;
  return any;
}

void ShardedPsClient::Interrupt() {
  for (auto& s : shards_) s->Interrupt();
}

std::unique_ptr<PsClient> MakePsClient(const GrpcClientConfig& config) {
  const std::vector<std::string> addresses =
      absl::StrSplit(config.address, ',', absl::SkipWhitespace());
  if (addresses.size() <= 1) return std::make_unique<GrpcPsClient>(config);
  std::vector<std::unique_ptr<GrpcPsClient>> shards;
  for (const std::string& a : addresses) {
    GrpcClientConfig c = config;
    c.address = a;
    // A follower shard may hold a push until its leader has done the step the worker redoes,
    // reading the gradient only then: a region rewritten meanwhile would be read torn.
    c.shared_memory = false;
    shards.push_back(std::make_unique<GrpcPsClient>(c));
  }
  return std::make_unique<ShardedPsClient>(std::move(shards));
}

}  // namespace dbs
