#include "optim/clip.h"

namespace limbo::optim {

double grad_norm(const torch::Tensor& g) {
  torch::NoGradGuard no_grad;
  if (g.numel() == 0) return 0.0;
  return torch::linalg::vector_norm(g, 2, c10::nullopt, false, c10::nullopt).item<double>();
}

double clip_grad_norm(torch::Tensor& g, double max_norm) {
  torch::NoGradGuard no_grad;
  const double norm = grad_norm(g);
  if (max_norm <= 0) return norm;
  // PyTorch computes the coefficient in float32: max_norm / (norm + 1e-6).
  const float coef = static_cast<float>(max_norm) / (static_cast<float>(norm) + 1e-6f);
  if (coef < 1.0f) g.mul_(coef);
  return norm;
}

}  // namespace limbo::optim
