// Samplers (determinism, fixed cycles, sharding, exact resume) and the
// background batch loader.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <set>
#include <random>
#include <thread>

#include "common/error.h"
#include "data/loader.h"
#include "data/pace_shares.h"
#include "data/sampler.h"
#include "data/synthetic.h"

using namespace limbo::data;

namespace {

TEST(Sampler, ShuffleIsDeterministicPerSeedAndChangesPerEpoch) {
  Sampler a(1000, Order::Shuffle, 7), b(1000, Order::Shuffle, 7), c(1000, Order::Shuffle, 8);
  auto e0 = a.epoch_order(0);
  EXPECT_EQ(e0, b.epoch_order(0));
  EXPECT_NE(e0, c.epoch_order(0));
  EXPECT_NE(e0, a.epoch_order(1));
  std::vector<int64_t> sorted = e0;
  std::sort(sorted.begin(), sorted.end());
  for (int64_t i = 0; i < 1000; ++i) ASSERT_EQ(sorted[i], i);  // a permutation
}

TEST(Sampler, FixedCycleRepeatsTheSameShuffledOrder) {
  Sampler s(500, Order::FixedCycle, 3);
  auto e0 = s.epoch_order(0);
  EXPECT_EQ(e0, s.epoch_order(1));
  EXPECT_EQ(e0, s.epoch_order(17));
  std::vector<int64_t> iota(500);
  std::iota(iota.begin(), iota.end(), 0);
  EXPECT_NE(e0, iota);
  Sampler q(5, Order::Sequential, 3);
  EXPECT_EQ(q.epoch_order(4), (std::vector<int64_t>{0, 1, 2, 3, 4}));
}

// Walks one epoch with `world` workers; returns every id seen.
std::vector<int64_t> one_epoch(Sampler& s, int64_t b, int world, bool drop_last, int64_t* batches) {
  std::vector<int64_t> seen;
  Cursor c{0, 0};
  *batches = 0;
  for (;;) {
    BatchPlan first;
    for (int r = 0; r < world; ++r) {
      auto p = plan_batch(s, c, b, world, r, drop_last);
      if (r == 0) first = p;
      EXPECT_EQ(p.end, first.end);
      // A remainder of fewer samples than members joins the last batch: one more at most.
      EXPECT_LE(static_cast<int64_t>(p.ids.size()), b + 1);
      EXPECT_GE(p.ids.size(), 1u) << "an empty slice";
      if (s.dataset_size() >= world) EXPECT_FALSE(p.padded);
      if (!p.padded) seen.insert(seen.end(), p.ids.begin(), p.ids.end());
    }
    ++*batches;
    c = first.end;
    if (first.last_in_epoch) break;
  }
  EXPECT_EQ(c, (Cursor{1, 0}));
  return seen;
}

class ShardTest : public ::testing::TestWithParam<int> {};

TEST_P(ShardTest, ShardsCoverTheEpochExactlyOnce) {
  const int world = GetParam();
  Sampler s(1003, Order::Shuffle, 5);
  int64_t batches = 0;
  auto seen = one_epoch(s, 16, world, false, &batches);
  EXPECT_EQ(batches, batches_per_epoch(1003, 16 * world, false, world));
  std::set<int64_t> uniq(seen.begin(), seen.end());
  EXPECT_EQ(seen.size(), 1003u);
  EXPECT_EQ(uniq.size(), 1003u);
  seen = one_epoch(s, 16, world, true, &batches);
  EXPECT_EQ(batches, 1003 / (16 * world));
  EXPECT_EQ(seen.size(), static_cast<size_t>(batches * 16 * world));
}

INSTANTIATE_TEST_SUITE_P(Worlds, ShardTest, ::testing::Values(1, 2, 3, 7));

// Found from Python: 1,025 samples, 2 members of 16 left one sample for the
// epoch's last step, and the member dealt nothing died in its collate (its
// mean loss was NaN with a fetch function). A remainder smaller than the
// group joins the batch before it: every slice holds a sample.
TEST(Sampler, ARemainderSmallerThanTheGroupJoinsTheLastBatch) {
  for (auto [n, world] : std::vector<std::pair<int64_t, int>>{{1025, 2}, {1009, 3}, {242, 3}, {113, 7}}) {
    Sampler s(n, Order::Shuffle, 3);
    int64_t batches = 0;
    auto seen = one_epoch(s, 16, world, false, &batches);
    EXPECT_EQ(batches, batches_per_epoch(n, 16 * world, false, world)) << n << " " << world;
    EXPECT_EQ(batches, n / (16 * world)) << n << " " << world;
    EXPECT_EQ(std::set<int64_t>(seen.begin(), seen.end()).size(), static_cast<size_t>(n));
    EXPECT_EQ(seen.size(), static_cast<size_t>(n));
  }
  // A group larger than what is left when its step starts (it grew after
  // the batch before was cut): the empty slices are padded with a sample of
  // another slice, of weight 0; each sample still counts once.
  Sampler s(10, Order::Sequential, 1);
  std::vector<int64_t> seen;
  int padded = 0;
  for (int r = 0; r < 4; ++r) {
    auto p = plan_batch(s, Cursor{0, 8}, 4, 4, r, false);
    ASSERT_EQ(p.ids.size(), 1u);
    EXPECT_TRUE(p.last_in_epoch);
    EXPECT_EQ(p.samples(), p.padded ? 0 : 1);
    if (p.padded) {
      ++padded;
      EXPECT_TRUE(p.ids[0] == 8 || p.ids[0] == 9) << p.ids[0];
    } else {
      seen.insert(seen.end(), p.ids.begin(), p.ids.end());
    }
  }
  EXPECT_EQ(padded, 2);
  EXPECT_EQ(seen, (std::vector<int64_t>{8, 9}));
}

TEST(Sampler, WorldSizeChangeMidEpochNeitherRepeatsNorSkips) {
  Sampler s(400, Order::Shuffle, 9);
  std::multiset<int64_t> seen;
  Cursor c{0, 0};
  int world = 1, step = 0;
  while (c.epoch == 0) {
    world = 1 + (step++ % 4);  // 1, 2, 3, 4, 1, ...
    BatchPlan p0;
    for (int r = 0; r < world; ++r) {
      auto p = plan_batch(s, c, 10, world, r, false);
      if (r == 0) p0 = p;
      seen.insert(p.ids.begin(), p.ids.end());
    }
    c = p0.end;
  }
  EXPECT_EQ(seen.size(), 400u);
  for (int64_t i = 0; i < 400; ++i) EXPECT_EQ(seen.count(i), 1u) << i;
}

TEST(Sampler, ResumeFromCursorContinuesTheSameSequence) {
  Sampler a(300, Order::Shuffle, 4);
  std::vector<std::vector<int64_t>> full;
  Cursor c{0, 0};
  for (int i = 0; i < 25; ++i) {  // crosses two epoch boundaries (300/32)
    auto p = plan_batch(a, c, 32, 1, 0, false);
    full.push_back(p.ids);
    c = p.end;
  }
  // A fresh sampler (as after a restart) from the cursor after batch 13.
  Sampler b(300, Order::Shuffle, 4);
  Cursor r{0, 0};
  for (int i = 0; i < 13; ++i) r = plan_batch(a, r, 32, 1, 0, false).end;
  for (int i = 13; i < 25; ++i) {
    auto p = plan_batch(b, r, 32, 1, 0, false);
    EXPECT_EQ(p.ids, full[i]) << "batch " << i;
    r = p.end;
  }
}

// Shares by pace: slices in proportion to the weights, at least one sample
// each, the global batch and the cursor as with equal slices.
TEST(Sampler, WeightedSlicesFollowTheWeightsAndCoverTheEpochOnce) {
  EXPECT_EQ(slice_bounds(10, 3), (std::vector<int64_t>{0, 3, 6, 10}));
  EXPECT_EQ(slice_bounds(10, 3, {1, 1, 1}), slice_bounds(10, 3));
  EXPECT_EQ(slice_bounds(96, 2, {2, 1}), (std::vector<int64_t>{0, 64, 96}));
  EXPECT_EQ(slice_bounds(7, 3, {1000000, 1, 1}), (std::vector<int64_t>{0, 5, 6, 7}));  // one each at least
  EXPECT_EQ(slice_bounds(7, 3, {1, 1, 1000000}), (std::vector<int64_t>{0, 1, 2, 7}));
  EXPECT_THROW(slice_bounds(7, 3, {1, 1}), limbo::Error);
  Sampler s(1003, Order::Shuffle, 5);
  const std::vector<int64_t> w{5, 3, 1};
  std::multiset<int64_t> seen;
  Cursor c{0, 0};
  int64_t batches = 0;
  while (c.epoch == 0) {
    BatchPlan p0;
    for (int r = 0; r < 3; ++r) {
      auto p = plan_batch(s, c, 16, 3, r, false, w);
      if (r == 0) p0 = p;
      EXPECT_EQ(p.end, p0.end);
      EXPECT_EQ(p.global_size, p0.global_size);
      if (p0.global_size == 48) EXPECT_EQ(p.ids.size(), (std::vector<size_t>{26, 16, 6})[r]);
      seen.insert(p.ids.begin(), p.ids.end());
    }
    c = p0.end;
    ++batches;
  }
  EXPECT_EQ(batches, batches_per_epoch(1003, 48, false, 3));
  EXPECT_EQ(seen.size(), 1003u);
  for (int64_t i = 0; i < 1003; ++i) ASSERT_EQ(seen.count(i), 1u) << i;
}

// Two members fed the same publications compute the same weights; shares
// move towards the paces by bounded steps, stay above the floor, and hold
// only from `lag` steps after their publication.
TEST(PaceShares, AgreedPacesMoveTheSharesAlikeWithinTheirBounds) {
  PaceShares::Options o;
  o.period = 4;
  o.lag = 6;
  o.alpha = 0.5;
  o.max_move = 0.1;
  o.floor = 0.2;
  PaceShares a(o), b(o);
  a.reset(2, 10);
  b.reset(2, 10);
  EXPECT_EQ(*a.weights_for(10), (std::vector<int64_t>{PaceShares::kScale / 2, PaceShares::kScale / 2}));
  EXPECT_FALSE(a.publishes(10));
  EXPECT_TRUE(a.publishes(14));
  EXPECT_FALSE(a.publishes(15));
  // Steps before the first publication's effect are known; after it, not yet.
  EXPECT_TRUE(a.weights_for(19).has_value());
  EXPECT_FALSE(a.weights_for(20).has_value());
  a.record(64, 1.0);  // member 0: 64 samples/s
  b.record(16, 1.0);  // member 1: 16 samples/s
  auto pa = a.publication(0), pb = b.publication(1);
  std::vector<float> sum{pa[0] + pb[0], pa[1] + pb[1]};
  EXPECT_EQ(sum, (std::vector<float>{64.0f, 16.0f}));
  a.agreed(14, sum);
  b.agreed(14, sum);
  EXPECT_EQ(*a.weights_for(19), *b.weights_for(19));
  EXPECT_EQ((*a.weights_for(19))[0], PaceShares::kScale / 2);  // not yet in force
  auto w = *a.weights_for(20);
  EXPECT_EQ(w, *b.weights_for(20));
  EXPECT_NEAR(static_cast<double>(w[0]) / (w[0] + w[1]), 0.6, 1e-4);  // moved max_move towards 0.8
  EXPECT_FALSE(a.weights_for(24).has_value());  // the publication of step 18 is not agreed
  for (int64_t p = 18; p <= 60; p += 4) a.agreed(p, sum);
  const auto s = a.shares_at(66);
  EXPECT_NEAR(s[0], 0.8, 0.01);
  EXPECT_NEAR(s[1], 0.2, 0.01);
  // A member at a tiny pace keeps the floor (0.2 of the equal share).
  for (int64_t p = 64; p <= 120; p += 4) a.agreed(p, {1000.0f, 0.001f});
  EXPECT_NEAR(a.shares_at(126)[1], 0.1, 0.01);
  // A member that measured nothing: the shares stay.
  const auto before = a.shares_at(126);
  a.agreed(124, {0.0f, 5.0f});
  EXPECT_EQ(a.shares_at(130), before);
  // A new group starts equal.
  a.reset(3, 200);
  EXPECT_EQ(a.shares_at(200).size(), 3u);
  EXPECT_NEAR(a.shares_at(200)[2], 1.0 / 3, 1e-4);
  EXPECT_TRUE(a.last_paces().empty());
}

// Two members fed the same paces every step (publication and agreement as
// the reduction does them); the second member's share in force at each step.
static std::vector<double> shares_over(PaceShares::Options o, const std::vector<double>& pace0,
                                       const std::vector<double>& pace1) {
  PaceShares m0(o), m1(o);
  m0.reset(2, 0);
  m1.reset(2, 0);
  std::vector<double> out;
  for (int64_t step = 0; step < static_cast<int64_t>(pace0.size()); ++step) {
    out.push_back(m0.shares_at(step)[1]);
    // 0.1 s a step at 10,000 samples/s; a step lasts as long as its slowest
    const double wall = std::max(1000.0 / pace0[step], 1000.0 / pace1[step]);
    m0.record(1000, 1000.0 / pace0[step], wall);
    m1.record(1000, 1000.0 / pace1[step], wall);
    if (m0.publishes(step)) {
      auto a = m0.publication(0), b = m1.publication(1);
      std::vector<float> sum{a[0] + b[0], a[1] + b[1]};
      m0.agreed(step, sum);
      m1.agreed(step, sum);
      EXPECT_EQ(*m0.weights_for(step + o.lag), *m1.weights_for(step + o.lag));
    }
  }
  return out;
}

// The defaults publish every step: with steps of 0.1 s, when a member's
// pace falls to 30 % the shares cover three quarters of their move within
// lag + 4 steps; a pace that jitters by +-30 % from step to step (a noisy
// machine) moves the shares far less than shares by each step's pace.
TEST(PaceShares, SharesFollowAChangeOfPaceWithinAFewStepsAndDoNotSwingWithNoise) {
  PaceShares::Options o;  // the defaults
  o.lag = 6;
  ASSERT_EQ(o.period, 1);
  std::vector<double> fast(130, 10000.0), slow(60, 10000.0);
  slow.resize(130, 3000.0);
  const auto s = shares_over(o, fast, slow);
  EXPECT_NEAR(s[60], 0.5, 1e-3);
  const double settled = s[125];
  EXPECT_NEAR(settled, 0.3 / 1.3, 0.01);
  int64_t followed = -1;
  for (int64_t k = 60; k < 126 && followed < 0; ++k)
    if (s[k] - settled <= 0.25 * (0.5 - settled)) followed = k - 60;
  EXPECT_GE(followed, o.lag);  // nothing acts before its lag
  EXPECT_LE(followed, o.lag + 4);

  std::mt19937 rng(7);
  std::uniform_real_distribution<double> jitter(0.7, 1.3);
  std::vector<double> p0, p1;
  for (int i = 0; i < 400; ++i) {
    p0.push_back(10000.0 * jitter(rng));
    p1.push_back(10000.0 * jitter(rng));
  }
  auto spread = [](const std::vector<double>& v) {
    double m = 0, q = 0;
    for (double x : v) m += x / v.size();
    for (double x : v) q += (x - m) * (x - m) / v.size();
    return std::sqrt(q);
  };
  PaceShares::Options each_step = o;  // each step's pace alone
  each_step.memory = 1e-6;
  auto tail = [](std::vector<double> v) { return std::vector<double>(v.begin() + 100, v.end()); };
  const double smoothed = spread(tail(shares_over(o, p0, p1)));
  const double raw = spread(tail(shares_over(each_step, p0, p1)));
  std::printf("followed in %d steps (lag %d); share spread %.4f, by each step's pace %.4f\n",
              static_cast<int>(followed), static_cast<int>(o.lag), smoothed, raw);
  EXPECT_LT(smoothed, 0.7 * raw) << smoothed << " " << raw;
  EXPECT_LT(smoothed, 0.04);
}

// A loader thread waits for the shares of a step ahead until they are agreed.
TEST(PaceShares, ALoaderWaitsForSharesNotYetAgreed) {
  PaceShares::Options o;
  o.period = 2;
  o.lag = 3;
  PaceShares s(o);
  s.reset(2, 0);
  std::atomic<bool> got{false};
  std::thread t([&] {
    auto w = s.wait_weights_for(5, nullptr);
    got = !w.empty();
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(120));
  EXPECT_FALSE(got.load());
  s.agreed(2, {1.0f, 1.0f});
  t.join();
  EXPECT_TRUE(got.load());
  EXPECT_TRUE(s.wait_weights_for(7, [] { return true; }).empty());  // given up: equal shares
}

TEST(Sampler, RejectsBadArguments) {
  Sampler s(10, Order::Shuffle, 1);
  EXPECT_THROW(plan_batch(s, {0, 0}, 0, 1, 0, false), limbo::InvalidInput);
  EXPECT_THROW(plan_batch(s, {0, 0}, 4, 2, 2, false), limbo::InvalidInput);
  EXPECT_THROW(Sampler(0, Order::Shuffle, 1), limbo::InvalidInput);
  EXPECT_THROW(parse_order("random"), limbo::InvalidInput);
}

TEST(Loader, DeliversPlannedBatchesInOrderAndRestarts) {
  SyntheticOptions o;
  o.train_size = 100;
  auto splits = make_synthetic(o);
  auto ds = std::make_shared<Dataset>(splits.train);
  auto norm = compute_normalization(*ds);
  LoaderOptions lo;
  lo.batch_size = 8;
  lo.seed = 3;
  BatchLoader loader(ds, norm, lo, Cursor{0, 0});
  Sampler ref(100, Order::Shuffle, 3);
  Cursor c{0, 0};
  for (int i = 0; i < 30; ++i) {  // 13 batches per epoch: crosses epochs
    auto b = loader.next();
    auto p = plan_batch(ref, c, 8, 1, 0, false);
    ASSERT_EQ(b.plan.ids, p.ids) << i;
    ASSERT_EQ(b.x.size(0), static_cast<int64_t>(p.ids.size()));
    EXPECT_EQ(b.y[0].item<int64_t>(), ds->labels[p.ids[0]]);
    float expect = (ds->image(p.ids[0])[5] / 255.0f - norm.mean[0]) / norm.std[0];
    EXPECT_NEAR(b.x[0][0][0][5].item<float>(), expect, 1e-5);
    c = p.end;
  }
  // After a restart with another world size, batches follow the new plan.
  loader.restart(Cursor{2, 40}, 2, 1);
  auto b = loader.next();
  EXPECT_EQ(b.plan.ids, plan_batch(ref, Cursor{2, 40}, 8, 2, 1, false).ids);
}

TEST(Loader, ProducerErrorsReachTheConsumer) {
  auto ds = std::make_shared<Dataset>(make_synthetic(SyntheticOptions{}).train);
  LoaderOptions lo;
  lo.batch_size = 0;  // invalid: plan_batch throws on the loader thread
  BatchLoader loader(ds, compute_normalization(*ds), lo, Cursor{0, 0});
  EXPECT_THROW(loader.next(), limbo::InvalidInput);
}

}  // namespace
