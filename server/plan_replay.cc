#include "server/plan_replay.h"

#include <algorithm>
#include <cmath>
#include <map>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"

namespace dbs {
namespace {

using nlohmann::json;

absl::Status Missing(const std::string& where, const char* key, const char* what) {
  return absl::InvalidArgumentError(absl::StrCat(where, ": \"", key, "\" must be ", what));
}

absl::StatusOr<double> Number(const json& j, const char* key, const std::string& where) {
  if (!j.is_object() || !j.contains(key) || !j.at(key).is_number()) {
    return Missing(where, key, "a number");
  }
  const double v = j.at(key).get<double>();
  if (!std::isfinite(v)) return Missing(where, key, "a finite number");
  return v;
}

absl::StatusOr<int64_t> Integer(const json& j, const char* key, const std::string& where) {
  if (!j.is_object() || !j.contains(key) || !j.at(key).is_number_integer()) {
    return Missing(where, key, "an integer");
  }
  return j.at(key).get<int64_t>();
}

absl::StatusOr<int> SmallInteger(const json& j, const char* key, const std::string& where) {
  DBS_ASSIGN_OR_RETURN(const int64_t v, Integer(j, key, where));
  if (v < 0 || v > (int64_t{1} << 30)) return Missing(where, key, "an integer in [0, 2^30]");
  return static_cast<int>(v);
}

absl::StatusOr<const json*> Array(const json& j, const char* key, const std::string& where) {
  if (!j.is_object() || !j.contains(key) || !j.at(key).is_array()) {
    return Missing(where, key, "an array");
  }
  return &j.at(key);
}

}  // namespace

json MeasurementJson(const Measurement& m) {
  json times = json::array();
  for (const auto& [batch, t] : m.by_batch) {
    times.push_back({{"batch", batch},
                     {"steps", t.steps},
                     {"seconds", t.seconds},
                     {"square_seconds", t.square_seconds}});
  }
  return {{"samples", m.samples},
          {"compute_seconds", m.compute_seconds},
          {"steps", m.steps},
          {"step_times", std::move(times)}};
}

absl::StatusOr<Measurement> MeasurementFromJson(const json& j) {
  const std::string where = "measurement";
  Measurement m;
  DBS_ASSIGN_OR_RETURN(m.samples, Integer(j, "samples", where));
  DBS_ASSIGN_OR_RETURN(m.compute_seconds, Number(j, "compute_seconds", where));
  DBS_ASSIGN_OR_RETURN(m.steps, SmallInteger(j, "steps", where));
  DBS_ASSIGN_OR_RETURN(const json* times, Array(j, "step_times", where));
  for (const json& t : *times) {
    const std::string at = "step_times entry";
    DBS_ASSIGN_OR_RETURN(const int batch, SmallInteger(t, "batch", at));
    BatchTime bt;
    DBS_ASSIGN_OR_RETURN(bt.steps, SmallInteger(t, "steps", at));
    DBS_ASSIGN_OR_RETURN(bt.seconds, Number(t, "seconds", at));
    DBS_ASSIGN_OR_RETURN(bt.square_seconds, Number(t, "square_seconds", at));
    if (!m.by_batch.emplace(batch, bt).second) {
      return absl::InvalidArgumentError(absl::StrCat(where, ": batch ", batch, " twice"));
    }
  }
  return m;
}

json PolicyConfigJson(const PolicyConfig& c) {
  return {{"policy", PolicyName(c.kind)},   {"global_batch", c.global_batch},
          {"min_batch", c.min_batch},       {"max_batch", c.max_batch},
          {"noise_margin", c.noise_margin}, {"speed_window", c.speed_window},
          {"smoothing", c.smoothing},       {"deadband", c.deadband},
          {"fixed_split", c.fixed_split}};
}

absl::StatusOr<PolicyConfig> PolicyConfigFromJson(const json& j) {
  const std::string where = "controller";
  if (!j.is_object() || !j.contains("policy") || !j.at("policy").is_string()) {
    return Missing(where, "policy", "a string");
  }
  PolicyConfig c;
  DBS_ASSIGN_OR_RETURN(c.kind, ParsePolicy(j.at("policy").get<std::string>()));
  DBS_ASSIGN_OR_RETURN(c.global_batch, SmallInteger(j, "global_batch", where));
  DBS_ASSIGN_OR_RETURN(c.min_batch, SmallInteger(j, "min_batch", where));
  DBS_ASSIGN_OR_RETURN(c.max_batch, SmallInteger(j, "max_batch", where));
  DBS_ASSIGN_OR_RETURN(c.noise_margin, Number(j, "noise_margin", where));
  DBS_ASSIGN_OR_RETURN(c.speed_window, SmallInteger(j, "speed_window", where));
  DBS_ASSIGN_OR_RETURN(c.smoothing, Number(j, "smoothing", where));
  DBS_ASSIGN_OR_RETURN(c.deadband, Number(j, "deadband", where));
  if (!j.contains("fixed_split") || !j.at("fixed_split").is_object()) {
    return Missing(where, "fixed_split", "an object");
  }
  for (const auto& [name, weight] : j.at("fixed_split").items()) {
    if (!weight.is_number()) return Missing(where, "fixed_split", "names with numbers");
    c.fixed_split[name] = weight.get<double>();
  }
  DBS_RETURN_IF_ERROR(ValidatePolicyConfig(c));
  return c;
}

json DecisionJson(const PlanDecision& d) {
  json workers = json::array();
  for (const PlanDecision::Input& in : d.workers) {
    json w = {{"id", in.id},
              {"current_batch", in.current_batch},
              {"previous_share", in.previous_share},
              {"share", in.share}};
    if (in.out_steps > 0) {
      w["idle_steps"] = in.idle_steps;
      w["out_steps"] = in.out_steps;
    }
    if (in.has_window) w["window"] = MeasurementJson(in.window);
    workers.push_back(std::move(w));
  }
  return {{"from_step", d.from_step}, {"applied", d.applied}, {"workers", std::move(workers)}};
}

namespace {

// What the summary says of each registered worker (by id) that an observation carries.
struct WorkerInfo {
  std::string name;
};
using WorkerInfos = std::map<int, WorkerInfo>;
// Each epoch's measurements by worker id, by epoch number.
using Measured = std::map<int, std::map<int, Measurement>>;

absl::StatusOr<WorkerInfos> WorkersOf(const json& info) {
  WorkerInfos workers;
  for (const json& w : info) {
    DBS_ASSIGN_OR_RETURN(const int id, SmallInteger(w, "id", "worker_info entry"));
    if (!w.contains("name") || !w.at("name").is_string()) {
      return Missing("worker_info entry", "name", "a string");
    }
    workers[id].name = w.at("name").get<std::string>();
  }
  return workers;
}

// One decision about `epoch`, each worker's history rebuilt as the scheduler builds it: the
// measurements of the epochs before, then the windows of the epoch's re-plans up to this one.
// `windows`: each worker's windows of the epoch's re-plans so far, which the decision's window
// joins.
absl::StatusOr<RecordedDecision> DecisionOf(const json& d, int epoch, const WorkerInfos& workers,
                                            const Measured& measured,
                                            std::map<int, std::vector<Measurement>>* windows) {
  const std::string where = absl::StrCat("epoch ", epoch, " decision");
  RecordedDecision r;
  r.epoch = epoch;
  DBS_ASSIGN_OR_RETURN(r.from_step, SmallInteger(d, "from_step", where));
  if (!d.contains("applied") || !d.at("applied").is_boolean()) {
    return Missing(where, "applied", "true or false");
  }
  r.applied = d.at("applied").get<bool>();
  DBS_ASSIGN_OR_RETURN(const json* inputs, Array(d, "workers", where));
  const std::string at = where + "'s worker";
  for (const json& in : *inputs) {
    DBS_ASSIGN_OR_RETURN(const int id, SmallInteger(in, "id", at));
    auto w = workers.find(id);
    if (w == workers.end()) return absl::InvalidArgumentError(absl::StrCat(at, ": no worker ", id));
    WorkerObservation o;
    o.name = w->second.name;
    DBS_ASSIGN_OR_RETURN(o.current_batch, SmallInteger(in, "current_batch", at));
    DBS_ASSIGN_OR_RETURN(o.previous_share, Number(in, "previous_share", at));
    if (in.contains("out_steps")) {
      DBS_ASSIGN_OR_RETURN(o.idle_steps, SmallInteger(in, "idle_steps", at));
      DBS_ASSIGN_OR_RETURN(o.out_steps, SmallInteger(in, "out_steps", at));
    }
    for (int k = std::max(0, epoch - Scheduler::kHistoryEpochs); k < epoch; ++k) {
      auto before = measured.find(k);
      if (before == measured.end()) continue;
      auto m = before->second.find(id);
      if (m != before->second.end()) o.history.push_back(m->second);
    }
    if (in.contains("window")) {
      DBS_ASSIGN_OR_RETURN(Measurement window, MeasurementFromJson(in.at("window")));
      std::vector<Measurement>& earlier = (*windows)[id];
      o.history.insert(o.history.end(), earlier.begin(), earlier.end());
      o.history.push_back(window);
      earlier.push_back(std::move(window));
      if (earlier.size() > Scheduler::kHistoryWindows) earlier.erase(earlier.begin());
    }
    DBS_ASSIGN_OR_RETURN(const double share, Number(in, "share", at));
    r.ids.push_back(id);
    r.observations.push_back(std::move(o));
    r.shares.push_back(share);
  }
  return r;
}

}  // namespace

absl::StatusOr<std::vector<RecordedDecision>> DecisionsOf(const json& summary) {
  if (!summary.is_object() || !summary.contains("format") ||
      summary.at("format") != json("dbs.run_summary.v1")) {
    return absl::InvalidArgumentError("not a run summary: \"format\" must be dbs.run_summary.v1");
  }
  DBS_ASSIGN_OR_RETURN(const json* info, Array(summary, "worker_info", "summary"));
  DBS_ASSIGN_OR_RETURN(const json* epochs, Array(summary, "epochs", "summary"));
  DBS_ASSIGN_OR_RETURN(const WorkerInfos workers, WorkersOf(*info));
  Measured measured;
  std::vector<RecordedDecision> out;
  for (const json& e : *epochs) {
    DBS_ASSIGN_OR_RETURN(const int epoch, SmallInteger(e, "epoch", "epoch"));
    const std::string where = absl::StrCat("epoch ", epoch);
    if (e.contains("decisions")) {
      DBS_ASSIGN_OR_RETURN(const json* decisions, Array(e, "decisions", where));
      std::map<int, std::vector<Measurement>> windows;
      for (const json& d : *decisions) {
        DBS_ASSIGN_OR_RETURN(RecordedDecision r, DecisionOf(d, epoch, workers, measured, &windows));
        out.push_back(std::move(r));
      }
    }
    DBS_ASSIGN_OR_RETURN(const json* list, Array(e, "workers", where));
    for (const json& w : *list) {
      if (!w.contains("measured")) continue;  // dead, or a summary without measurements
      DBS_ASSIGN_OR_RETURN(const int id, SmallInteger(w, "id", where + " worker"));
      DBS_ASSIGN_OR_RETURN(measured[epoch][id], MeasurementFromJson(w.at("measured")));
    }
  }
  return out;
}

std::vector<double> Replay(const SharePolicy& policy, const RecordedDecision& decision) {
  return decision.epoch == 0 && decision.from_step == 0 ? policy.FirstShares(decision.observations)
                                                        : policy.NextShares(decision.observations);
}

}  // namespace dbs
