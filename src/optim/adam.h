// Adam (Kingma and Ba) and AdamW (Loshchilov and Hutter), with PyTorch's
// torch.optim.Adam / AdamW update rule (amsgrad off), at update t >= 1:
//
//   AdamW:  w = w * (1 - lr * wd)          decoupled weight decay
//   Adam:   g = g + wd * w                 L2 weight decay
//   m = beta1 * m + (1 - beta1) * g        state `exp_avg` (zeros at first)
//   v = beta2 * v + (1 - beta2) * g * g    state `exp_avg_sq`
//   w = w - (lr / (1 - beta1^t)) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps)
//
// t is the optimizer's update count (Optimizer::steps() + 1), kept with the
// state. Under the square-root batch rule at batch ratio kappa
// (Optimizer::set_batch_scale), 1 - beta1 and 1 - beta2 are multiplied by
// kappa (at most 1) and eps divided by sqrt(kappa). On a parameter-server
// shard `lr` is the staleness-divided rate of the update, and the decoupled
// decay runs at UpdateScalars::decay_lr (the same rate by default).
#pragma once

#include <string>

#include "optim/optimizer.h"

namespace limbo::optim {

// Under the square-root rule, (1 - beta) * kappa reaches 1 once kappa >=
// 1 / (1 - beta): that beta is then 0, the moving average gone (with
// beta1 = 0.9 from kappa = 10 on: no momentum at all). The warning for
// `opt` at `kappa`, naming what to set (elastic.reference_batch to the
// largest global batch of the job keeps kappa <= 1), or "" when both
// betas keep some of their past.
std::string sqrt_rule_warning(const OptimizerOptions& opt, double kappa);

class Adam : public Optimizer {
 public:
  explicit Adam(OptimizerOptions opt);  // algorithm "adam" or "adamw"; throws InvalidInput on bad betas / eps
  std::vector<std::string> state_names() const override { return {"exp_avg", "exp_avg_sq"}; }
  bool update(const UpdateSlice& s, const UpdateScalars& k) const override;

 private:
  bool decoupled_;
};

}  // namespace limbo::optim
