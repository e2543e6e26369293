#include "server/checkpoint.h"

#include <dirent.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zlib.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <sstream>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "common/files.h"
#include "common/plan_codec.h"
#include "common/status_macros.h"
#include "common/tensor_codec.h"
#include "proto/checkpoint.pb.h"

namespace dbs {
namespace {

namespace ckpt = checkpoint::v2;

constexpr char kMagic[] = "DBSCKPT2";
constexpr char kOldMagicPrefix[] = "DBSCKPT";
constexpr size_t kMagicLen = 8;
constexpr size_t kFramingLen = kMagicLen + 8 + 4;  // magic, length, CRC-32

absl::Status Corrupt(const std::string& why) {
  return absl::DataLossError(absl::StrCat("corrupt checkpoint: ", why));
}

void PutU64(std::string* out, uint64_t v) {
  for (int i = 0; i < 8; ++i) out->push_back(static_cast<char>(v >> (8 * i)));
}

uint64_t GetU64(const std::string& in, size_t at) {
  uint64_t v = 0;
  for (int i = 7; i >= 0; --i) v = (v << 8) | static_cast<unsigned char>(in[at + i]);
  return v;
}

uint32_t Crc32(const std::string& bytes, size_t n) {
  return static_cast<uint32_t>(
      crc32(0L, reinterpret_cast<const Bytef*>(bytes.data()), static_cast<uInt>(n)));
}

// A flat float vector as one tensor of shape [n].
void PutFlat(const std::string& name, const std::vector<float>& v, TensorList* out) {
  EncodeTensors({{name, {static_cast<int64_t>(v.size())}}}, v, out);
}

void EpochToProto(const EpochRecord& r, ckpt::Epoch* out) {
  out->set_epoch(r.epoch);
  out->set_start_unix_nanos(absl::ToUnixNanos(r.start));
  out->set_end_unix_nanos(absl::ToUnixNanos(r.end));
  out->set_num_steps(r.num_steps);
  out->set_revision(r.revision);
  out->set_complete(r.complete);
  for (int d : r.dead) out->add_dead(d);
  for (const auto& [id, plan] : r.plans) ToProto(plan, &(*out->mutable_plans())[id]);
  for (const auto& [id, steps] : r.layout) {
    PlanRevision layout;
    layout.epoch = r.epoch;
    layout.num_steps = static_cast<int>(steps.size());
    layout.steps = steps;
    ToProto(layout, &(*out->mutable_layouts())[id]);
  }
  for (const auto& [id, t] : r.reports) ToProto(t, &(*out->mutable_reports())[id]);
  for (const auto& [id, by_batch] : r.step_times) {
    ckpt::StepTimes& times = (*out->mutable_step_times())[id];
    for (const auto& [batch, t] : by_batch) {
      ckpt::StepTimes::AtBatch* at = times.add_at();
      at->set_batch(batch);
      at->set_steps(t.steps);
      at->set_seconds(t.seconds);
      at->set_square_seconds(t.square_seconds);
    }
  }
}

EpochRecord EpochFromProto(const ckpt::Epoch& m) {
  EpochRecord r;
  r.epoch = m.epoch();
  r.start = absl::FromUnixNanos(m.start_unix_nanos());
  r.end = absl::FromUnixNanos(m.end_unix_nanos());
  r.num_steps = m.num_steps();
  r.revision = m.revision();
  r.complete = m.complete();
  r.dead.insert(m.dead().begin(), m.dead().end());
  for (const auto& [id, plan] : m.plans()) r.plans[id] = FromProto(plan);
  for (const auto& [id, layout] : m.layouts()) r.layout[id] = FromProto(layout).steps;
  for (const auto& [id, report] : m.reports()) r.reports[id] = FromProto(report);
  for (const auto& [id, times] : m.step_times()) {
    for (const ckpt::StepTimes::AtBatch& at : times.at()) {
      r.step_times[id][at.batch()] = {at.steps(), at.seconds(), at.square_seconds()};
    }
  }
  return r;
}

void BarrierToProto(const StepAggregator::State& ag, ckpt::Barrier* out) {
  out->set_epoch(ag.epoch);
  out->set_step(ag.step);
  for (const auto& [epoch, l] : ag.losses) {
    ckpt::Barrier::Loss& loss = (*out->mutable_losses())[epoch];
    loss.set_loss_sum(l.loss_sum);
    loss.set_samples(l.samples);
    loss.set_steps_completed(l.steps_completed);
  }
  for (const auto& [worker, step] : ag.accepted) {
    ckpt::Barrier::Push* push = out->add_accepted();
    push->set_worker_id(worker);
    push->set_step(step);
  }
}

void BarrierFromProto(const ckpt::Barrier& m, StepAggregator::State* ag) {
  ag->epoch = m.epoch();
  ag->step = m.step();
  for (const auto& [epoch, l] : m.losses()) {
    ag->losses[epoch] = {l.loss_sum(), l.samples(), l.steps_completed()};
  }
  for (const ckpt::Barrier::Push& p : m.accepted()) ag->accepted.insert({p.worker_id(), p.step()});
}

void StoreToProto(const StoreState& st, ckpt::Store* out) {
  EncodeTensors(st.layout, st.values, out->mutable_parameters());
  out->set_version(st.version);
  out->set_optimizer(st.optimizer.kind);
  out->set_optimizer_steps(st.optimizer.steps);
  for (size_t i = 0; i < st.optimizer.buffers.size(); ++i) {
    PutFlat(absl::StrCat("buffer", i), st.optimizer.buffers[i], out->mutable_optimizer_buffers());
  }
}

absl::Status StoreFromProto(const ckpt::Store& m, StoreState* st) {
  if (m.parameters_size() > 0) {
    DBS_ASSIGN_OR_RETURN(st->layout, LayoutOf(m.parameters()));
    st->values.resize(static_cast<size_t>(TotalElements(st->layout)));
    DBS_RETURN_IF_ERROR(
        DecodeTensors(m.parameters(), st->layout, false, absl::MakeSpan(st->values)));
  }
  st->version = m.version();
  st->optimizer.kind = m.optimizer();
  st->optimizer.steps = m.optimizer_steps();
  for (int i = 0; i < m.optimizer_buffers_size(); ++i) {
    const TensorList one(m.optimizer_buffers().begin() + i, m.optimizer_buffers().begin() + i + 1);
    DBS_ASSIGN_OR_RETURN(ModelLayout layout, LayoutOf(one));
    std::vector<float>& buffer =
        st->optimizer.buffers.emplace_back(static_cast<size_t>(TotalElements(layout)));
    DBS_RETURN_IF_ERROR(DecodeTensors(one, layout, false, absl::MakeSpan(buffer)));
  }
  return absl::OkStatus();
}

ckpt::Checkpoint CheckpointOf(const JobState& st) {
  ckpt::Checkpoint m;
  ckpt::JobSettings* settings = m.mutable_settings();
  settings->set_workers(st.config.expected_workers);
  settings->set_epochs(st.config.epochs);
  settings->set_global_batch(st.config.global_batch);
  settings->set_seed(st.config.seed);
  settings->set_policy(st.policy);
  settings->mutable_training()->insert(st.settings.begin(), st.settings.end());
  for (size_t i = 0; i < st.scheduler.workers.size(); ++i) {
    ckpt::Member* member = m.add_members();
    ToProto(st.scheduler.workers[i], member->mutable_registration());
    member->set_left(i < st.scheduler.left.size() && st.scheduler.left[i]);
    if (i < st.scheduler.tokens.size()) member->set_token(st.scheduler.tokens[i]);
    member->set_source(st.scheduler.workers[i].source);
    member->set_identity(st.scheduler.workers[i].identity);
  }
  m.set_finished(st.scheduler.finished);
  for (const EpochRecord& r : st.scheduler.records) EpochToProto(r, m.add_epochs());
  BarrierToProto(st.aggregator, m.mutable_barrier());
  StoreToProto(st.aggregator.store, m.mutable_store());
  for (const auto& [epoch, a] : st.audits) {
    ckpt::Audit& audit = (*m.mutable_audits())[epoch];
    audit.set_samples(a.samples);
    audit.set_used_once(a.used_once);
    audit.set_missing(a.missing);
    audit.set_duplicated(a.duplicated);
  }
  return m;
}

absl::StatusOr<JobState> JobStateOf(const ckpt::Checkpoint& m) {
  JobState st;
  st.config.expected_workers = m.settings().workers();
  st.config.epochs = m.settings().epochs();
  st.config.global_batch = m.settings().global_batch();
  st.config.seed = m.settings().seed();
  st.policy = m.settings().policy();
  st.settings.insert(m.settings().training().begin(), m.settings().training().end());
  for (const ckpt::Member& member : m.members()) {
    st.scheduler.workers.push_back(FromProto(member.registration()));
    st.scheduler.workers.back().source = member.source();
    st.scheduler.workers.back().identity = member.identity();
    st.scheduler.left.push_back(member.left());
    st.scheduler.tokens.push_back(member.token());
  }
  st.scheduler.finished = m.finished();
  for (const ckpt::Epoch& e : m.epochs()) st.scheduler.records.push_back(EpochFromProto(e));
  BarrierFromProto(m.barrier(), &st.aggregator);
  absl::Status store = StoreFromProto(m.store(), &st.aggregator.store);
  if (!store.ok()) return Corrupt(absl::StrCat("parameters: ", store.message()));
  for (const auto& [epoch, a] : m.audits()) {
    st.audits[epoch] = {a.samples(), a.used_once(), a.missing(), a.duplicated()};
  }
  return st;
}

}  // namespace

std::string EncodeCheckpoint(const JobState& state) {
  std::string body;
  CheckpointOf(state).SerializeToString(&body);
  std::string out(kMagic, kMagicLen);
  PutU64(&out, body.size());
  out += body;
  const uint32_t crc = Crc32(out, out.size());
  for (int i = 0; i < 4; ++i) out.push_back(static_cast<char>(crc >> (8 * i)));
  return out;
}

absl::StatusOr<JobState> DecodeCheckpoint(const std::string& in) {
  if (in.compare(0, kMagicLen, kMagic) != 0) {
    if (in.size() >= kMagicLen && in.compare(0, kMagicLen - 1, kOldMagicPrefix) == 0) {
      return absl::FailedPreconditionError(absl::StrCat(
          "checkpoint format ", in.substr(kMagicLen - 1, 1), " was written by an older dbs; ",
          "this one reads format 2 only. Finish that job with the dbs that wrote it, or start "
          "the job again without restoring"));
    }
    return Corrupt("not a dbs checkpoint (bad magic)");
  }
  if (in.size() < kFramingLen) return Corrupt("too short");
  uint32_t stored = 0;
  for (int i = 3; i >= 0; --i) {
    stored = (stored << 8) | static_cast<unsigned char>(in[in.size() - 4 + i]);
  }
  if (stored != Crc32(in, in.size() - 4))
    return Corrupt("checksum mismatch (truncated or altered)");
  if (GetU64(in, kMagicLen) != in.size() - kFramingLen) return Corrupt("bad length");
  ckpt::Checkpoint m;
  if (!m.ParseFromArray(in.data() + kMagicLen + 8, static_cast<int>(in.size() - kFramingLen))) {
    return Corrupt("unreadable contents");
  }
  return JobStateOf(m);
}

namespace {

// ckpt-<seq>.dbs files in `dir`, newest (highest seq) first.
std::vector<std::pair<int64_t, std::string>> ListCheckpoints(const std::string& dir) {
  std::vector<std::pair<int64_t, std::string>> out;
  DIR* d = opendir(dir.c_str());
  if (d == nullptr) return out;
  while (dirent* e = readdir(d)) {
    const std::string name = e->d_name;
    int64_t seq;
    if (absl::StartsWith(name, "ckpt-") && absl::EndsWith(name, ".dbs") &&
        absl::SimpleAtoi(name.substr(5, name.size() - 9), &seq)) {
      out.push_back({seq, dir + "/" + name});
    }
  }
  closedir(d);
  std::sort(out.rbegin(), out.rend());
  return out;
}

// Temporaries of checkpoints that another process (a dbs_ps killed while writing) left in `dir`:
// ckpt-<seq>.dbs.tmp.<pid>.<n> with a pid other than ours.
std::vector<std::string> LeftoverTemporaries(const std::string& dir) {
  std::vector<std::string> out;
  DIR* d = opendir(dir.c_str());
  if (d == nullptr) return out;
  const std::string ours = absl::StrCat(".dbs.tmp.", getpid(), ".");
  while (dirent* e = readdir(d)) {
    const std::string name = e->d_name;
    if (absl::StartsWith(name, "ckpt-") && absl::StrContains(name, ".dbs.tmp.") &&
        !absl::StrContains(name, ours)) {
      out.push_back(dir + "/" + name);
    }
  }
  closedir(d);
  return out;
}

}  // namespace

absl::StatusOr<std::string> WriteCheckpoint(const std::string& dir, const JobState& state,
                                            int keep) {
  mkdir(dir.c_str(), 0755);
  const auto existing = ListCheckpoints(dir);
  const int64_t seq = existing.empty() ? 1 : existing.front().first + 1;
  const std::string path = absl::StrCat(dir, "/ckpt-", seq, ".dbs");
  for (const std::string& leftover : LeftoverTemporaries(dir)) std::remove(leftover.c_str());
  DBS_RETURN_IF_ERROR(WriteFileAtomic(path, EncodeCheckpoint(state)));
  for (size_t i = static_cast<size_t>(std::max(0, keep - 1)); i < existing.size(); ++i) {
    std::remove(existing[i].second.c_str());
  }
  return path;
}

absl::StatusOr<JobState> LoadNewestCheckpoint(const std::string& dir,
                                              std::vector<std::string>* refused, std::string* path,
                                              const std::function<bool(const JobState&)>& wanted) {
  for (const auto& [seq, file] : ListCheckpoints(dir)) {
    std::ifstream f(file, std::ios::binary);
    std::stringstream buf;
    buf << f.rdbuf();
    absl::StatusOr<JobState> st = DecodeCheckpoint(buf.str());
    if (st.ok() && (!wanted || wanted(*st))) {
      if (path != nullptr) *path = file;
      return st;
    }
    if (!st.ok() && refused != nullptr) {
      refused->push_back(absl::StrCat(file, ": ", st.status().message()));
    }
  }
  return absl::NotFoundError(
      absl::StrCat("no valid checkpoint", wanted ? " of that step" : "", " in ", dir));
}

namespace {

std::string FinishedRecordPath(const std::string& dir) {
  return absl::StrCat(dir, "/", kFinishedRecord);
}

}  // namespace

absl::Status WriteFinishedRecord(const std::string& dir, const std::string& record) {
  return WriteFileAtomic(FinishedRecordPath(dir), record);
}

absl::StatusOr<std::string> ReadFinishedRecord(const std::string& dir) {
  const std::string path = FinishedRecordPath(dir);
  struct stat st;
  if (stat(path.c_str(), &st) != 0) {
    return absl::NotFoundError(absl::StrCat("no ", path));
  }
  return ReadFile(path);
}

absl::Status RemoveFinishedRecord(const std::string& dir) {
  const std::string path = FinishedRecordPath(dir);
  if (std::remove(path.c_str()) != 0 && errno != ENOENT) {
    return absl::PermissionDeniedError(
        absl::StrCat("cannot remove ", path, ": ", std::strerror(errno)));
  }
  return absl::OkStatus();
}

}  // namespace dbs
