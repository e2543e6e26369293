#include "server/checkpoint.h"

#include <dirent.h>
#include <sys/stat.h>
#include <zlib.h>

#include <algorithm>
#include <cstring>
#include <fstream>
#include <sstream>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/match.h"
#include "common/files.h"
#include "common/status_macros.h"
#include "nlohmann/json.hpp"

namespace dbs {
namespace {

using nlohmann::json;
constexpr char kMagic[] = "DBSCKPT1";
constexpr size_t kMagicLen = 8;

json Ranges(const std::vector<SampleRange>& rs) {
  json a = json::array();
  for (const SampleRange& r : rs) a.push_back(json::array({r.begin, r.end}));
  return a;
}

std::vector<SampleRange> RangesFrom(const json& a) {
  std::vector<SampleRange> out;
  for (const json& r : a) out.push_back({r.at(0).get<int64_t>(), r.at(1).get<int64_t>()});
  return out;
}

json PlanJson(const WorkerPlan& p) {
  return {{"epoch", p.epoch},          {"batch_size", p.batch_size},
          {"final_batch_size", p.final_batch_size}, {"num_steps", p.num_steps},
          {"global_batch", p.global_batch}, {"seed", p.permutation_seed},
          {"train", Ranges(p.train_ranges)}, {"test", json::array({p.test_range.begin, p.test_range.end})},
          {"share", p.share},          {"total_epochs", p.total_epochs}};
}

WorkerPlan PlanFrom(const json& j) {
  WorkerPlan p;
  p.epoch = j.at("epoch");
  p.batch_size = j.at("batch_size");
  p.final_batch_size = j.at("final_batch_size");
  p.num_steps = j.at("num_steps");
  p.global_batch = j.at("global_batch");
  p.permutation_seed = j.at("seed");
  p.train_ranges = RangesFrom(j.at("train"));
  p.test_range = {j.at("test").at(0).get<int64_t>(), j.at("test").at(1).get<int64_t>()};
  p.share = j.at("share");
  p.total_epochs = j.at("total_epochs");
  return p;
}

json TimingJson(const EpochTiming& t) {
  return json::array({t.worker_id, t.epoch, t.samples, t.compute_seconds, t.wait_seconds,
                      t.eval_seconds, t.test_samples, t.test_correct, t.test_loss_sum});
}

EpochTiming TimingFrom(const json& j) {
  EpochTiming t;
  t.worker_id = j.at(0);
  t.epoch = j.at(1);
  t.samples = j.at(2);
  t.compute_seconds = j.at(3);
  t.wait_seconds = j.at(4);
  t.eval_seconds = j.at(5);
  t.test_samples = j.at(6);
  t.test_correct = j.at(7);
  t.test_loss_sum = j.at(8);
  return t;
}

void PutU64(std::string* out, uint64_t v) {
  for (int i = 0; i < 8; ++i) out->push_back(static_cast<char>(v >> (8 * i)));
}

uint64_t GetU64(const std::string& in, size_t at) {
  uint64_t v = 0;
  for (int i = 7; i >= 0; --i) v = (v << 8) | static_cast<unsigned char>(in[at + i]);
  return v;
}

absl::Status Corrupt(const std::string& why) {
  return absl::DataLossError(absl::StrCat("corrupt checkpoint: ", why));
}

}  // namespace

std::string EncodeCheckpoint(const JobState& st) {
  json meta;
  meta["format"] = 1;
  meta["config"] = {{"workers", st.config.expected_workers}, {"epochs", st.config.epochs},
                    {"global_batch", st.config.global_batch}, {"seed", st.config.seed},
                    {"policy", st.policy}};
  json workers = json::array();
  for (size_t i = 0; i < st.scheduler.workers.size(); ++i) {
    const WorkerRegistration& w = st.scheduler.workers[i];
    workers.push_back(json::array({w.name, w.train_samples, w.test_samples, w.device,
                                   i < st.scheduler.left.size() && st.scheduler.left[i],
                                   w.max_batch}));
  }
  meta["workers"] = workers;
  meta["finished"] = st.scheduler.finished;
  json records = json::array();
  for (const EpochRecord& r : st.scheduler.records) {
    json rec;
    rec["epoch"] = r.epoch;
    rec["start"] = absl::ToUnixNanos(r.start);
    rec["end"] = absl::ToUnixNanos(r.end);
    rec["num_steps"] = r.num_steps;
    rec["revision"] = r.revision;
    rec["complete"] = r.complete;
    rec["dead"] = std::vector<int>(r.dead.begin(), r.dead.end());
    json plans = json::object(), layout = json::object(), reports = json::object();
    for (const auto& [id, p] : r.plans) plans[std::to_string(id)] = PlanJson(p);
    for (const auto& [id, steps] : r.layout) {
      json a = json::array();
      for (const auto& step : steps) a.push_back(Ranges(step));
      layout[std::to_string(id)] = a;
    }
    for (const auto& [id, t] : r.reports) reports[std::to_string(id)] = TimingJson(t);
    json step_times = json::object();
    for (const auto& [id, by_batch] : r.step_times) {
      json a = json::array();
      for (const auto& [batch, t] : by_batch) a.push_back(json::array({batch, t.steps, t.seconds}));
      step_times[std::to_string(id)] = a;
    }
    rec["plans"] = plans;
    rec["layout"] = layout;
    rec["reports"] = reports;
    rec["step_times"] = step_times;
    records.push_back(rec);
  }
  meta["records"] = records;
  const StepAggregator::State& ag = st.aggregator;
  json losses = json::object();
  for (const auto& [e, l] : ag.losses) {
    losses[std::to_string(e)] = json::array({l.loss_sum, l.samples, l.steps_completed});
  }
  json accepted = json::array();
  for (const auto& [w, s] : ag.accepted) accepted.push_back(json::array({w, s}));
  json layout = json::array();
  for (const TensorSpec& t : ag.store.layout) layout.push_back(json::array({t.name, t.shape}));
  std::vector<size_t> buffer_sizes;
  for (const auto& b : ag.store.optimizer.buffers) buffer_sizes.push_back(b.size());
  meta["barrier"] = {{"epoch", ag.epoch}, {"step", ag.step}, {"losses", losses},
                     {"accepted", accepted}};
  meta["store"] = {{"layout", layout}, {"version", ag.store.version},
                   {"optimizer", ag.store.optimizer.kind},
                   {"optimizer_steps", ag.store.optimizer.steps},
                   {"buffers", buffer_sizes}};
  json audits = json::object();
  for (const auto& [e, a] : st.audits) {
    audits[std::to_string(e)] = json::array({a.samples, a.used_once, a.missing, a.duplicated});
  }
  meta["audits"] = audits;

  const std::string text = meta.dump();
  std::string out(kMagic, kMagicLen);
  PutU64(&out, text.size());
  out += text;
  uint64_t floats = ag.store.values.size();
  for (const auto& b : ag.store.optimizer.buffers) floats += b.size();
  PutU64(&out, floats);
  auto append = [&out](const std::vector<float>& v) {
    out.append(reinterpret_cast<const char*>(v.data()), v.size() * sizeof(float));
  };
  append(ag.store.values);
  for (const auto& b : ag.store.optimizer.buffers) append(b);
  const uint32_t crc = static_cast<uint32_t>(
      crc32(0L, reinterpret_cast<const Bytef*>(out.data()), static_cast<uInt>(out.size())));
  for (int i = 0; i < 4; ++i) out.push_back(static_cast<char>(crc >> (8 * i)));
  return out;
}

absl::StatusOr<JobState> DecodeCheckpoint(const std::string& in) {
  if (in.size() < kMagicLen + 8 + 8 + 4 || in.compare(0, kMagicLen, kMagic) != 0) {
    return Corrupt("not a dbs checkpoint (bad magic or too short)");
  }
  uint32_t stored = 0;
  for (int i = 3; i >= 0; --i) stored = (stored << 8) | static_cast<unsigned char>(in[in.size() - 4 + i]);
  const uint32_t actual = static_cast<uint32_t>(
      crc32(0L, reinterpret_cast<const Bytef*>(in.data()), static_cast<uInt>(in.size() - 4)));
  if (stored != actual) return Corrupt("checksum mismatch (truncated or altered)");
  const uint64_t meta_len = GetU64(in, kMagicLen);
  if (kMagicLen + 8 + meta_len + 8 + 4 > in.size()) return Corrupt("bad length");
  const uint64_t floats = GetU64(in, kMagicLen + 8 + meta_len);
  const size_t blob_at = kMagicLen + 8 + meta_len + 8;
  if (blob_at + floats * sizeof(float) + 4 != in.size()) return Corrupt("bad blob size");
  JobState st;
  const char* stage = "header";
  try {
    const json meta = json::parse(in.substr(kMagicLen + 8, meta_len));
    if (meta.at("format") != 1) return Corrupt("unknown format version");
    const json& c = meta.at("config");
    st.config.expected_workers = c.at("workers");
    st.config.epochs = c.at("epochs");
    st.config.global_batch = c.at("global_batch");
    st.config.seed = c.at("seed");
    st.policy = c.at("policy");
    stage = "workers";
    for (const json& w : meta.at("workers")) {
      st.scheduler.workers.push_back({w.at(0), w.at(1), w.at(2), w.at(3), w.at(5).get<int>()});
      st.scheduler.left.push_back(w.at(4).get<bool>());
    }
    st.scheduler.finished = meta.at("finished");
    stage = "records";
    for (const json& rec : meta.at("records")) {
      EpochRecord r;
      r.epoch = rec.at("epoch");
      r.start = absl::FromUnixNanos(rec.at("start").get<int64_t>());
      r.end = absl::FromUnixNanos(rec.at("end").get<int64_t>());
      r.num_steps = rec.at("num_steps");
      r.revision = rec.at("revision");
      r.complete = rec.at("complete");
      for (int d : rec.at("dead")) r.dead.insert(d);
      for (const auto& [k, v] : rec.at("plans").items()) r.plans[std::stoi(k)] = PlanFrom(v);
      for (const auto& [k, v] : rec.at("layout").items()) {
        StepRanges steps;
        for (const json& step : v) steps.push_back(RangesFrom(step));
        r.layout[std::stoi(k)] = std::move(steps);
      }
      for (const auto& [k, v] : rec.at("reports").items()) r.reports[std::stoi(k)] = TimingFrom(v);
      if (rec.contains("step_times")) {  // absent in checkpoints of earlier versions
        for (const auto& [k, v] : rec.at("step_times").items()) {
          for (const json& t : v) {
            r.step_times[std::stoi(k)][t.at(0).get<int>()] = {t.at(1).get<int>(),
                                                             t.at(2).get<double>()};
          }
        }
      }
      st.scheduler.records.push_back(std::move(r));
    }
    stage = "barrier";
    const json& b = meta.at("barrier");
    st.aggregator.epoch = b.at("epoch");
    st.aggregator.step = b.at("step");
    for (const auto& [k, v] : b.at("losses").items()) {
      st.aggregator.losses[std::stoi(k)] = {v.at(0).get<double>(), v.at(1).get<int64_t>(),
                                           v.at(2).get<int>()};
    }
    for (const json& a : b.at("accepted")) {
      st.aggregator.accepted.insert(std::make_pair(a.at(0).get<int>(), a.at(1).get<int>()));
    }
    stage = "store";
    const json& s = meta.at("store");
    for (const json& t : s.at("layout")) {
      st.aggregator.store.layout.push_back({t.at(0), t.at(1).get<std::vector<int64_t>>()});
    }
    st.aggregator.store.version = s.at("version");
    st.aggregator.store.optimizer.kind = s.at("optimizer");
    st.aggregator.store.optimizer.steps = s.at("optimizer_steps");
    std::vector<size_t> sizes = s.at("buffers").get<std::vector<size_t>>();
    const size_t model = static_cast<size_t>(TotalElements(st.aggregator.store.layout));
    size_t total = model;
    for (size_t n : sizes) total += n;
    if (total != floats) return Corrupt("tensor sizes disagree with the header");
    const float* data = reinterpret_cast<const float*>(in.data() + blob_at);
    std::vector<float> all(data, data + floats);  // copy: the string need not be aligned
    st.aggregator.store.values.assign(all.begin(), all.begin() + model);
    size_t at = model;
    for (size_t n : sizes) {
      st.aggregator.store.optimizer.buffers.emplace_back(all.begin() + at, all.begin() + at + n);
      at += n;
    }
    for (const auto& [k, v] : meta.at("audits").items()) {
      st.audits[std::stoi(k)] = {v.at(0).get<int64_t>(), v.at(1).get<int64_t>(),
                                 v.at(2).get<int64_t>(), v.at(3).get<int64_t>()};
    }
  } catch (const std::exception& e) {
    return Corrupt(absl::StrCat("unreadable contents: ", e.what(), " at ", stage));
  }
  return st;
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

}  // namespace

absl::StatusOr<std::string> WriteCheckpoint(const std::string& dir, const JobState& state,
                                            int keep) {
  mkdir(dir.c_str(), 0755);
  const auto existing = ListCheckpoints(dir);
  const int64_t seq = existing.empty() ? 1 : existing.front().first + 1;
  const std::string path = absl::StrCat(dir, "/ckpt-", seq, ".dbs");
  DBS_RETURN_IF_ERROR(WriteFileAtomic(path, EncodeCheckpoint(state)));
  for (size_t i = static_cast<size_t>(std::max(0, keep - 1)); i < existing.size(); ++i) {
    std::remove(existing[i].second.c_str());
  }
  return path;
}

absl::StatusOr<JobState> LoadNewestCheckpoint(const std::string& dir,
                                              std::vector<std::string>* refused,
                                              std::string* path) {
  for (const auto& [seq, file] : ListCheckpoints(dir)) {
    std::ifstream f(file, std::ios::binary);
    std::stringstream buf;
    buf << f.rdbuf();
    absl::StatusOr<JobState> st = DecodeCheckpoint(buf.str());
    if (st.ok()) {
      if (path != nullptr) *path = file;
      return st;
    }
    if (refused != nullptr) refused->push_back(absl::StrCat(file, ": ", st.status().message()));
  }
  return absl::NotFoundError(absl::StrCat("no valid checkpoint in ", dir));
}

}  // namespace dbs
