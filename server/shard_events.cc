#include "server/shard_events.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/secrets.h"
#include "glog/logging.h"

namespace dbs {

ShardLog::ShardLog(int num_shards, std::map<std::string, std::string> settings, const Clock* clock,
                   absl::Duration rejoin_grace)
    : num_shards_(num_shards),
      settings_(std::move(settings)),
      clock_(clock),
      rejoin_grace_(rejoin_grace) {}

absl::StatusOr<ShardStream> ShardLog::Join(int shard, int num_shards,
                                           const std::map<std::string, std::string>& settings,
                                           std::set<CheckpointAt> checkpoints,
                                           const std::optional<ShardResume>& resume) {
  if (num_shards != num_shards_ || shard < 1 || shard >= num_shards_) {
    return absl::FailedPreconditionError(
        absl::StrCat("this leader runs ", num_shards_, " shards; a follower started as shard ",
                     shard, "/", num_shards, " cannot follow it (followers are 1/", num_shards_,
                     " ... ", num_shards_ - 1, "/", num_shards_, ")"));
  }
  std::vector<std::string> changed;
  for (const auto& [name, mine] : settings_) {
    auto it = settings.find(name);
    const std::string theirs = it == settings.end() ? "(none)" : it->second;
    if (theirs != mine) changed.push_back(absl::StrCat(name, " ", theirs, " (leader: ", mine, ")"));
  }
  if (!changed.empty()) {
    return absl::FailedPreconditionError(
        absl::StrCat("shard ", shard, " was started with other training settings than the leader: ",
                     absl::StrJoin(changed, ", "), "; start every shard with the same flags"));
  }
  std::function<void(int)> on_lost;
  absl::StatusOr<ShardStream> joined;
  {
    absl::MutexLock lock(&mu_);
    bool lose = false;
    joined = resume.has_value() ? ContinueLocked(shard, *resume, &lose) : JoinLocked(shard, &lose);
    if (lose) on_lost = LoseLocked(shard);
    if (joined.ok()) checkpoints_[shard] = std::move(checkpoints);
  }
  if (on_lost) on_lost(shard);
  return joined;
}

namespace {

absl::Status Stopping(const std::string& who) {
  return absl::UnavailableError(
      absl::StrCat("the leader is stopping: it lost a shard; ", who, " can follow its restart"));
}

}  // namespace

absl::StatusOr<ShardStream> ShardLog::ContinueLocked(int shard, const ShardResume& resume,
                                                     bool* lose) {
  const std::string who = absl::StrCat("shard ", shard, "/", num_shards_);
  if (lost_) return Stopping(who);
  auto it = joined_.find(shard);
  if (it == joined_.end()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "this leader holds no place for ", who,
        " (it was restarted?): restart every shard with --restore to continue the job"));
  }
  Follower& f = it->second;
  if (!ConstantTimeEquals(resume.key, f.key)) {
    return absl::PermissionDeniedError(absl::StrCat(
        "only ", who, " itself continues its stream, with the key the stream carried"));
  }
  if (resume.from < base_ || resume.from > base_ + static_cast<int64_t>(events_.size())) {
    *lose = GoneOnLocked() && !ended_;
    return absl::FailedPreconditionError(absl::StrCat("the leader no longer holds event ",
                                                      resume.from, " for ", who, " (it holds ",
                                                      base_, " ... ", base_ + events_.size(), ")"));
  }
  LOG(INFO) << who << " follows again from event " << resume.from
            << (f.away_since.has_value() ? "" : " (its stream had not ended here)");
  f.next = resume.from;
  f.stream = ++streams_;
  f.away_since.reset();
  return ShardStream{f.key, f.next, f.stream};
}

absl::StatusOr<ShardStream> ShardLog::JoinLocked(int shard, bool* lose) {
  const std::string who = absl::StrCat("shard ", shard, "/", num_shards_);
  if (lost_) return Stopping(who);
  auto it = joined_.find(shard);
  if (it != joined_.end() && it->second.away_since.has_value()) {
    // Away, and back without its stream: a restarted process, without this shard's state. It
    // takes its place afresh while the job has not gone on.
    if (GoneOnLocked()) {
      *lose = !ended_;
      return Stopping(who);
    }
    joined_.erase(it);
  } else if (it != joined_.end()) {
    return absl::UnavailableError(absl::StrCat(
        who, " is following already (a restarted follower whose old stream has not ended yet?)"));
  }
  if (GoneOnLocked()) {
    return absl::FailedPreconditionError(
        absl::StrCat(who,
                     " joins too late: workers have registered and the job has gone on "
                     "without it; restart the job"));
  }
  Follower& f = joined_[shard];
  f.key = RandomToken();
  f.stream = ++streams_;
  return ShardStream{f.key, 0, f.stream};
}

std::function<void(int)> ShardLog::LoseLocked(int shard) {
  joined_.erase(shard);
  checkpoints_.erase(shard);
  if (lost_ || ended_ || !GoneOnLocked()) return nullptr;
  lost_ = true;
  return on_lost_;
}

void ShardLog::Part(int shard, int64_t stream) {
  std::function<void(int)> on_lost;
  {
    absl::MutexLock lock(&mu_);
    auto it = joined_.find(shard);
    if (it == joined_.end() || it->second.stream != stream) return;
    if (!ended_ && !lost_) {
      it->second.away_since = clock_->Now();
      LOG(WARNING) << "shard " << shard << "/" << num_shards_
                   << "'s stream ended: the job waits up to " << absl::FormatDuration(rejoin_grace_)
                   << " for it to follow again";
      return;
    }
    on_lost = LoseLocked(shard);
  }
  if (on_lost) on_lost(shard);
}

void ShardLog::CheckAway() {
  std::vector<std::pair<int, std::function<void(int)>>> lost;
  {
    absl::MutexLock lock(&mu_);
    const absl::Time now = clock_->Now();
    std::vector<int> gone;
    for (const auto& [shard, f] : joined_) {
      if (f.away_since.has_value() && now - *f.away_since >= rejoin_grace_) gone.push_back(shard);
    }
    for (int shard : gone) lost.emplace_back(shard, LoseLocked(shard));
  }
  for (auto& [shard, on_lost] : lost) {
    if (on_lost) on_lost(shard);
  }
}

void ShardLog::SetOnLost(std::function<void(int shard)> on_lost) {
  absl::MutexLock lock(&mu_);
  on_lost_ = std::move(on_lost);
}

absl::StatusOr<std::map<int, std::set<CheckpointAt>>> ShardLog::AwaitFollowers(
    absl::Duration timeout) {
  {
    absl::MutexLock lock(&mu_);
    auto all = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      return static_cast<int>(joined_.size()) == num_shards_ - 1;
    };
    if (mu_.AwaitWithTimeout(absl::Condition(&all), timeout)) return checkpoints_;
  }
  absl::Status missing = Admit();
  if (!missing.ok()) return missing;
  absl::MutexLock lock(&mu_);  // every follower joined just after the wait ended
  return checkpoints_;
}

bool ShardLog::Vouches(int shard, absl::string_view key) const {
  absl::MutexLock lock(&mu_);
  auto it = joined_.find(shard);
  return it != joined_.end() && !it->second.away_since.has_value() && !key.empty() &&
         ConstantTimeEquals(key, it->second.key);
}

absl::Status ShardLog::Admit() const {
  absl::MutexLock lock(&mu_);
  std::vector<int> missing;
  for (int s = 1; s < num_shards_; ++s) {
    auto it = joined_.find(s);
    if (it == joined_.end() || it->second.away_since.has_value()) missing.push_back(s);
  }
  if (missing.empty()) return absl::OkStatus();
  return absl::UnavailableError(absl::StrCat("waiting for shard(s) ", absl::StrJoin(missing, ", "),
                                             " of ", num_shards_, " to connect (dbs_ps --shard=i/",
                                             num_shards_, " --leader=...)"));
}

void ShardLog::Append(ShardEventData event) {
  std::vector<std::function<void()>> wake;
  {
    absl::MutexLock lock(&mu_);
    if (event.kind == ShardEventData::Kind::kWorker) workers_seen_ = true;
    if (event.kind == ShardEventData::Kind::kEnd) ended_ = true;
    appended_ = true;
    events_.push_back(std::move(event));
    wake.swap(wakers_);
  }
  for (auto& w : wake) w();
}

void ShardLog::Seed(std::vector<ShardEventData> events) {
  std::vector<std::function<void()>> wake;
  {
    absl::MutexLock lock(&mu_);
    for (ShardEventData& e : events) events_.push_back(std::move(e));
    wake.swap(wakers_);
  }
  for (auto& w : wake) w();
}

void ShardLog::SeedFresh() {
  {
    absl::MutexLock lock(&mu_);
    if (!events_.empty() || base_ > 0) return;
  }
  ShardEventData fresh;
  fresh.kind = ShardEventData::Kind::kResume;
  fresh.version = -1;
  Seed({fresh});
}

void ShardLog::TrimLocked() {
  // Until every follower has joined, each must still read the log from its start; so must one
  // that parts and joins again before the job goes on (what was seeded is a few events).
  if (static_cast<int>(joined_.size()) < num_shards_ - 1 || !GoneOnLocked()) return;
  int64_t low = joined_.begin()->second.next;
  for (const auto& [shard, f] : joined_) low = std::min(low, f.next);
  while (base_ < low - kKeptForResume && !events_.empty()) {
    events_.pop_front();
    ++base_;
  }
}

bool ShardLog::Next(int shard, int64_t stream, int64_t next, ShardEventData* out,
                    std::function<void()> wake) {
  absl::MutexLock lock(&mu_);
  auto it = joined_.find(shard);
  if (it == joined_.end() || it->second.stream != stream) {
    out->kind = ShardEventData::Kind::kEnd;
    out->status = absl::CancelledError("this shard follows on a newer stream");
    return true;
  }
  it->second.next = std::max(it->second.next, next);
  TrimLocked();
  if (next < base_) {  // cannot happen: a follower reads in order
    out->kind = ShardEventData::Kind::kEnd;
    out->status = absl::DataLossError("the leader no longer holds the events this shard needs");
    return true;
  }
  const int64_t i = next - base_;
  if (i < static_cast<int64_t>(events_.size())) {
    *out = events_[static_cast<size_t>(i)];
    return true;
  }
  wakers_.push_back(std::move(wake));
  return false;
}

ShardFollower::ShardFollower(StepAggregator* aggregator, absl::Duration wait)
    : aggregator_(aggregator), wait_(wait) {}

void ShardFollower::Apply(const ShardEventData& e) {
  ApplyEvent(e);
  if (first_) {
    std::function<void()> first = std::move(first_);
    first_ = nullptr;
    first();
  }
}

void ShardFollower::ApplyEvent(const ShardEventData& e) {
  switch (e.kind) {
    case ShardEventData::Kind::kWorker: {
      absl::MutexLock lock(&mu_);
      tokens_[e.worker_id] = e.token;
      identities_[e.worker_id] = e.identity;
      return;
    }
    case ShardEventData::Kind::kEpoch: {
      aggregator_->BeginEpoch(e.epoch, e.quotas);
      absl::MutexLock lock(&mu_);
      epoch_ = e.epoch;
      done_ = 0;
      awaiting_checkpoint_ = e.checkpoint;
      return;
    }
    case ShardEventData::Kind::kStep:
      ApplyStep(e);
      return;
    case ShardEventData::Kind::kCheckpoint: {
      if (e.checkpoint) SaveNow(e.epoch);
      absl::MutexLock lock(&mu_);
      awaiting_checkpoint_ = false;
      return;
    }
    case ShardEventData::Kind::kResume:
      ApplyResume(e);
      return;
    case ShardEventData::Kind::kEnd:
      if (!e.status.ok()) aggregator_->Abort(e.status);
      absl::MutexLock lock(&mu_);
      ended_ = true;
      end_ = e.status;
      return;
  }
}

void ShardFollower::ApplyStep(const ShardEventData& e) {
  const bool evicted = !e.dead.empty() && EvictDead(e);
  if (!evicted && (e.changed || !e.dead.empty()) &&
      !aggregator_->ReviseFrom(e.epoch, e.step, e.quotas)) {
    LOG(ERROR) << "shard follower: could not apply the leader's re-plan at epoch " << e.epoch
               << " step " << e.step;
  }
  if (e.checkpoint) SaveAfter(e.epoch, e.step);
  absl::MutexLock lock(&mu_);
  // An eviction comes before the step completes on the leader (a later event says so).
  if (e.epoch == epoch_) done_ = std::max(done_, e.dead.empty() ? e.step + 1 : e.step);
}

bool ShardFollower::EvictDead(const ShardEventData& e) {
  // The leader removed workers that missed its step `e.step`. Those that did push it here stay
  // in this shard's step (their values arrived; nothing accepted is lost); the others are
  // evicted as the leader evicted them, and the step completes once the survivors have pushed.
  // A step before it (a shard's step that pushes the leader had never reached: MissingPushes)
  // completes without them at once, and the next expects the leader's survivors.
  const absl::Time deadline = absl::Now() + wait_;
  int refused = 0;  // an eviction refused with nobody's push in between: the job is over
  while (true) {
    const StepProgress p = aggregator_->Progress();
    if (p.epoch != e.epoch || p.step > e.step || p.step + 1 < e.step) return false;
    std::set<int> missing;
    for (int id : p.waiting_for) {
      if (e.dead.count(id) > 0) missing.insert(id);
    }
    if (p.step == e.step) {
      if (missing.empty()) return false;
      if (aggregator_->Evict(e.epoch, e.step, missing)) {
        aggregator_->CompleteEviction(PlanChange{e.quotas, {}});
        return true;
      }
    } else if (!missing.empty()) {
      StepQuotas later;
      std::map<int, int> next = aggregator_->Quota(e.epoch, e.step);
      if (!next.empty()) {
        for (int id : e.dead) next.erase(id);
        later.push_back(std::move(next));
      }
      later.insert(later.end(), e.quotas.begin(), e.quotas.end());
      if (aggregator_->Evict(p.epoch, p.step, missing)) {
        LOG(WARNING) << "worker(s) " << absl::StrJoin(missing, ", ") << " pushed step "
                     << p.step + 1 << " of epoch " << p.epoch + 1
                     << " to the leader but never here: removed; this shard's range steps "
                        "without their gradient";
        aggregator_->CompleteEviction(PlanChange{std::move(later), {}});
        return true;
      }
    }
    // A push arrived meanwhile: the step completes (or the eviction is retried).
    if (!missing.empty() && ++refused >= 3) return false;
    if (absl::Now() > deadline) return false;
    absl::SleepFor(absl::Milliseconds(1));
  }
}

std::optional<MissingPushes> ShardFollower::Missing(LivenessMonitor* liveness) {
  const StepProgress p = aggregator_->Progress();
  bool leader_done = false;
  {
    absl::MutexLock lock(&mu_);
    leader_done =
        !ended_ && p.epoch >= 0 && p.epoch == epoch_ && p.step < done_ && p.step < p.num_steps;
  }
  // The clock starts when this check first sees the leader past the step with pushes here.
  const std::set<int> late = liveness->Overdue(
      leader_done ? StepWait{p.epoch, p.step, p.pushed, p.waiting_for} : StepWait{});
  if (late.empty()) return std::nullopt;
  return MissingPushes{p.epoch, p.step, late};
}

void ShardFollower::SaveAfter(int epoch, int step) {
  if (!save_) return;
  // The leader checkpointed after this step; this shard's barrier completes it once the step's
  // last pushes reach it (nobody can push the next step before this event is applied).
  const absl::Time deadline = absl::Now() + wait_;
  while (true) {
    const StepProgress p = aggregator_->Progress();
    if (p.epoch > epoch || (p.epoch == epoch && p.step > step)) break;
    if (absl::Now() > deadline) {
      LOG(ERROR) << "shard follower: step " << step << " of epoch " << epoch
                 << " did not complete here within " << absl::FormatDuration(wait_)
                 << ": no checkpoint of it";
      return;
    }
    absl::SleepFor(absl::Milliseconds(1));
  }
  SaveNow(epoch);
}

void ShardFollower::SaveNow(int epoch) {
  if (!save_) return;
  const absl::Status saved = save_();
  if (!saved.ok()) LOG(ERROR) << "shard checkpoint (epoch " << epoch << ") failed: " << saved;
}

void ShardFollower::ApplyResume(const ShardEventData& e) {
  if (e.version < 0) return;  // a new job: nothing to restore
  const absl::Status restored =
      restore_ ? restore_(e.version, e.epoch, e.step, e.quotas)
               : absl::FailedPreconditionError(
                     "start this shard with --restore and its own --checkpoint_dir");
  if (!restored.ok()) {
    Lost(absl::FailedPreconditionError(absl::StrCat(
        "the leader continues from its checkpoint of parameter version ", e.version, " (epoch ",
        e.epoch + 1, ", step ", e.step + 1, "); this shard cannot: ", restored.message())));
    return;
  }
  absl::MutexLock lock(&mu_);
  epoch_ = e.epoch;
  done_ = e.step;
}

void ShardFollower::Lost(const absl::Status& why) {
  aggregator_->Abort(why);
  absl::MutexLock lock(&mu_);
  if (!ended_) {
    ended_ = true;
    end_ = why;
  }
}

absl::Status ShardFollower::Gate(int epoch, int step) {
  // A push can overtake the leader's log only by a hop: its worker has this shard's answer to
  // the step before. One for a step this shard's barrier has not reached (a worker that went
  // on while the job restarted from a checkpoint) is not waited for: the barrier refuses it,
  // and the worker resumes from where the job stands.
  const StepProgress p = aggregator_->Progress();
  const bool reached = p.epoch == epoch
                           ? p.step >= step
                           : p.epoch == epoch - 1 && step == 0 && p.step >= p.num_steps;
  if (!reached) return absl::OkStatus();
  absl::MutexLock lock(&mu_);
  auto open = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (ended_ || epoch < epoch_) return true;
    if (epoch == epoch_ && awaiting_checkpoint_) return false;
    if (epoch == epoch_) return step <= done_ || step > done_ + 1;  // too far ahead: refused later
    return epoch > epoch_ + 1 || step > 0;
  };
  if (open()) return end_;
  // Not waited for here: a gRPC callback thread never blocks on the leader (a few such calls
  // would hold every other call). The worker retries, as for any UNAVAILABLE.
  return absl::UnavailableError(absl::StrCat(
      "this shard has not yet heard from the leader that epoch ", epoch, " step ", step,
      " may begin (it is at epoch ", epoch_, ", ", done_, " steps done); retry"));
}

absl::Status ShardFollower::Authenticate(int worker_id, absl::string_view token,
                                         absl::string_view identity) {
  if (token.empty()) {
    return absl::UnauthenticatedError("the call carries no worker token (x-dbs-token)");
  }
  absl::MutexLock lock(&mu_);
  auto known = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return ended_ || tokens_.count(worker_id) > 0;
  };
  // An id the leader may be about to announce is answered UNAVAILABLE at once, which the
  // worker retries: nothing waits on a gRPC callback thread. With the leader's key, a token it
  // did not sign for that id is refused for good.
  const bool plausible = worker_id >= 0 && worker_id <= static_cast<int>(tokens_.size()) + 64;
  if (plausible && !known() && !token_key_.empty() &&
      !IsIssuedWorkerToken(token_key_, worker_id, token)) {
    return absl::PermissionDeniedError(
        absl::StrCat("the token was not issued to worker ", worker_id, " by this job's server"));
  }
  auto it = tokens_.find(worker_id);
  if (it == tokens_.end()) {
    return plausible
               ? absl::UnavailableError(absl::StrCat("worker ", worker_id,
                                                     " is not known to this shard yet (the leader "
                                                     "has not announced it)"))
               : absl::NotFoundError(absl::StrCat("unknown worker ", worker_id));
  }
  if (!ConstantTimeEquals(token, it->second)) {
    return absl::PermissionDeniedError(
        absl::StrCat("the token does not belong to worker ", worker_id));
  }
  return CheckIdentity(worker_id, identities_[worker_id], identity);
}

void ShardFollower::SetTokenKey(std::string key) {
  absl::MutexLock lock(&mu_);
  token_key_ = std::move(key);
}

absl::Status ShardFollower::Wait() {
  absl::MutexLock lock(&mu_);
  mu_.Await(absl::Condition(&ended_));
  return end_;
}

bool ShardFollower::WaitFor(absl::Duration timeout) {
  absl::MutexLock lock(&mu_);
  return mu_.AwaitWithTimeout(absl::Condition(&ended_), timeout);
}

}  // namespace dbs
