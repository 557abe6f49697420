// Streaming DiLoCo's pieces that need no group: the fragments of the flat
// parameters, the outer update of one fragment, and the averaging of the
// module's buffers (declared in train/outer_steps.h).
#include <torch/torch.h>

#include <string>
#include <vector>

#include "common/error.h"
#include "train/outer_steps.h"

namespace limbo::train {

std::vector<std::pair<int64_t, int64_t>> cut_fragments(const optim::FlatParams& flat, int64_t F) {
  const auto& e = flat.entries();
  const int64_t n = flat.numel();
  if (F <= 1 || n == 0) return {{0, n}};
  if (F > static_cast<int64_t>(e.size()))
    throw InvalidInput("diloco.fragments = " + std::to_string(F) + " is more than the model's " +
                       std::to_string(e.size()) + " trainable parameter tensors (fragments are cut on their "
                       "boundaries)");
  std::vector<std::pair<int64_t, int64_t>> out;
  int64_t lo = 0;
  for (size_t i = 0; i < e.size(); ++i) {
    const int64_t end = e[i].offset + e[i].numel;
    const int64_t left_fragments = F - static_cast<int64_t>(out.size()) - 1;  // after this one
    const int64_t left_entries = static_cast<int64_t>(e.size() - i - 1);
    const int64_t target = n * static_cast<int64_t>(out.size() + 1) / F;
    if (left_fragments > 0 && (end >= target || left_entries == left_fragments)) {
      out.emplace_back(lo, end);
      lo = end;
    }
  }
  out.emplace_back(lo, n);
  return out;
}


void outer_update_slice(optim::Optimizer& opt, torch::Tensor& w, const torch::Tensor& g, int64_t lo, int64_t hi,
                        double lr) {
  if (!opt.has_state() && !opt.state_names().empty()) {
    std::vector<torch::Tensor> zeros;
    for (size_t i = 0; i < opt.state_names().size(); ++i) zeros.push_back(torch::zeros_like(w));
    opt.set_state(std::move(zeros), 0);
  }
  std::vector<const float*> in;
  std::vector<float*> out;
  for (const auto& t : opt.state()) {
    in.push_back(t.data_ptr<float>() + lo);
    out.push_back(t.data_ptr<float>() + lo);
  }
  float* wp = w.data_ptr<float>() + lo;
  opt.step_into(wp, wp, g.data_ptr<float>(), in, out, hi - lo, lr);
}


torch::Tensor buffer_row(const optim::FlatParams& flat) {
  std::vector<torch::Tensor> parts;
  for (const auto& b : flat.buffer_entries()) parts.push_back(b.tensor.reshape(-1).to(torch::kFloat64));
  return parts.empty() ? torch::zeros({0}, torch::kFloat64) : torch::cat(parts);
}

std::vector<torch::Tensor> average_buffers(const optim::FlatParams& flat, const torch::Tensor& rows,
                                           const std::vector<double>& weights) {
  torch::NoGradGuard no_grad;
  double total = 0;
  for (double w : weights) total += w;
  if (rows.size(0) != static_cast<int64_t>(weights.size()) || total <= 0)
    throw Error("internal: averaging buffers without members' samples");
  std::vector<torch::Tensor> out;
  int64_t at = 0;
  for (const auto& b : flat.buffer_entries()) {
    const int64_t n = b.tensor.numel();
    auto cols = rows.narrow(1, at, n);
    torch::Tensor acc;
    if (b.tensor.is_floating_point()) {
      acc = torch::zeros({n}, torch::kFloat64);
      for (int64_t m = 0; m < cols.size(0); ++m) acc.add_(cols[m], weights[static_cast<size_t>(m)]);
      acc.div_(total);
    } else {
      acc = cols[0].clone();
      for (int64_t m = 1; m < cols.size(0); ++m) acc = torch::maximum(acc, cols[m]);
    }
    out.push_back(acc.reshape(b.tensor.sizes()).to(b.tensor.scalar_type()));
    at += n;
  }
  return out;
}

void take_buffer_average(optim::FlatParams& flat, const std::vector<torch::Tensor>& average,
                         const std::vector<torch::Tensor>& agreed) {
  torch::NoGradGuard no_grad;
  const auto& e = flat.buffer_entries();
  if (average.size() != e.size() || agreed.size() != e.size()) throw Error("internal: buffers of another model");
  for (size_t i = 0; i < e.size(); ++i) {
    auto& t = e[i].tensor;
    if (t.scalar_type() == torch::kBool) t.copy_(average[i]);
    else t.copy_(average[i] + (t - agreed[i]));
  }
}

}  // namespace limbo::train
