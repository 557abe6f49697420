#include "optim/sgd.h"

#include "common/error.h"

namespace limbo::optim {

Sgd::Sgd(SgdOptions opt) : opt_(opt) {
  if (opt_.nesterov && (opt_.momentum <= 0 || opt_.dampening != 0))
    throw InvalidInput("Nesterov momentum needs optim.momentum > 0 and zero dampening");
  if (opt_.momentum < 0 || opt_.weight_decay < 0)
    throw InvalidInput("optim.momentum and optim.weight_decay must be >= 0");
}

void Sgd::step(torch::Tensor& w, const torch::Tensor& g, double lr) {
  torch::NoGradGuard no_grad;
  // d = g + wd*w; only materialised when weight decay is on.
  torch::Tensor d = opt_.weight_decay != 0 ? g.add(w, opt_.weight_decay) : g;
  if (opt_.momentum == 0) {
    w.add_(d, -lr);
    return;
  }
  if (!buf_.defined()) {
    buf_ = d.clone();
  } else {
    buf_.mul_(opt_.momentum).add_(d, 1.0 - opt_.dampening);
  }
  if (opt_.nesterov) {
    w.add_(d, -lr).add_(buf_, -lr * opt_.momentum);
  } else {
    w.add_(buf_, -lr);
  }
}

void Sgd::scale_buffer(double factor) {
  if (!buf_.defined()) return;
  if (factor == 0) buf_ = torch::Tensor();
  else buf_.mul_(factor);
}

}  // namespace limbo::optim
