// Gradient clipping by global norm, as torch.nn.utils.clip_grad_norm_ with
// the L2 norm: the norm is taken over the whole flat gradient of the
// trainable parameters, and when it exceeds max_norm the gradient is scaled
// by max_norm / (norm + 1e-6). Data-parallel training clips the reduced
// gradient, so every member clips alike.
#pragma once

#include <torch/torch.h>

namespace limbo::optim {

// The L2 norm of a flat float32 gradient (float32, as PyTorch computes it).
double grad_norm(const torch::Tensor& g);
// Clips `g` in place when max_norm > 0; returns the norm before clipping.
double clip_grad_norm(torch::Tensor& g, double max_norm);

}  // namespace limbo::optim
