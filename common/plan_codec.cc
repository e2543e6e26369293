#include "common/plan_codec.h"

namespace dbs {
namespace {

using RangeList = google::protobuf::RepeatedPtrField<v1::SampleRange>;

void SetRange(const SampleRange& r, v1::SampleRange* m) {
  m->set_begin(r.begin);
  m->set_end(r.end);
}

SampleRange RangeOf(const v1::SampleRange& m) { return {m.begin(), m.end()}; }

void AddRanges(const std::vector<SampleRange>& ranges, RangeList* out) {
  for (const SampleRange& r : ranges) SetRange(r, out->Add());
}

std::vector<SampleRange> RangesOf(const RangeList& list) {
  std::vector<SampleRange> out;
  for (const v1::SampleRange& m : list) out.push_back(RangeOf(m));
  return out;
}

}  // namespace

void ToProto(const WorkerPlan& p, v1::EpochPlan* out) {
  out->set_epoch(p.epoch);
  out->set_finished(p.finished);
  out->set_batch_size(p.batch_size);
  out->set_final_batch_size(p.final_batch_size);
  out->set_num_steps(p.num_steps);
  out->set_global_batch(p.global_batch);
  out->set_permutation_seed(p.permutation_seed);
  AddRanges(p.train_ranges, out->mutable_train_ranges());
  SetRange(p.test_range, out->mutable_test_range());
  out->set_share(p.share);
  out->set_total_epochs(p.total_epochs);
}

WorkerPlan FromProto(const v1::EpochPlan& m) {
  WorkerPlan p;
  p.epoch = m.epoch();
  p.finished = m.finished();
  p.batch_size = m.batch_size();
  p.final_batch_size = m.final_batch_size();
  p.num_steps = m.num_steps();
  p.global_batch = m.global_batch();
  p.permutation_seed = m.permutation_seed();
  p.train_ranges = RangesOf(m.train_ranges());
  p.test_range = RangeOf(m.test_range());
  p.share = m.share();
  p.total_epochs = m.total_epochs();
  return p;
}

void ToProto(const PlanRevision& r, v1::PlanRevision* out) {
  out->set_epoch(r.epoch);
  out->set_revision(r.revision);
  out->set_from_step(r.from_step);
  out->set_num_steps(r.num_steps);
  for (const std::vector<SampleRange>& step : r.steps) {
    AddRanges(step, out->add_steps()->mutable_ranges());
  }
  SetRange(r.test_range, out->mutable_test_range());
}

PlanRevision FromProto(const v1::PlanRevision& m) {
  PlanRevision r;
  r.epoch = m.epoch();
  r.revision = m.revision();
  r.from_step = m.from_step();
  r.num_steps = m.num_steps();
  for (const v1::StepAssignment& a : m.steps()) r.steps.push_back(RangesOf(a.ranges()));
  r.test_range = RangeOf(m.test_range());
  return r;
}

void ToProto(const EpochTiming& t, v1::EpochReport* out) {
  out->set_worker_id(t.worker_id);
  out->set_epoch(t.epoch);
  out->set_samples(t.samples);
  out->set_compute_seconds(t.compute_seconds);
  out->set_wait_seconds(t.wait_seconds);
  out->set_eval_seconds(t.eval_seconds);
  out->set_test_samples(t.test_samples);
  out->set_test_correct(t.test_correct);
  out->set_test_loss_sum(t.test_loss_sum);
}

EpochTiming FromProto(const v1::EpochReport& m) {
  EpochTiming t;
  t.worker_id = m.worker_id();
  t.epoch = m.epoch();
  t.samples = m.samples();
  t.compute_seconds = m.compute_seconds();
  t.wait_seconds = m.wait_seconds();
  t.eval_seconds = m.eval_seconds();
  t.test_samples = m.test_samples();
  t.test_correct = m.test_correct();
  t.test_loss_sum = m.test_loss_sum();
  return t;
}

void ToProto(const WorkerRegistration& r, v1::RegisterWorkerRequest* out) {
  out->set_name(r.name);
  out->set_train_samples(r.train_samples);
  out->set_test_samples(r.test_samples);
  out->set_device(r.device);
  out->set_incarnation(r.incarnation);
  out->set_cpu_limit_cores(r.cpu_limit_cores);
}

WorkerRegistration FromProto(const v1::RegisterWorkerRequest& m) {
  return {m.name(),   m.train_samples(), m.test_samples(),
          m.device(), m.incarnation(),   m.cpu_limit_cores()};
}

void ToProto(const RegistrationResult& r, v1::RegisterWorkerReply* out) {
  out->set_worker_id(r.worker_id);
  out->set_start_epoch(r.start_epoch);
  out->set_expected_workers(r.expected_workers);
  out->set_epochs(r.epochs);
  out->set_global_batch(r.global_batch);
  out->set_policy(r.policy);
  out->set_token(r.token);
  out->set_job_finished(r.job_finished);
}

RegistrationResult FromProto(const v1::RegisterWorkerReply& m) {
  RegistrationResult r;
  r.worker_id = m.worker_id();
  r.start_epoch = m.start_epoch();
  r.expected_workers = m.expected_workers();
  r.epochs = m.epochs();
  r.global_batch = m.global_batch();
  r.policy = m.policy();
  r.token = m.token();
  r.wire_dtype = static_cast<int>(m.wire_dtype());
  r.job_finished = m.job_finished();
  return r;
}

}  // namespace dbs
