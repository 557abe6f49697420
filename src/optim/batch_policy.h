// Learning-rate policies for a changing global batch (elastic training).
//
// The per-worker batch b is fixed, so the global batch is B = b * R and moves
// when the worker count R does. The policy turns B into a multiplier on the
// scheduled learning rate, relative to the reference batch B_ref at which the
// base learning rate was tuned (default: the global batch at the start):
//
//   none     m = B_0 / B_ref, whatever happens later (no rescaling);
//   linear   m = B / B_ref, switched immediately at a change;
//   dynamic  Dynamic SGD (Lin et al.): after a change at iteration t0 from
//            m_old to m_new = B / B_ref, the multiplier moves linearly,
//            m(t) = m_old + (m_new - m_old) * min(1, (t - t0) / T),
//            when the batch grows. When it shrinks it drops at once (default),
//            because a ramp down keeps a too-large step for the now noisier
//            batch; `ramp_down` ramps in both directions instead. A change
//            during a ramp starts from the multiplier in effect then, and a
//            shrink never raises it: when a shrink's target is still above
//            the multiplier (an unfinished ramp up), the ramp goes on from
//            there to the lower target.
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

struct BatchPolicyOptions {
  BatchPolicyKind kind = BatchPolicyKind::Dynamic;
  int64_t reference_batch = 0;  // 0 = the first global batch seen
  int64_t ramp_iterations = 200;  // T
  bool ramp_down = false;
  MomentumOnChange momentum = MomentumOnChange::Keep;
};

class BatchSizePolicy {
 public:
  explicit BatchSizePolicy(BatchPolicyOptions opt);  // throws InvalidInput

  struct Step {
    double multiplier = 1.0;       // apply to the scheduled learning rate
    bool changed = false;          // the global batch changed at this step
    double momentum_factor = 1.0;  // multiply the momentum buffer by this (0 = reset)
  };
  // Called once per step, in order, with the global batch of that step.
  Step step(int64_t iteration, int64_t global_batch);

  double multiplier() const { return current_; }
  // Reference batch, ramp and last batch as a tensor (for checkpoints), and back.
  torch::Tensor state() const;
  void load_state(const torch::Tensor& t);
  const BatchPolicyOptions& options() const { return opt_; }

 private:
  double target(int64_t global_batch) const;
  double ramp_value(int64_t iteration) const;

  BatchPolicyOptions opt_;
  int64_t reference_ = 0;
  int64_t last_batch_ = 0;
  double from_ = 1.0, to_ = 1.0, current_ = 1.0;
  int64_t ramp_start_ = 0;
};

BatchPolicyKind parse_batch_policy(const std::string& s);
MomentumOnChange parse_momentum_on_change(const std::string& s);

}  // namespace limbo::optim
