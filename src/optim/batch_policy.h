// Learning-rate policies for a changing global batch (elastic training).
//
// The per-worker batch b is fixed, so the global batch is B = b * R and moves
// when the worker count R does. The policy follows the batch ratio
// kappa = B / B_ref against the reference batch B_ref at which the
// hyperparameters were tuned (default: the global batch at the start), and a
// scaling rule turns kappa into a multiplier on the scheduled learning rate:
//
//   linear   m = kappa (SGD: Goyal et al.; Dynamic SGD), the default for SGD;
//   sqrt     m = sqrt(kappa) (Malladi et al., NeurIPS 2022, the square-root
//            rule for adaptive methods), the default for Adam and AdamW,
//            which also scale (1 - beta1) and (1 - beta2) by kappa and eps
//            by 1 / sqrt(kappa) (Optimizer::set_batch_scale).
//
// How kappa moves at a change of B:
//   none     kappa = B_0 / B_ref, whatever happens later (no rescaling);
//   linear   kappa = B / B_ref, switched immediately at a change;
//   dynamic  Dynamic SGD (Lin et al.): after a change at iteration t0 from
//            k_old to k_new = B / B_ref, kappa moves linearly,
//            k(t) = k_old + (k_new - k_old) * min(1, (t - t0) / T),
//            when the batch grows. When it shrinks it drops at once (default),
//            because a ramp down keeps a too-large step for the now noisier
//            batch; `ramp_down` ramps in both directions instead. A change
//            during a ramp starts from the multiplier in effect then, and a
//            shrink never raises it: when a shrink's target is still above
//            the multiplier (an unfinished ramp up), the ramp goes on from
//            there to the lower target.
//
// (Below, "the multiplier" of the original Dynamic SGD is kappa; with the
// linear rule the two are the same.)
//
// Momentum at a change: keep the buffer (default, as the re-implementations
// do), reset it to zero, or rescale it by the multiplier's jump at the change
// (m just before / m just after) so that the step the buffer contributes
// (lr * v) stays continuous. A dynamic ramp up has no jump (factor 1).
#pragma once

#include <torch/torch.h>

#include <cstdint>
#include <string>

namespace limbo::optim {

enum class BatchPolicyKind { None, Linear, Dynamic };
enum class MomentumOnChange { Keep, Reset, Rescale };
enum class ScalingRule { Linear, Sqrt };

struct BatchPolicyOptions {
  BatchPolicyKind kind = BatchPolicyKind::Dynamic;
  int64_t reference_batch = 0;  // 0 = the first global batch seen
  int64_t ramp_iterations = 200;  // T
  bool ramp_down = false;
  MomentumOnChange momentum = MomentumOnChange::Keep;
  ScalingRule rule = ScalingRule::Linear;
};

class BatchSizePolicy {
 public:
  explicit BatchSizePolicy(BatchPolicyOptions opt);  // throws InvalidInput

  struct Step {
    double multiplier = 1.0;       // apply to the scheduled learning rate
    double kappa = 1.0;            // the batch ratio in effect (ramped); Optimizer::set_batch_scale
    bool changed = false;          // the global batch changed at this step
    double momentum_factor = 1.0;  // multiply the momentum buffer by this (0 = reset)
  };
  // Whether the square-root rule's loss of a beta was said (once a run).
  bool warned_about_betas() const { return warned_betas_; }
  void set_warned_about_betas() { warned_betas_ = true; }
  // Called once per step, in order, with the global batch of that step.
  Step step(int64_t iteration, int64_t global_batch);

  double multiplier() const { return scaled(current_); }
  double kappa() const { return current_; }
  // Reference batch, ramp and last batch as a tensor (for checkpoints), and back.
  torch::Tensor state() const;
  void load_state(const torch::Tensor& t);
  const BatchPolicyOptions& options() const { return opt_; }

 private:
  double target(int64_t global_batch) const;
  double ramp_value(int64_t iteration) const;
  double scaled(double kappa) const;  // the rule: kappa or sqrt(kappa)

  BatchPolicyOptions opt_;
  int64_t reference_ = 0;
  int64_t last_batch_ = 0;
  double from_ = 1.0, to_ = 1.0, current_ = 1.0;
  bool warned_betas_ = false;
  int64_t ramp_start_ = 0;
};

BatchPolicyKind parse_batch_policy(const std::string& s);
// "linear" | "sqrt"; "auto" picks linear for sgd, sqrt for adam / adamw.
ScalingRule parse_scaling_rule(const std::string& s, const std::string& algorithm);
MomentumOnChange parse_momentum_on_change(const std::string& s);

}  // namespace limbo::optim
