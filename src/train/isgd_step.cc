#include "train/isgd_step.h"

#include <algorithm>
#include <cmath>

namespace limbo::train {

IsgdExtraResult isgd_extra_updates(TrainStep& step, optim::FlatParams& flat,
                                   torch::Tensor x, const torch::Tensor& y,
                                   UpdateRule& rule, optim::Optimizer& optimizer,
                                   const optim::IsgdOptions& opt, double limit,
                                   const torch::Tensor& anchor, double lr) {
  const double zeta = opt.zeta > 0 ? opt.zeta : lr;
  // The extra passes run forward in train mode (the gradient needs batch
  // statistics) but are not new data: the buffers (BatchNorm's running
  // statistics, its batch count) end as the step left them, on every member.
  struct Restore {
    optim::FlatParams& flat;
    std::vector<torch::Tensor> saved;
    ~Restore() { flat.restore_buffers(saved); }
  } restore{flat, flat.save_buffers()};
  IsgdExtraResult r;
  torch::Tensor phi_grad;
  // The weights (and momentum) before the last extra update: a loss or
  // gradient that is not finite after it puts them back.
  torch::Tensor last_weights;
  optim::Optimizer::Snapshot last_state;
  for (int64_t it = 0;; ++it) {
    double psi;
    if (it < opt.stop) {
      psi = rule.reduce(&flat.grad(), step.gradient(x, y));
    } else {
      psi = rule.reduce(nullptr, step.loss_only(x, y));  // measure only: the cap is reached
    }
    if (it == 0) r.loss_before = psi;
    r.loss_after = psi;
    // psi and the reduced gradient are the same on every member, so all
    // stop here alike.
    if (!std::isfinite(psi) || (it < opt.stop && !flat.grad().isfinite().all().item<bool>())) {
      r.not_finite = true;
      if (last_weights.defined()) {  // the last extra update made it so: undone
        flat.data().copy_(last_weights);
        if (opt.momentum != optim::IsgdMomentum::Untouched)
          optimizer.restore(last_state);
        r.iterations = std::max<int64_t>(0, r.iterations - 1);
      }
      break;
    }
    if (psi <= limit || it >= opt.stop) break;
    if (!last_weights.defined()) last_weights = torch::empty_like(flat.data());
    last_weights.copy_(flat.data());
    if (opt.momentum != optim::IsgdMomentum::Untouched)
      last_state = optimizer.snapshot();
    if (opt.momentum == optim::IsgdMomentum::Untouched) {
      optim::isgd_plain_step(flat.data(), flat.grad(), psi, limit, anchor, opt.epsilon, zeta);
    } else {
      if (!phi_grad.defined()) phi_grad = torch::empty_like(flat.grad());
      optim::isgd_phi_grad(phi_grad, flat.data(), flat.grad(), psi, limit, anchor, opt.epsilon);
      optimizer.step(flat.data(), phi_grad, zeta);
    }
    r.iterations = it + 1;
  }
  return r;
}

}  // namespace limbo::train
