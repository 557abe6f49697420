// Stochastic gradient descent with momentum, Nesterov and weight decay, with
// PyTorch's torch.optim.SGD update rule:
//
//   d  = g + wd * w
//   v  = d                          on the first step
//   v  = mu * v + (1 - dampening) * d   afterwards
//   d' = d + mu * v   (Nesterov)    or   d' = v   (classic momentum)
//   w  = w - lr * d'
//
// With mu = 0 this is plain SGD and no state is kept; otherwise the state is
// one tensor, `momentum_buffer`. With OptimizerOptions::lr_in_buffer (the
// parameter server's form) the rate moves inside: d = lr g + decay_lr wd w
// and w = w - d'. The learning rate is passed per update, so schedules and
// batch-size / staleness policies compose outside the optimizer.
#pragma once

#include "optim/optimizer.h"

namespace limbo::optim {

class Sgd : public Optimizer {
 public:
  explicit Sgd(OptimizerOptions opt);  // throws InvalidInput (e.g. Nesterov without momentum)
  std::vector<std::string> state_names() const override;
  bool update(const UpdateSlice& s, const UpdateScalars& k) const override;
};

}  // namespace limbo::optim
