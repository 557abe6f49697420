#include "optim/sgd.h"

#include <ATen/Parallel.h>

#include "common/error.h"

namespace limbo::optim {

Sgd::Sgd(SgdOptions opt) : opt_(opt) {
  if (opt_.nesterov && (opt_.momentum <= 0 || opt_.dampening != 0))
    throw InvalidInput("Nesterov momentum needs optim.momentum > 0 and zero dampening");
  if (opt_.momentum < 0 || opt_.weight_decay < 0)
    throw InvalidInput("optim.momentum and optim.weight_decay must be >= 0");
}

namespace {

// The whole update in one pass over memory (reads w, g and v once, writes w
// and v once), where the same rule as separate tensor operations takes five
// passes; on large models memory bandwidth is what the step costs.
template <bool First, bool Nesterov, bool Decay>
void fused_momentum_step(float* w, const float* g, float* v, int64_t begin, int64_t end, float lr,
                         float mu, float keep, float wd) {
  for (int64_t i = begin; i < end; ++i) {
    const float d = Decay ? g[i] + wd * w[i] : g[i];
    const float vi = First ? d : mu * v[i] + keep * d;
    v[i] = vi;
    w[i] -= lr * (Nesterov ? d + mu * vi : vi);
  }
}

using StepKernel = void (*)(float*, const float*, float*, int64_t, int64_t, float, float, float, float);

template <bool First>
StepKernel pick_kernel(bool nesterov, bool decay) {
  if (nesterov) return decay ? &fused_momentum_step<First, true, true> : &fused_momentum_step<First, true, false>;
  return decay ? &fused_momentum_step<First, false, true> : &fused_momentum_step<First, false, false>;
}

}  // namespace

void Sgd::step(torch::Tensor& w, const torch::Tensor& g, double lr) {
  torch::NoGradGuard no_grad;
  const bool flat = w.is_contiguous() && g.is_contiguous() && w.scalar_type() == torch::kFloat32 &&
                    g.scalar_type() == torch::kFloat32 && w.numel() == g.numel() &&
                    (!buf_.defined() || (buf_.is_contiguous() && buf_.numel() == w.numel() &&
                                         buf_.scalar_type() == torch::kFloat32));
  if (opt_.momentum != 0 && flat) {
    const bool first = !buf_.defined();
    if (first) buf_ = torch::empty_like(w);
    StepKernel k = first ? pick_kernel<true>(opt_.nesterov, opt_.weight_decay != 0)
                         : pick_kernel<false>(opt_.nesterov, opt_.weight_decay != 0);
    float* wp = w.data_ptr<float>();
    const float* gp = g.data_ptr<float>();
    float* vp = buf_.data_ptr<float>();
    const float lrf = static_cast<float>(lr), mu = static_cast<float>(opt_.momentum),
                keep = static_cast<float>(1.0 - opt_.dampening), wd = static_cast<float>(opt_.weight_decay);
    // Split across the intra-op threads (train.threads) like torch's own ops.
    at::parallel_for(0, w.numel(), 1 << 16, [&](int64_t b, int64_t e) { k(wp, gp, vp, b, e, lrf, mu, keep, wd); });
    return;
  }
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
