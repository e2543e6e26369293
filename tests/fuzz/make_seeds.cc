// Writes a few valid inputs per fuzz target into <dir>/<target>/, so fuzzing starts from
// messages that get past parsing.
#include <fstream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/plan.h"
#include "common/plan_codec.h"
#include "common/step_wire.h"
#include "common/tensor_codec.h"
#include "proto/dbs.pb.h"
#include "server/checkpoint.h"
#include "server/training_job.h"
#include "tests/values_field.h"

namespace {

void Write(const std::string& path, const std::string& bytes) {
  std::ofstream(path, std::ios::binary) << bytes;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) return 2;
  const std::string dir = argv[1];
  // Tensors (a model registration).
  dbs::v1::RegisterModelRequest model;
  model.set_worker_id(1);
  dbs::EncodeTensors({{"conv1.weight", {2, 3}}, {"fc.bias", {4}}},
                     std::vector<float>{1, 2, 3, 4, 5, 6, 0.5, -1, 1e-3f, 7},
                     model.mutable_parameters());
  Write(dir + "/tensor_decoder/register_model", model.SerializeAsString());
  // A step's push and reply, flat values: byte 0 picks the segment size, byte 1 the model size.
  const std::vector<float> values = {1, 2, 3, 4, 5, 6, 0.5, -1, 1e-3f, 7};
  for (const dbs::WireDtype dtype : {dbs::WireDtype::kFp32, dbs::WireDtype::kBf16}) {
    dbs::v1::PushGradientRequest push;
    push.set_worker_id(1);
    push.set_num_samples(4);
    push.set_wire_dtype(static_cast<dbs::v1::WireDtype>(dtype));
    std::string bytes = push.SerializeAsString();
    std::string field(dbs::GradientFieldSize(values.size(), dtype), '\0');
    dbs::WriteGradientField(dtype, values, reinterpret_cast<uint8_t*>(field.data()));
    Write(dir + "/step_wire/push_" + dbs::WireDtypeName(dtype),
          std::string("\x06\x0a", 2) + bytes + field);
    dbs::v1::PushGradientReply reply;
    reply.set_step(3);
    reply.set_global_samples(16);
    bytes = reply.SerializeAsString();
    field = dbs::ValuesFieldBytes(7, dtype, values);
    Write(dir + "/step_wire/reply_" + dbs::WireDtypeName(dtype),
          std::string("\x02\x0a", 2) + bytes + field);
  }
  // Plans.
  dbs::WorkerPlan plan;
  plan.epoch = 1;
  plan.batch_size = 5;
  plan.final_batch_size = 3;
  plan.num_steps = 4;
  plan.global_batch = 16;
  plan.train_ranges = {{0, 5}, {16, 21}, {32, 37}, {48, 51}};
  plan.test_range = {0, 10};
  plan.share = 0.3;
  plan.total_epochs = 5;
  dbs::v1::ResumeReply reply;
  reply.set_plan_ready(true);
  dbs::ToProto(plan, reply.mutable_plan());
  dbs::PlanRevision rev;
  rev.num_steps = 4;
  rev.steps = dbs::ExpandSteps(plan);
  dbs::ToProto(rev, reply.mutable_schedule());
  Write(dir + "/plan_codec/resume", reply.SerializeAsString());
  // A checkpoint of a job two steps in.
  dbs::FakeClock clock;
  dbs::JobConfig config;
  config.scheduler.expected_workers = 2;
  config.scheduler.epochs = 2;
  config.scheduler.global_batch = 4;
  auto job = *dbs::TrainingJob::Create(config, &clock);
  (void)job->scheduler()->Register({"a", 16, 4, "cpu"});
  (void)job->scheduler()->Register({"b", 16, 4, "cpu"});
  (void)job->store()->Register({{"w", {2}}}, std::vector<float>{1.0f, -1.0f});
  for (int w = 0; w < 2; ++w) {
    job->aggregator()->Push({w, 0, 0, 2, 1.0, std::vector<float>{0.5f, 0.25f}},
                            [](const absl::StatusOr<dbs::StepResult>&) {});
  }
  dbs::JobState st;
  st.config = config.scheduler;
  st.policy = "dbs";
  st.settings = dbs::TrainingSettings(config);
  st.aggregator = job->aggregator()->SaveState();
  st.scheduler = job->scheduler()->SaveState();
  const std::string ckpt = dbs::EncodeCheckpoint(st);
  Write(dir + "/checkpoint/framed", ckpt);
  Write(dir + "/checkpoint/body", ckpt.substr(16, ckpt.size() - 20));
  // Call sequences: three registrations, the model, pushes and reports in order; and noise.
  // (Each op is: worker + 1, epoch + 1, step + 1, op, then the op's bytes; the first byte picks
  // the policy: 2 = fixed.)
  std::string seq(1, 2);
  for (char w = 0; w < 3; ++w) seq += std::string{1, 1, 1, 0, w, 0, 3};
  seq += std::string{1, 1, 1, 1};
  for (char s = 0; s < 2; ++s) {
    for (char w = 0; w < 3; ++w)
      seq += std::string{static_cast<char>(w + 1), 1, static_cast<char>(s + 1), 3, 2, 0};
  }
  Write(dir + "/call_sequence/ordered", seq);
  // The same job with its pushes as raw wire bytes (op 4: size, bytes, dtype, cut, samples):
  // step 0 in bf16 after a refused bf16 NaN, step 1 (2, 1 and 1 samples) in fp16, each value 0.5.
  std::string wire(seq.begin(), seq.begin() + 1 + 3 * 7 + 4);
  wire += std::string{1, 1, 1, 4, 2, static_cast<char>(0xc0), 0x7f, 1, 1, 2};  // NaN: refused
  for (char s = 0; s < 2; ++s) {
    const char high = s == 0 ? 0x3f : 0x38;  // 0.5 in bf16, in fp16
    for (char w = 0; w < 3; ++w) {
      const char samples = s == 1 && w > 0 ? 1 : 2;
      wire += std::string{static_cast<char>(w + 1),
                          1,
                          static_cast<char>(s + 1),
                          4,
                          2,
                          0,
                          high,
                          static_cast<char>(s + 1),
                          static_cast<char>(w),
                          samples};
    }
  }
  Write(dir + "/call_sequence/wire_pushes", wire);
  // The ordered job's step 0, then a follower's report that worker 2's push of it never reached
  // the follower (op 8, no time passing): worker 2 is removed at step 1 (2 of its 4 samples), and
  // the survivors push step 1 (2 and 1 samples) and the extra step 2 (1 and 0).
  std::string report(seq.begin(), seq.begin() + 1 + 3 * 7 + 4 + 3 * 6);
  report += std::string{3, 1, 1, 8, 0};
  for (char s = 1; s < 3; ++s) {
    for (char w = 0; w < 2; ++w) {
      const char samples = static_cast<char>(2 - w - (s - 1));
      report += std::string{static_cast<char>(w + 1), 1, static_cast<char>(s + 1), 3, samples, 0};
    }
  }
  Write(dir + "/call_sequence/shard_report", report);
  Write(dir + "/call_sequence/noise", std::string("\x07\x13\x02\x55\x09\x31\x08\x04\x05\x06", 10));
  return 0;
}
