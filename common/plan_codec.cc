#include "common/plan_codec.h"

namespace dbs {

void ToProto(const WorkerPlan& p, v1::EpochPlan* out) {
  out->set_epoch(p.epoch);
  out->set_finished(p.finished);
  out->set_batch_size(p.batch_size);
  out->set_final_batch_size(p.final_batch_size);
  out->set_num_steps(p.num_steps);
  out->set_global_batch(p.global_batch);
  out->set_permutation_seed(p.permutation_seed);
  for (const SampleRange& r : p.train_ranges) {
    v1::SampleRange* m = out->add_train_ranges();
    m->set_begin(r.begin);
    m->set_end(r.end);
  }
  out->mutable_test_range()->set_begin(p.test_range.begin);
  out->mutable_test_range()->set_end(p.test_range.end);
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
  for (const v1::SampleRange& r : m.train_ranges()) p.train_ranges.push_back({r.begin(), r.end()});
  p.test_range = {m.test_range().begin(), m.test_range().end()};
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
    v1::StepAssignment* a = out->add_steps();
    for (const SampleRange& range : step) {
      v1::SampleRange* m = a->add_ranges();
      m->set_begin(range.begin);
      m->set_end(range.end);
    }
  }
  out->mutable_test_range()->set_begin(r.test_range.begin);
  out->mutable_test_range()->set_end(r.test_range.end);
}

PlanRevision FromProto(const v1::PlanRevision& m) {
  PlanRevision r;
  r.epoch = m.epoch();
  r.revision = m.revision();
  r.from_step = m.from_step();
  r.num_steps = m.num_steps();
  for (const v1::StepAssignment& a : m.steps()) {
    std::vector<SampleRange> step;
    for (const v1::SampleRange& range : a.ranges()) step.push_back({range.begin(), range.end()});
    r.steps.push_back(std::move(step));
  }
  r.test_range = {m.test_range().begin(), m.test_range().end()};
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

}  // namespace dbs
