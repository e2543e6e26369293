// DBS is exact: three workers with batches 5, 11 and 48 on one step produce, through the real
// StepAggregator and ParameterStore, the same aggregated gradient and the same updated parameters
// as one process computing the same 64 samples (checked against libtorch's own SGD).
#include <cmath>
#include <cstdio>
#include <memory>
#include <vector>

#include "gtest/gtest.h"
#include "server/parameter_store.h"
#include "server/step_aggregator.h"
#include "tests/status_matchers.h"
#include "worker/micro_batch.h"
#include "worker/model.h"

namespace dbs {
namespace {

double RelativeError(const std::vector<float>& got, const std::vector<float>& want) {
  double diff = 0.0, norm = 0.0;
  for (size_t i = 0; i < want.size(); ++i) {
    diff += (static_cast<double>(got[i]) - want[i]) * (static_cast<double>(got[i]) - want[i]);
    norm += static_cast<double>(want[i]) * want[i];
  }
  return std::sqrt(diff) / std::max(std::sqrt(norm), 1e-30);
}

// Worker `w`'s mean gradient of samples [offset, offset + b): computed at once, or as micro-batches
// of at most `max_batch` (worker/micro_batch.h) when it is above 0.
double WorkerGradient(Net& model, const torch::Tensor& x, const torch::Tensor& y, int offset, int b,
                      int max_batch, absl::Span<float> grad) {
  if (max_batch <= 0) {
    return ComputeGradient(model, x.slice(0, offset, offset + b), y.slice(0, offset, offset + b),
                           grad);
  }
  std::vector<int64_t> indices(static_cast<size_t>(b));
  for (int i = 0; i < b; ++i) indices[static_cast<size_t>(i)] = offset + i;
  std::vector<float> scratch;
  absl::StatusOr<double> loss = ComputeInMicroBatches(
      model.layout(), indices, max_batch,
      [&](absl::Span<const int64_t> some, absl::Span<float> out) -> absl::StatusOr<double> {
        const torch::Tensor at =
            torch::tensor(std::vector<int64_t>(some.begin(), some.end()), torch::kInt64);
        return ComputeGradient(model, x.index_select(0, at), y.index_select(0, at), out);
      },
      grad, &scratch);
  EXPECT_THAT(loss, IsOk());
  return loss.ok() ? *loss : 0.0;
}

// Runs one aggregated step of `batches` (which sum to 64) and returns the new parameters. Each
// worker computes its batch at once, or in micro-batches of at most `max_batch` (above 0).
std::vector<float> AggregatedStep(Net& model, const torch::Tensor& x, const torch::Tensor& y,
                                  const std::vector<int>& batches,
                                  std::unique_ptr<Optimizer> optimizer, int max_batch = 0) {
  const ModelLayout layout = model.layout();
  const size_t n = static_cast<size_t>(TotalElements(layout));
  std::vector<float> init(n);
  CopyParametersTo(model, absl::MakeSpan(init));
  ParameterStore store(std::move(optimizer));
  EXPECT_THAT(store.Register(layout, init), IsOk());
  StepAggregator agg(&store);
  StepQuotas quotas(1);
  for (size_t w = 0; w < batches.size(); ++w) quotas[0][static_cast<int>(w)] = batches[w];
  agg.BeginEpoch(0, quotas);
  std::vector<std::vector<float>> grads(batches.size(), std::vector<float>(n));
  int offset = 0;
  int completed = 0;
  for (size_t w = 0; w < batches.size(); ++w) {
    const int b = batches[w];
    const double loss_sum =
        WorkerGradient(model, x, y, offset, b, max_batch, absl::MakeSpan(grads[w]));
    offset += b;
    GradientPush push{static_cast<int>(w), 0, 0, b, loss_sum, grads[w]};
    agg.Push(push, [&](const absl::StatusOr<StepResult>& r) {
      EXPECT_THAT(r, IsOk()) << r.status();
      ++completed;
    });
  }
  EXPECT_EQ(completed, static_cast<int>(batches.size()));
  return *store.Snapshot()->values;
}

class ExactnessTest : public ::testing::Test {
 protected:
  void SetUp() override {
    torch::manual_seed(3);
    model_ = *MakeBuiltinNet("cnn");
    x_ = torch::randn({64, 1, 28, 28});
    y_ = torch::randint(0, 10, {64}, torch::kInt64);
    const ModelLayout layout = model_->layout();
    n_ = static_cast<size_t>(TotalElements(layout));
    init_.resize(n_);
    CopyParametersTo(*model_, absl::MakeSpan(init_));
  }

  std::unique_ptr<Net> model_;
  torch::Tensor x_, y_;
  size_t n_ = 0;
  std::vector<float> init_;
};

TEST_F(ExactnessTest, AggregatedGradientEqualsTheGlobalBatchGradient) {
  std::vector<float> full(n_);
  ComputeGradient(*model_, x_, y_, absl::MakeSpan(full));
  // With plain SGD at lr 1 the update is exactly the aggregated gradient: g = p0 - p1.
  const std::vector<float> p1 =
      AggregatedStep(*model_, x_, y_, {5, 11, 48},
                     std::make_unique<SgdOptimizer>(SgdConfig{1.0, 0.0, 0.0, false}));
  std::vector<float> aggregated(n_);
  for (size_t i = 0; i < n_; ++i) aggregated[i] = init_[i] - p1[i];
  const double err = RelativeError(aggregated, full);
  std::printf("relative error of the aggregated gradient (5+11+48 vs 64): %.3g\n", err);
  EXPECT_LT(err, 1e-5);

  // The check can tell a wrong aggregation apart: an unweighted mean of the three workers'
  // gradients (what equal-batch S-SGD averaging would do) is far off.
  std::vector<float> unweighted(n_, 0.0f);
  int offset = 0;
  for (int b : {5, 11, 48}) {
    std::vector<float> g(n_);
    ComputeGradient(*model_, x_.slice(0, offset, offset + b), y_.slice(0, offset, offset + b),
                    absl::MakeSpan(g));
    offset += b;
    for (size_t i = 0; i < n_; ++i) unweighted[i] += g[i] / 3.0f;
  }
  const double naive = RelativeError(unweighted, full);
  std::printf("relative error of an unweighted mean: %.3g\n", naive);
  EXPECT_GT(naive, 1e-2);
}

TEST_F(ExactnessTest, UpdatedParametersMatchLibtorchSgdOnOneProcess) {
  const SgdConfig sgd{0.1, 0.9, 1e-4, false};
  const std::vector<float> ours =
      AggregatedStep(*model_, x_, y_, {5, 11, 48}, std::make_unique<SgdOptimizer>(sgd));

  // Reference: one process, 64 samples, torch::optim::SGD.
  LoadParameters(*model_, init_);
  torch::optim::SGD reference(
      model_->Parameters(),
      torch::optim::SGDOptions(sgd.lr).momentum(sgd.momentum).weight_decay(sgd.weight_decay));
  reference.zero_grad();
  torch::nn::functional::cross_entropy(model_->Forward(x_), y_).backward();
  reference.step();
  std::vector<float> want(n_);
  CopyParametersTo(*model_, absl::MakeSpan(want));

  std::vector<float> delta_ours(n_), delta_want(n_);
  for (size_t i = 0; i < n_; ++i) {
    delta_ours[i] = ours[i] - init_[i];
    delta_want[i] = want[i] - init_[i];
  }
  std::printf("relative error vs torch::optim::SGD: parameters %.3g, update %.3g\n",
              RelativeError(ours, want), RelativeError(delta_ours, delta_want));
  EXPECT_LT(RelativeError(ours, want), 1e-5);
  // The update itself, not only the parameters, agrees to 1e-5 relative.
  EXPECT_LT(RelativeError(delta_ours, delta_want), 1e-5);
}

TEST_F(ExactnessTest, UnequalSplitsDoNotChangeTheResult) {
  const std::vector<float> a =
      AggregatedStep(*model_, x_, y_, {5, 11, 48},
                     std::make_unique<SgdOptimizer>(SgdConfig{0.1, 0.0, 0.0, false}));
  LoadParameters(*model_, init_);
  const std::vector<float> b = AggregatedStep(
      *model_, x_, y_, {32, 32}, std::make_unique<SgdOptimizer>(SgdConfig{0.1, 0.0, 0.0, false}));
  LoadParameters(*model_, init_);
  const std::vector<float> c = AggregatedStep(
      *model_, x_, y_, {64}, std::make_unique<SgdOptimizer>(SgdConfig{0.1, 0.0, 0.0, false}));
  EXPECT_LT(RelativeError(a, c), 1e-6);
  EXPECT_LT(RelativeError(b, c), 1e-6);
}

// A worker whose batch is over its --max_batch computes it in micro-batches and pushes their mean:
// the step is still the global batch's (with 20: the 48 as 16 + 16 + 16; with 6: the 11 as 6 + 5,
// the 48 as 8 x 6).
TEST_F(ExactnessTest, MicroBatchesDoNotChangeTheResult) {
  std::vector<float> full(n_);
  ComputeGradient(*model_, x_, y_, absl::MakeSpan(full));
  const std::vector<float> p1 =
      AggregatedStep(*model_, x_, y_, {5, 11, 48},
                     std::make_unique<SgdOptimizer>(SgdConfig{1.0, 0.0, 0.0, false}), 20);
  std::vector<float> aggregated(n_);
  for (size_t i = 0; i < n_; ++i) aggregated[i] = init_[i] - p1[i];
  const double err = RelativeError(aggregated, full);
  std::printf("relative error of the aggregated gradient with micro-batches of <= 20: %.3g\n", err);
  EXPECT_LT(err, 1e-5);
  LoadParameters(*model_, init_);
  const std::vector<float> micro =
      AggregatedStep(*model_, x_, y_, {5, 11, 48},
                     std::make_unique<SgdOptimizer>(SgdConfig{0.1, 0.0, 0.0, false}), 6);
  LoadParameters(*model_, init_);
  const std::vector<float> whole = AggregatedStep(
      *model_, x_, y_, {64}, std::make_unique<SgdOptimizer>(SgdConfig{0.1, 0.0, 0.0, false}));
  EXPECT_LT(RelativeError(micro, whole), 1e-6);
}

TEST(ScriptExactnessTest, ATorchScriptModelAggregatesExactlyToo) {
  // examples/plain_cnn.pt, scripted in Python at build time (no BatchNorm: see docs/models.md).
  absl::StatusOr<std::unique_ptr<Net>> net = LoadScriptNet("examples/plain_cnn.pt", "auto");
  ASSERT_THAT(net, IsOk());
  torch::manual_seed(5);
  const torch::Tensor x = torch::randn({64, 1, 28, 28});
  const torch::Tensor y = torch::randint(0, 10, {64}, torch::kInt64);
  const size_t n = static_cast<size_t>(TotalElements((*net)->layout()));
  std::vector<float> init(n), full(n);
  CopyParametersTo(**net, absl::MakeSpan(init));
  ComputeGradient(**net, x, y, absl::MakeSpan(full));
  const std::vector<float> p1 = AggregatedStep(
      **net, x, y, {5, 11, 48}, std::make_unique<SgdOptimizer>(SgdConfig{1.0, 0.0, 0.0, false}));
  std::vector<float> aggregated(n);
  for (size_t i = 0; i < n; ++i) aggregated[i] = init[i] - p1[i];
  const double err = RelativeError(aggregated, full);
  std::printf("TorchScript model: relative error of the aggregated gradient %.3g\n", err);
  EXPECT_LT(err, 1e-5);
}

// LoadParameters writes straight into contiguous fp32 CPU tensors (not through Tensor::copy_):
// every value lands where CopyParametersTo reads it back, for the built-in models and for a
// TorchScript model with BatchNorm (its running statistics are float buffers of the layout; its
// int64 counters are not in the layout), and each tensor's version counter moves as copy_ would.
TEST(LoadParametersTest, EveryValueLandsInItsTensorAndEachVersionMoves) {
  std::vector<std::unique_ptr<Net>> nets;
  nets.push_back(*MakeBuiltinNet("cnn"));
  nets.push_back(*MakeBuiltinNet("mlp"));
  absl::StatusOr<std::unique_ptr<Net>> bn = LoadScriptNet("examples/resnet_bn.pt", "auto");
  ASSERT_THAT(bn, IsOk());
  nets.push_back(std::move(*bn));
  for (const std::unique_ptr<Net>& net : nets) {
    const size_t n = static_cast<size_t>(TotalElements(net->layout()));
    std::vector<float> values(n);
    for (size_t i = 0; i < n; ++i) values[i] = static_cast<float>(i % 1000) * 0.5f - 250.0f;
    std::vector<int64_t> versions;
    for (const torch::Tensor& t : net->Tensors()) versions.push_back(t._version());
    LoadParameters(*net, values);
    std::vector<float> back(n, -1.0f);
    CopyParametersTo(*net, absl::MakeSpan(back));
    EXPECT_EQ(back, values) << n << " values";
    const std::vector<torch::Tensor> tensors = net->Tensors();
    for (size_t i = 0; i < tensors.size(); ++i) {
      EXPECT_GT(tensors[i]._version(), versions[i]) << net->layout()[i].name;
    }
  }
}

// An export (Net::Export) takes raw inputs: loaded back with torch::jit::load, fed bytes, it
// gives what the worker's network gives the same bytes made ready by PrepareInputs, for the
// built-ins and a TorchScript model, one channel and three; it keeps the mean, std and class
// count; and LoadScriptNet trains the network inside it, with the same values.
TEST(ExportTest, AnExportTakesRawInputsAndKeepsItsNormalisation) {
  struct Case {
    std::unique_ptr<Net> net;
    std::vector<int64_t> shape;
    Normalization norm;
  };
  std::vector<Case> cases;
  cases.push_back({*MakeBuiltinNet("cnn"), {6, 1, 28, 28}, {{0.2860}, {0.3530}, ""}});
  cases.push_back(
      {*MakeBuiltinNet("mlp", {3, 4}, 5), {6, 3, 4}, {{0.5, 0.4, 0.3}, {0.2, 0.25, 0.3}, ""}});
  cases.push_back({*LoadScriptNet("examples/resnet_bn.pt", "auto"), {6, 1, 28, 28}, {}});
  const std::string path = ::testing::TempDir() + "/export.pt";
  for (Case& c : cases) {
    torch::manual_seed(3);
    const torch::Tensor raw = torch::randint(0, 256, c.shape, torch::kInt64).to(torch::kUInt8);
    InputTransform t{c.norm.mean, c.norm.std, {}, 10};
    torch::Tensor mean, std;
    if (c.norm.mean.size() > 1) {
      t.shape = {static_cast<int64_t>(c.norm.mean.size()), 1};
      mean = torch::tensor(c.norm.mean, torch::kFloat64).to(torch::kFloat32).reshape(t.shape);
      std = torch::tensor(c.norm.std, torch::kFloat64).to(torch::kFloat32).reshape(t.shape);
    }
    c.net->SetTraining(false);
    const torch::Tensor want = c.net->Forward(PrepareInputs(raw, c.norm, mean, std)).detach();
    ASSERT_THAT(c.net->Export(path, t), IsOk());
    torch::jit::Module m = torch::jit::load(path);
    const torch::Tensor got = m.forward({raw}).toTensor();
    EXPECT_TRUE(torch::allclose(got, want, 1e-5, 1e-6)) << c.shape;
    const torch::Tensor scaled = m.forward({raw.to(torch::kFloat32) / 255.0}).toTensor();
    EXPECT_TRUE(torch::allclose(scaled, want, 1e-5, 1e-6)) << "floats skip the scaling";
    EXPECT_EQ(m.attr("num_classes").toInt(), 10);
    EXPECT_EQ(m.attr("mean").toDoubleList().vec(), c.norm.mean);
    EXPECT_EQ(m.attr("std").toDoubleList().vec(), c.norm.std);
    // Trained on from the export: the network inside it, with the same values.
    absl::StatusOr<std::unique_ptr<Net>> again = LoadScriptNet(path, "auto");
    ASSERT_THAT(again, IsOk());
    EXPECT_EQ((*again)->layout().size(), c.net->layout().size());
    const size_t n = static_cast<size_t>(TotalElements(c.net->layout()));
    std::vector<float> a(n), b(n);
    CopyParametersTo(*c.net, absl::MakeSpan(a));
    CopyParametersTo(**again, absl::MakeSpan(b));
    EXPECT_EQ(a, b);
  }
}

}  // namespace
}  // namespace dbs
