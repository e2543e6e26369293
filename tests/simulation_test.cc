#include "bench/simulation.h"

#include "gtest/gtest.h"

namespace dbs {
namespace {

SimulationConfig Config(double c0, double c1) {
  SimulationConfig c;
  c.speeds = {100, 100, 200, 400};
  c.comm_base_seconds = c0;
  c.comm_per_worker_seconds = c1;
  c.train_samples = 12800;
  c.global_batch = 128;
  c.epochs = 3;
  return c;
}

TEST(SimulationTest, WithoutCommunicationDbsReachesTheIdealAndSsgdWaitsForTheSlowest) {
  SimulationConfig c = Config(0, 0);
  c.policy = "fixed";
  auto sgd = Simulate(c);
  ASSERT_TRUE(sgd.ok()) << sgd.status();
  // 100 steps of 32 samples at the slowest 100/s: 32 s; ideal 12800 / 800 = 16 s.
  EXPECT_NEAR(sgd->SteadyEpochSeconds(), 32.0, 1e-9);
  EXPECT_NEAR(sgd->ideal_epoch_seconds, 16.0, 1e-9);
  c.policy = "dbs";
  auto dbs_run = Simulate(c);
  ASSERT_TRUE(dbs_run.ok());
  EXPECT_NEAR(dbs_run->epoch_seconds[0], 32.0, 1e-9) << "epoch 0 is the equal split";
  EXPECT_EQ(dbs_run->batch_sizes[1], (std::vector<int>{16, 16, 32, 64}));
  EXPECT_NEAR(dbs_run->SteadyEpochSeconds(), 16.0, 1e-9);
}

TEST(SimulationTest, CommunicationShrinksTheGain) {
  double previous_ratio = 0.0;
  for (double c1 : {0.0, 0.01, 0.05, 0.2}) {
    SimulationConfig c = Config(0.0, c1);
    c.policy = "fixed";
    const double sgd = Simulate(c)->SteadyEpochSeconds();
    c.policy = "dbs";
    const double dbs_time = Simulate(c)->SteadyEpochSeconds();
    const double ratio = dbs_time / sgd;
    EXPECT_GT(ratio, previous_ratio) << "c1 = " << c1;
    EXPECT_LE(ratio, 1.0 + 1e-9);
    previous_ratio = ratio;
  }
}

TEST(SimulationTest, RejectsBadInput) {
  SimulationConfig c = Config(0, 0);
  c.speeds = {};
  EXPECT_FALSE(Simulate(c).ok());
  c.speeds = {1.0, 0.0};
  EXPECT_FALSE(Simulate(c).ok());
}

}  // namespace
}  // namespace dbs
