#include "optim/optimizer.h"

#include <ATen/Parallel.h>

#include <atomic>

#include "common/error.h"
#include "optim/adam.h"
#include "optim/sgd.h"

namespace limbo::optim {

bool Optimizer::step(torch::Tensor& w, const torch::Tensor& g, double lr) {
  torch::NoGradGuard no_grad;
  const int64_t n = w.numel();
  if (!w.is_contiguous() || !g.is_contiguous() || w.scalar_type() != torch::kFloat32 ||
      g.scalar_type() != torch::kFloat32 || g.numel() != n)
    throw std::invalid_argument("Optimizer::step needs contiguous float32 weights and gradient of one size");
  const auto names = state_names();
  const bool first = !has_state();
  if (first) {
    state_.assign(names.size(), torch::Tensor());
    for (auto& t : state_) t = torch::empty({n}, torch::kFloat32);
  }
  // The rule writes n floats of each state tensor: a state of another size
  // (restored for another set of trainable parameters) would be written
  // past its end or stepped in the wrong slices.
  for (size_t i = 0; i < state_.size(); ++i)
    if (state_[i].numel() != n)
      throw std::invalid_argument("Optimizer::step: the state '" + names[i] + "' holds " +
                                  std::to_string(state_[i].numel()) + " floats, the parameters " + std::to_string(n));
  std::vector<const float*> in;
  std::vector<float*> out;
  for (auto& t : state_) {
    out.push_back(t.data_ptr<float>());
    if (!first) in.push_back(out.back());
  }
  float* wp = w.data_ptr<float>();
  return step_into(wp, wp, g.data_ptr<float>(), in, out, n, lr);
}

bool Optimizer::step_into(const float* w, float* w_out, const float* g, const std::vector<const float*>& s,
                          const std::vector<float*>& s_out, int64_t n, double lr) {
  const size_t k_state = state_names().size();
  if (s_out.size() != k_state || (!s.empty() && s.size() != k_state))
    throw std::invalid_argument("Optimizer::step_into: one state pointer per state name");
  UpdateScalars k{lr, lr, steps_ + 1};
  std::atomic<bool> finite{true};
  at::parallel_for(0, n, 1 << 16, [&](int64_t b, int64_t e) {
    UpdateSlice sl;
    sl.w_out = w_out + b;
    sl.w = w + b;
    sl.g = g + b;
    for (size_t i = 0; i < k_state; ++i) {
      sl.s_out[i] = s_out[i] + b;
      sl.s[i] = s.empty() ? nullptr : s[i] + b;
    }
    sl.n = e - b;
    if (!update(sl, k)) finite = false;
  });
  steps_ += 1;
  return finite;
}

void Optimizer::set_state(std::vector<torch::Tensor> tensors, int64_t steps) {
  const auto names = state_names();
  const bool none = tensors.empty() || !tensors[0].defined();
  if (!none && tensors.size() != names.size())
    throw InvalidInput("optimizer state for '" + opt_.algorithm + "' needs " + std::to_string(names.size()) +
                       " tensors, got " + std::to_string(tensors.size()));
  if (!none)
    for (size_t i = 0; i < tensors.size(); ++i)
      if (!tensors[i].defined() || tensors[i].scalar_type() != torch::kFloat32 ||
          (i > 0 && tensors[i].numel() != tensors[0].numel()))
        throw InvalidInput("optimizer state '" + names[i] + "' is missing or not float32 of the parameters' size");
  state_.clear();
  if (!none)
    for (auto& t : tensors) state_.push_back(t.contiguous().view({-1}));
  steps_ = steps;
}

Optimizer::Snapshot Optimizer::snapshot() const {
  Snapshot s;
  s.steps = steps_;
  if (has_state())
    for (const auto& t : state_) s.tensors.push_back(t.clone());
  return s;
}

void Optimizer::scale_momentum(double factor) {
  if (factor == 0) {
    reset_state();
    return;
  }
  if (has_state()) state_[static_cast<size_t>(momentum_slot())].mul_(factor);
}

std::vector<std::string> optimizer_algorithms() { return {"sgd", "adam", "adamw"}; }

std::unique_ptr<Optimizer> make_optimizer(const OptimizerOptions& opt) {
  if (opt.algorithm == "sgd") return std::make_unique<Sgd>(opt);
  if (opt.algorithm == "adam" || opt.algorithm == "adamw") return std::make_unique<Adam>(opt);
  throw InvalidInput("unknown optimizer '" + opt.algorithm + "'; allowed: sgd, adam, adamw");
}

}  // namespace limbo::optim
