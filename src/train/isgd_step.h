// ISGD's extra, conservative updates on an under-trained batch (see
// optim/isgd.h for the subproblem). Runs on the training thread; gradients
// and losses go through UpdateRule::reduce, so in data-parallel training
// every worker runs the same iterations on all-reduced values.
#pragma once

#include <torch/torch.h>

#include "optim/flat_params.h"
#include "optim/isgd.h"
#include "train/step.h"
#include "train/update_rule.h"

namespace limbo::train {

struct IsgdExtraResult {
  int64_t iterations = 0;  // subproblem updates applied (<= stop)
  double loss_before = 0;  // batch loss after the normal update, before extra ones
  double loss_after = 0;   // batch loss after the extra updates
  // A loss or reduced gradient that was not finite ended the passes (the
  // weights stay as the last finite pass left them, on every member alike).
  bool not_finite = false;
};

IsgdExtraResult isgd_extra_updates(TrainStep& step, optim::FlatParams& flat,
                                   torch::Tensor x, const torch::Tensor& y,
                                   UpdateRule& rule, optim::Optimizer& optimizer,
                                   const optim::IsgdOptions& opt, double limit,
                                   const torch::Tensor& anchor, double lr);

}  // namespace limbo::train
