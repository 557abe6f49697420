// Stochastic gradient descent with momentum, Nesterov and weight decay over
// one flat parameter vector, with PyTorch's torch.optim.SGD update rule:
//
//   d  = g + wd * w
//   v  = d                          on the first step
//   v  = mu * v + (1 - dampening) * d   afterwards
//   d' = d + mu * v   (Nesterov)    or   d' = v   (classic momentum)
//   w  = w - lr * d'
//
// With mu = 0 this is plain SGD and no buffer is kept. The learning rate is
// passed per step, so schedules and batch-size / staleness policies compose
// outside the optimizer. Not thread-safe.
#pragma once

#include <torch/torch.h>

namespace limbo::optim {

struct SgdOptions {
  double momentum = 0.0;
  double dampening = 0.0;
  double weight_decay = 0.0;
  bool nesterov = false;
};

class Sgd {
 public:
  explicit Sgd(SgdOptions opt);  // throws InvalidInput (e.g. Nesterov without momentum)

  // One update of `w` (in place) with gradient `g` at learning rate `lr`.
  void step(torch::Tensor& w, const torch::Tensor& g, double lr);

  const SgdOptions& options() const { return opt_; }
  // Momentum buffer; undefined until the first momentum step.
  const torch::Tensor& buffer() const { return buf_; }
  // Restores a buffer (from a checkpoint or a peer); undefined = none yet.
  void set_buffer(torch::Tensor buf) { buf_ = std::move(buf); }
  // Multiplies the momentum buffer (batch-size-change policies); 0 resets it.
  void scale_buffer(double factor);

 private:
  SgdOptions opt_;
  torch::Tensor buf_;
};

}  // namespace limbo::optim
