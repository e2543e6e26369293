#include "worker/trainer.h"

#include <cstdio>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/permutation.h"
#include "common/status_macros.h"
#include "nlohmann/json.hpp"
#include "worker/fashion_mnist.h"
#include "worker/model.h"

namespace dbs {
namespace {

absl::StatusOr<torch::Device> ChooseDevice(const std::string& want) {
  const bool cuda = torch::cuda::is_available();
  if (want == "cpu") return torch::Device(torch::kCPU);
  if (want == "auto") return cuda ? torch::Device(torch::kCUDA, 0) : torch::Device(torch::kCPU);
  if (want == "cuda") {
    if (!cuda) {
      return absl::FailedPreconditionError(
          "--device=cuda, but no CUDA device is usable: either this machine has no GPU or "
          "dbs_worker was built against a CPU-only libtorch (Debian's is). Rebuild with "
          "LIBTORCH_DIR pointing at a CUDA libtorch, or use --device=cpu.");
    }
    return torch::Device(torch::kCUDA, 0);
  }
  return absl::InvalidArgumentError(
      absl::StrCat("unknown --device '", want, "'; use auto, cpu or cuda"));
}

std::string Clock(double seconds) {
  const int s = static_cast<int>(seconds + 0.5);
  return absl::StrFormat("%d:%02d", s / 60, s % 60);
}

double Since(absl::Time t) { return absl::ToDoubleSeconds(absl::Now() - t); }

// Reads `n` little-endian float32 values written in layout order (e.g. by bench/ddp_baseline.py).
absl::Status ReadRawParams(const std::string& path, absl::Span<float> out) {
  FILE* f = std::fopen(path.c_str(), "rb");
  if (f == nullptr) return absl::NotFoundError(absl::StrCat("cannot open --init_params ", path));
  const size_t got = std::fread(out.data(), sizeof(float), out.size(), f);
  const bool trailing = std::fgetc(f) != EOF;
  std::fclose(f);
  if (got != out.size() || trailing) {
    return absl::InvalidArgumentError(absl::StrCat(path, " does not hold exactly ", out.size(),
                                                   " float32 values for this model"));
  }
  return absl::OkStatus();
}

// Sleeps so that a step whose real compute took `elapsed` appears `factor` times slower.
void EmulateSlowdown(absl::Duration elapsed, double factor) {
  if (factor > 1.0) absl::SleepFor(elapsed * (factor - 1.0));
}

}  // namespace

absl::Status RunWorker(const TrainerConfig& config, PsClient* client) {
  if (config.threads < 1) return absl::InvalidArgumentError("--threads must be >= 1");
  torch::set_num_threads(config.threads);
  DBS_ASSIGN_OR_RETURN(torch::Device device, ChooseDevice(config.device));
  DBS_ASSIGN_OR_RETURN(ImageDataset train, LoadFashionMnist(config.data_dir, true,
                                                            config.train_limit));
  DBS_ASSIGN_OR_RETURN(ImageDataset test, LoadFashionMnist(config.data_dir, false,
                                                           config.test_limit));
  torch::manual_seed(config.seed);
  DBS_ASSIGN_OR_RETURN(torch::nn::Sequential model, MakeModel(config.model));
  const ModelLayout layout = ModelLayoutOf(model);
  const size_t model_size = static_cast<size_t>(TotalElements(layout));
  std::vector<float> params(model_size), grad(model_size);
  CopyParametersTo(model, absl::MakeSpan(params));
  if (!config.init_params_path.empty()) {
    DBS_RETURN_IF_ERROR(ReadRawParams(config.init_params_path, absl::MakeSpan(params)));
  }

  const torch::Tensor train_x = ImagesTensor(train).to(device);
  const torch::Tensor train_y = LabelsTensor(train).to(device);
  const torch::Tensor test_x = ImagesTensor(test).to(device);
  const torch::Tensor test_y = LabelsTensor(test).to(device);

  WorkerRegistration reg{config.name, train.size, test.size, device.str(), config.max_batch};
  DBS_ASSIGN_OR_RETURN(RegistrationResult joined, client->RegisterWorker(reg));
  const int id = joined.worker_id;
  std::printf("[%s] joined as worker %d on %s: %lld train / %lld test samples, model %s "
              "(%zu parameters), policy %s, %d epochs, global batch %d\n",
              config.name.c_str(), id, device.str().c_str(), static_cast<long long>(train.size),
              static_cast<long long>(test.size), config.model.c_str(), model_size,
              joined.policy.c_str(), joined.epochs, joined.global_batch);
  std::fflush(stdout);
  DBS_RETURN_IF_ERROR(client->RegisterModel(id, layout, params, absl::MakeSpan(params)));
  model->to(device);
  LoadParameters(model, params);
  model->train();

  nlohmann::json record = nlohmann::json::array();
  const absl::Time job_start = absl::Now();
  double last_accuracy = 0.0;
  int64_t global_step = 0;
  if (joined.start_epoch > 0) {
    std::printf("[%s] joining a running job: training from epoch %d on, from the current "
                "parameters\n", config.name.c_str(), joined.start_epoch + 1);
    std::fflush(stdout);
  }
  // Loop state; a resume (after the server restarted from a checkpoint) may set any of it.
  int epoch = joined.start_epoch;
  bool need_plan = true;
  bool finished = false;
  int first_step = 0;
  WorkerPlan plan;
  StepRanges schedule;
  SampleRange test_range;
  int num_steps = 0;
  // Continues where the server says the job stands; false when the server cannot tell.
  auto resync = [&](const absl::Status& why) -> bool {
    absl::StatusOr<ResumeInfo> r = client->Resume(id, absl::MakeSpan(params));
    if (!r.ok()) return false;
    client->TakeReconnected();  // this resume accounts for the outage
    LoadParameters(model, params);
    finished = r->finished;
    epoch = r->epoch;
    need_plan = !r->has_plan;
    if (r->has_plan) {
      plan = r->plan;
      schedule = r->schedule.steps;
      num_steps = r->schedule.num_steps;
      test_range = r->schedule.test_range;
      first_step = r->step;
    }
    std::printf("[%s] resuming at epoch %d step %d from the server's state (%s)\n",
                config.name.c_str(), epoch + 1, r->step + 1, std::string(why.message()).c_str());
    std::fflush(stdout);
    return true;
  };
  while (!finished) {
    if (need_plan) {
      absl::StatusOr<WorkerPlan> next = client->GetEpochPlan(id, epoch);
      if (!next.ok()) {
        if (absl::IsFailedPrecondition(next.status()) && resync(next.status())) continue;
        return next.status();
      }
      plan = *next;
      if (plan.finished) break;
      schedule = ExpandSteps(plan);
      num_steps = plan.num_steps;
      test_range = plan.test_range;
      first_step = 0;
    }
    need_plan = true;
    const std::vector<int64_t> perm = EpochPermutation(train.size, plan.permutation_seed);
    // The dataset indices of one step's positions, checked against the data set.
    std::vector<int64_t> step_index;
    auto indices_of = [&](const std::vector<SampleRange>& ranges) -> absl::Status {
      step_index.clear();
      for (const SampleRange& r : ranges) {
        if (r.begin < 0 || r.end > train.size || r.begin > r.end) {
          return absl::InvalidArgumentError("the plan's sample range is outside the data set");
        }
        step_index.insert(step_index.end(), perm.begin() + r.begin, perm.begin() + r.end);
      }
      return absl::OkStatus();
    };

    EpochTiming timing;
    timing.worker_id = id;
    timing.epoch = epoch;
    // Steps done before a resume were counted by the server already.
    int64_t resumed_samples = 0;
    for (int s = 0; s < first_step && s < static_cast<int>(schedule.size()); ++s) {
      resumed_samples += CountSamples(schedule[s]);
    }
    double loss_shown = 0.0;
    const absl::Time epoch_start = absl::Now();
    absl::Time next_log = epoch_start + config.log_every;
    bool resumed = false;
    for (int step = first_step; step < num_steps; ++step) {
      DBS_RETURN_IF_ERROR(indices_of(schedule[step]));
      const int b = static_cast<int>(step_index.size());
      absl::Time t0 = absl::Now();
      double loss_sum = 0.0;
      if (b > 0) {
        model->train();
        const torch::Tensor idx =
            torch::from_blob(step_index.data(), {b}, torch::kInt64).to(device);
        loss_sum = ComputeGradient(model, train_x.index_select(0, idx),
                                   train_y.index_select(0, idx), absl::MakeSpan(grad));
        EmulateSlowdown(absl::Now() - t0, config.slowdown.FactorAt(epoch, global_step));
      }
      ++global_step;
      const double compute = Since(t0);
      const absl::Time t1 = absl::Now();
      absl::StatusOr<StepOutcome> pushed =
          client->PushGradient(id, epoch, step, b, loss_sum, compute,
                               b > 0 ? absl::Span<const float>(grad) : absl::Span<const float>(),
                               absl::MakeSpan(params));
      if (!pushed.ok()) {
        // A restarted server may be behind this worker: ask where to continue.
        if (absl::IsFailedPrecondition(pushed.status()) && resync(pushed.status())) {
          resumed = true;
          break;
        }
        return pushed.status();
      }
      const StepOutcome& outcome = *pushed;
      const absl::Time t2 = absl::Now();
      LoadParameters(model, params);
      timing.compute_seconds += compute + Since(t2);
      timing.wait_seconds += absl::ToDoubleSeconds(t2 - t1);
      timing.samples += b;
      loss_shown = outcome.global_loss;
      if (outcome.revised) {
        const PlanRevision& rev = outcome.revision;
        if (rev.epoch != epoch || rev.from_step != step + 1 ||
            rev.num_steps != rev.from_step + static_cast<int>(rev.steps.size())) {
          return absl::InvalidArgumentError("the server sent an inconsistent plan revision");
        }
        schedule.resize(rev.num_steps);
        std::copy(rev.steps.begin(), rev.steps.end(), schedule.begin() + rev.from_step);
        num_steps = rev.num_steps;
        test_range = rev.test_range;
        std::printf("[%s] epoch %d re-planned at step %d (revision %d): %d steps, my next batch "
                    "%lld\n",
                    config.name.c_str(), epoch + 1, step + 1, rev.revision, num_steps,
                    static_cast<long long>(rev.steps.empty() ? 0 : CountSamples(rev.steps[0])));
        std::fflush(stdout);
      }
      if (absl::Now() >= next_log || step == num_steps - 1) {
        next_log = absl::Now() + config.log_every;
        const double elapsed = Since(epoch_start);
        const double per_step = elapsed / (step - first_step + 1);
        const double epoch_eta = per_step * (num_steps - step - 1);
        const double job_eta =
            epoch_eta + per_step * num_steps * (plan.total_epochs - epoch - 1);
        std::printf("[%s] epoch %d/%d step %d/%d | loss %.4f | batch %d | %.0f samples/s "
                    "| epoch ETA %s | job ETA %s\n",
                    config.name.c_str(), epoch + 1, plan.total_epochs, step + 1, num_steps,
                    loss_shown, b, timing.samples / std::max(elapsed, 1e-9),
                    Clock(epoch_eta).c_str(), Clock(job_eta).c_str());
        std::fflush(stdout);
      }
    }
    if (resumed) continue;
    // Before reporting: if the server went away meanwhile it may have restarted behind us.
    if (client->TakeReconnected()) {
      if (resync(absl::UnavailableError("the server restarted during the epoch"))) continue;
    }
    if (resumed_samples > 0 && timing.samples > 0) {
      // Only part of the epoch was timed here: scale to the whole for the speed estimate.
      timing.compute_seconds *= static_cast<double>(timing.samples + resumed_samples) /
                                static_cast<double>(timing.samples);
    }
    timing.samples += resumed_samples;
    const absl::Time eval_start = absl::Now();
    model->eval();
    if (test_range.begin < 0 || test_range.end > test.size || test_range.begin > test_range.end) {
      return absl::InvalidArgumentError("the plan's test range is outside the test set");
    }
    const EvalResult eval = Evaluate(model, test_x, test_y, test_range.begin, test_range.end);
    timing.eval_seconds = Since(eval_start);
    timing.test_samples = eval.samples;
    timing.test_correct = eval.correct;
    timing.test_loss_sum = eval.loss_sum;
    const absl::Status reported = client->ReportEpoch(timing);
    if (!reported.ok()) {
      if ((absl::IsFailedPrecondition(reported) || absl::IsInvalidArgument(reported)) &&
          client->TakeReconnected() && resync(reported)) {
        continue;
      }
      return reported;
    }
    last_accuracy = eval.samples > 0 ? static_cast<double>(eval.correct) / eval.samples : 0.0;
    std::printf("[%s] epoch %d/%d done: %lld samples, batch %d (share %.3f), compute "
                "%.2f s, wait %.2f s, eval %.2f s, accuracy on its test slice %.2f%%\n",
                config.name.c_str(), epoch + 1, plan.total_epochs,
                static_cast<long long>(timing.samples),
                plan.batch_size, plan.share, timing.compute_seconds, timing.wait_seconds,
                timing.eval_seconds, 100.0 * last_accuracy);
    std::fflush(stdout);
    record.push_back({{"epoch", epoch},
                      {"batch_size", plan.batch_size},
                      {"share", plan.share},
                      {"samples", timing.samples},
                      {"compute_seconds", timing.compute_seconds},
                      {"wait_seconds", timing.wait_seconds},
                      {"eval_seconds", timing.eval_seconds},
                      {"test_samples", timing.test_samples},
                      {"test_correct", timing.test_correct}});
      ++epoch;
  }
  const absl::Status left = client->Leave(id);
  if (!left.ok()) {
    std::fprintf(stderr, "[%s] warning: %s\n", config.name.c_str(), left.ToString().c_str());
  }
  std::printf("[%s] finished: %zu epochs in %.1f s\n", config.name.c_str(), record.size(),
              Since(job_start));
  std::fflush(stdout);
  if (!config.record_path.empty()) {
    FILE* f = std::fopen(config.record_path.c_str(), "w");
    if (f == nullptr) return absl::UnavailableError(absl::StrCat("cannot write ", config.record_path));
    const std::string text =
        nlohmann::json({{"worker_id", id}, {"name", config.name}, {"epochs", record}}).dump(2);
    std::fwrite(text.data(), 1, text.size(), f);
    std::fclose(f);
  }
  return absl::OkStatus();
}

absl::StatusOr<double> MeasureSpeed(const TrainerConfig& config, int64_t samples, int batch) {
  if (samples < 1 || batch < 1) return absl::InvalidArgumentError("samples and batch must be >= 1");
  torch::set_num_threads(config.threads);
  DBS_ASSIGN_OR_RETURN(torch::Device device, ChooseDevice(config.device));
  DBS_ASSIGN_OR_RETURN(ImageDataset train, LoadFashionMnist(config.data_dir, true,
                                                            config.train_limit));
  torch::manual_seed(config.seed);
  DBS_ASSIGN_OR_RETURN(torch::nn::Sequential model, MakeModel(config.model));
  model->to(device);
  model->train();
  std::vector<float> grad(static_cast<size_t>(TotalElements(ModelLayoutOf(model))));
  const torch::Tensor x = ImagesTensor(train).to(device);
  const torch::Tensor y = LabelsTensor(train).to(device);
  // One warm-up batch, then the timed ones.
  ComputeGradient(model, x.slice(0, 0, std::min<int64_t>(batch, train.size)),
                  y.slice(0, 0, std::min<int64_t>(batch, train.size)), absl::MakeSpan(grad));
  double seconds = 0.0;
  int64_t done = 0;
  while (done < samples) {
    const int64_t begin = done % train.size;
    const int64_t end = std::min<int64_t>(train.size, begin + batch);
    const absl::Time t0 = absl::Now();
    ComputeGradient(model, x.slice(0, begin, end), y.slice(0, begin, end), absl::MakeSpan(grad));
    EmulateSlowdown(absl::Now() - t0, config.slowdown.base());
    seconds += Since(t0);
    done += end - begin;
  }
  return done / seconds;
}

}  // namespace dbs
