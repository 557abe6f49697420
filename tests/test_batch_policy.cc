// Batch-size-change policies: the learning-rate multiplier at every step
// around a change, momentum handling, and state round trips.
#include <gtest/gtest.h>

#include "common/error.h"
#include "optim/adam.h"
#include "optim/batch_policy.h"
#include "optim/lr_schedule.h"
#include "train/step.h"

#include <algorithm>
#include <cmath>
#include <string>

using namespace limbo;
using namespace limbo::optim;

namespace {

BatchPolicyOptions opts(BatchPolicyKind kind, int64_t ramp = 8) {
  BatchPolicyOptions o;
  o.kind = kind;
  o.ramp_iterations = ramp;
  return o;
}

// Global batch per iteration: 64 until t=10, 256 until t=30, then 128.
int64_t schedule(int64_t t) { return t < 10 ? 64 : t < 30 ? 256 : 128; }

TEST(BatchPolicy, NoneKeepsTheMultiplier) {
  BatchSizePolicy p(opts(BatchPolicyKind::None));
  for (int64_t t = 0; t < 40; ++t) {
    auto s = p.step(t, schedule(t));
    EXPECT_DOUBLE_EQ(s.multiplier, 1.0) << t;
    EXPECT_EQ(s.changed, t == 10 || t == 30) << t;
  }
}

TEST(BatchPolicy, LinearScalesImmediately) {
  BatchSizePolicy p(opts(BatchPolicyKind::Linear));
  for (int64_t t = 0; t < 40; ++t) {
    double want = t < 10 ? 1.0 : t < 30 ? 4.0 : 2.0;
    EXPECT_DOUBLE_EQ(p.step(t, schedule(t)).multiplier, want) << t;
  }
}

// Adam's square-root rule: the multiplier is sqrt(kappa), switched at once
// (linear policy) or with kappa ramped over T (dynamic); the policy reports
// the kappa in effect for the optimizer's betas and eps; "auto" picks the
// rule by optimizer.
TEST(BatchPolicy, TheSquareRootRuleFollowsKappaLinearlyRampedOrAtOnce) {
  auto o = opts(BatchPolicyKind::Linear);
  o.rule = ScalingRule::Sqrt;
  BatchSizePolicy p(o);
  for (int64_t t = 0; t < 40; ++t) {
    const double kappa = t < 10 ? 1.0 : t < 30 ? 4.0 : 2.0;
    auto s = p.step(t, schedule(t));
    EXPECT_DOUBLE_EQ(s.kappa, kappa) << t;
    EXPECT_DOUBLE_EQ(s.multiplier, std::sqrt(kappa)) << t;
  }
  auto d = opts(BatchPolicyKind::Dynamic, 8);
  d.rule = ScalingRule::Sqrt;
  BatchSizePolicy q(d);
  for (int64_t t = 0; t < 30; ++t) {
    auto s = q.step(t, schedule(t));
    const double kappa = t < 10 ? 1.0 : 1.0 + 3.0 * std::min(1.0, (t - 10) / 8.0);
    EXPECT_DOUBLE_EQ(s.kappa, kappa) << t;
    EXPECT_DOUBLE_EQ(s.multiplier, std::sqrt(kappa)) << t;
  }
  EXPECT_EQ(parse_scaling_rule("auto", "adamw"), ScalingRule::Sqrt);
  EXPECT_EQ(parse_scaling_rule("auto", "adam"), ScalingRule::Sqrt);
  EXPECT_EQ(parse_scaling_rule("auto", "sgd"), ScalingRule::Linear);
  EXPECT_EQ(parse_scaling_rule("linear", "adamw"), ScalingRule::Linear);
  EXPECT_THROW(parse_scaling_rule("cubic", "sgd"), InvalidInput);
}

TEST(BatchPolicy, DynamicRampsUpOverTAndDropsAtOnce) {
  BatchSizePolicy p(opts(BatchPolicyKind::Dynamic, 8));
  for (int64_t t = 0; t < 40; ++t) {
    double want;
    if (t < 10) want = 1.0;
    else if (t < 30) want = 1.0 + 3.0 * std::min(1.0, (t - 10) / 8.0);  // every ramp step
    else want = 2.0;  // shrink: immediate
    EXPECT_NEAR(p.step(t, schedule(t)).multiplier, want, 1e-12) << t;
  }
}

// A shrink while a ramp up is unfinished: mid-ramp at 1.75 towards 4 (batch
// 64 -> 256, T = 8, three steps in), the batch shrinks to 128 (target 2).
// The multiplier must not jump up to 2: it goes on from 1.75 and reaches 2
// gradually, and it never rises at the shrink itself.
TEST(BatchPolicy, AShrinkMidRampNeverRaisesTheRate) {
  for (bool ramp_down : {false, true}) {
    auto o = opts(BatchPolicyKind::Dynamic, 8);
    o.ramp_down = ramp_down;
    BatchSizePolicy p(o);
    for (int64_t t = 0; t < 10; ++t) p.step(t, 64);
    double m = 0;
    for (int64_t t = 10; t <= 13; ++t) m = p.step(t, 256).multiplier;
    ASSERT_NEAR(m, 2.125, 1e-12);  // 1 + 3 * 3/8 at t = 13
    // At 2.125 the new target 2 lies below: the shrink lowers the rate.
    auto s = p.step(14, 128);
    EXPECT_TRUE(s.changed);
    EXPECT_LE(s.multiplier, m + 1e-12);
    // The reported case: a ramp 1 -> 4 from t = 10 is at 1.75 at t = 12.
    BatchSizePolicy q(o);
    for (int64_t t = 0; t < 10; ++t) q.step(t, 64);
    for (int64_t t = 10; t <= 12; ++t) m = q.step(t, 256).multiplier;
    ASSERT_NEAR(m, 1.75, 1e-12);
    auto at_shrink = q.step(13, 128);
    EXPECT_TRUE(at_shrink.changed);
    EXPECT_NEAR(at_shrink.multiplier, 1.75, 1e-12) << "ramp_down " << ramp_down;
    double prev = at_shrink.multiplier;
    for (int64_t t = 14; t < 40; ++t) {
      double now = q.step(t, 128).multiplier;
      EXPECT_GE(now, prev - 1e-12);        // continuous, towards the target
      EXPECT_LE(now, 2.0 + 1e-12);         // never above the new target
      EXPECT_LE(now - prev, 0.25 / 8 * 2 + 1e-12);  // no jump
      prev = now;
    }
    EXPECT_NEAR(prev, 2.0, 1e-12);
  }
}

TEST(BatchPolicy, DynamicCanRampDownToo) {
  auto o = opts(BatchPolicyKind::Dynamic, 8);
  o.ramp_down = true;
  BatchSizePolicy p(o);
  for (int64_t t = 0; t < 40; ++t) {
    double want = t < 10 ? 1.0 : t < 30 ? 1.0 + 3.0 * std::min(1.0, (t - 10) / 8.0)
                                        : 4.0 - 2.0 * std::min(1.0, (t - 30) / 8.0);
    EXPECT_NEAR(p.step(t, schedule(t)).multiplier, want, 1e-12) << t;
  }
}

TEST(BatchPolicy, AChangeDuringARampStartsFromTheCurrentMultiplier) {
  BatchSizePolicy p(opts(BatchPolicyKind::Dynamic, 10));
  p.step(0, 64);
  for (int64_t t = 1; t <= 5; ++t) p.step(t, 320);  // ramp 1 -> 5, halfway at t=6
  double mid = p.step(6, 320).multiplier;
  EXPECT_NEAR(mid, 3.0, 1e-12);
  // Grow again to 640 (m = 10): ramp from 3 to 10 over 10 steps.
  EXPECT_NEAR(p.step(7, 640).multiplier, 3.0, 1e-12);
  EXPECT_NEAR(p.step(12, 640).multiplier, 6.5, 1e-12);
  EXPECT_NEAR(p.step(17, 640).multiplier, 10.0, 1e-12);
  EXPECT_NEAR(p.step(50, 640).multiplier, 10.0, 1e-12);
}

TEST(BatchPolicy, ReferenceBatchSetsTheScale) {
  auto o = opts(BatchPolicyKind::Linear);
  o.reference_batch = 32;
  BatchSizePolicy p(o);
  EXPECT_DOUBLE_EQ(p.step(0, 64).multiplier, 2.0);
  EXPECT_DOUBLE_EQ(p.step(1, 16).multiplier, 0.5);
}

TEST(BatchPolicy, MomentumFactorsAtChangesOnly) {
  auto o = opts(BatchPolicyKind::Linear);
  o.momentum = MomentumOnChange::Reset;
  BatchSizePolicy reset(o);
  o.momentum = MomentumOnChange::Rescale;
  BatchSizePolicy rescale(o);
  o.momentum = MomentumOnChange::Keep;
  BatchSizePolicy keep(o);
  for (int64_t t = 0; t < 40; ++t) {
    bool change = t == 10 || t == 30;
    EXPECT_DOUBLE_EQ(reset.step(t, schedule(t)).momentum_factor, change ? 0.0 : 1.0) << t;
    EXPECT_DOUBLE_EQ(keep.step(t, schedule(t)).momentum_factor, 1.0) << t;
    double want = t == 10 ? 0.25 : t == 30 ? 2.0 : 1.0;  // m_before / m_after
    EXPECT_DOUBLE_EQ(rescale.step(t, schedule(t)).momentum_factor, want) << t;
  }
}

TEST(BatchPolicy, StateRoundTripContinuesTheRamp) {
  BatchSizePolicy a(opts(BatchPolicyKind::Dynamic, 8));
  for (int64_t t = 0; t < 13; ++t) a.step(t, schedule(t));  // mid-ramp
  BatchSizePolicy b(opts(BatchPolicyKind::Dynamic, 8));
  b.load_state(a.state());
  for (int64_t t = 13; t < 40; ++t)
    EXPECT_DOUBLE_EQ(a.step(t, schedule(t)).multiplier, b.step(t, schedule(t)).multiplier) << t;
  EXPECT_THROW(b.load_state(torch::zeros({2}, torch::kFloat64)), InvalidInput);
}

TEST(BatchPolicy, ParsesNames) {
  EXPECT_EQ(parse_batch_policy("dynamic"), BatchPolicyKind::Dynamic);
  EXPECT_THROW(parse_batch_policy("adascale"), InvalidInput);
  EXPECT_EQ(parse_momentum_on_change("rescale"), MomentumOnChange::Rescale);
  EXPECT_THROW(parse_momentum_on_change("zero"), InvalidInput);
}

}  // namespace

// Suspicion S2, confirmed: under the square-root rule (1 - beta1) * kappa
// reaches 1 at kappa = 10 for beta1 = 0.9, and Adam's momentum is then off
// (a job started on 1 worker that grows to 10). It is now said once, with
// what to set: elastic.reference_batch = the largest global batch keeps
// kappa at most 1, where no beta is lost and nothing is said.
TEST(BatchPolicy, TheSquareRootRuleSaysWhenItTurnsAdamsMomentumOff) {
  OptimizerOptions adam;
  adam.algorithm = "adamw";
  EXPECT_EQ(sqrt_rule_warning(adam, 9.9), "");
  const std::string w = sqrt_rule_warning(adam, 10.0);
  EXPECT_NE(w.find("beta1 = 0.900 (momentum)"), std::string::npos) << w;
  EXPECT_EQ(w.find("beta2"), std::string::npos) << w;
  EXPECT_NE(w.find("elastic.reference_batch"), std::string::npos) << w;
  EXPECT_NE(sqrt_rule_warning(adam, 1000.0).find("beta2"), std::string::npos);
  OptimizerOptions sgd;
  EXPECT_EQ(sqrt_rule_warning(sgd, 1000.0), "");
  // Through the step's policy: 1 worker of batch 8, then 10. Said once.
  auto run = [&](int64_t reference) {
    BatchPolicyOptions o;
    o.kind = BatchPolicyKind::Linear;
    o.rule = ScalingRule::Sqrt;
    o.reference_batch = reference;
    BatchSizePolicy policy(o);
    LrScheduleOptions lo;
    lo.kind = "constant";
    LrSchedule schedule(lo);
    auto opt = make_optimizer(adam);
    double worst_kappa = 0;
    ::testing::internal::CaptureStderr();
    for (int64_t t = 0; t < 20; ++t) {
      auto p = train::policy_step(policy, schedule, *opt, 0.0, t, t < 5 ? 8 : 80);
      worst_kappa = std::max(worst_kappa, p.policy.kappa);
    }
    return std::make_pair(::testing::internal::GetCapturedStderr(), worst_kappa);
  };
  const auto [grown, kappa] = run(0);
  EXPECT_DOUBLE_EQ(kappa, 10.0);
  size_t said = 0;
  for (size_t at = grown.find("turns beta1"); at != std::string::npos; at = grown.find("turns beta1", at + 1)) ++said;
  EXPECT_EQ(said, 1u) << grown;
  const auto [planned, planned_kappa] = run(80);  // the largest global batch as the reference
  EXPECT_DOUBLE_EQ(planned_kappa, 1.0);
  EXPECT_EQ(planned.find("square-root"), std::string::npos) << planned;
}
