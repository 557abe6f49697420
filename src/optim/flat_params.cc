#include "optim/flat_params.h"

#include "common/error.h"

namespace limbo::optim {

namespace {

// A view of `numel` elements of `flat` at `offset`, shaped `shape`.
torch::Tensor shaped_view(torch::Tensor& flat, int64_t offset, const std::vector<int64_t>& shape,
                          bool channels_last) {
  auto slice = flat.narrow(0, offset, c10::multiply_integers(shape));
  if (channels_last && shape.size() == 4)
    return slice.view({shape[0], shape[2], shape[3], shape[1]}).permute({0, 3, 1, 2});
  return slice.view(shape);
}

}  // namespace

FlatParams::FlatParams(torch::nn::Module& module, bool channels_last) {
  auto named = module.named_parameters(/*recurse=*/true);
  int64_t total = 0;
  for (const auto& p : named) {
    if (p.value().scalar_type() != torch::kFloat32)
      throw Error("FlatParams supports float32 parameters only; '" + p.key() + "' is " +
                  std::string(c10::toString(p.value().scalar_type())));
    entries_.push_back({p.key(), p.value().sizes().vec(), total, p.value().numel()});
    total += p.value().numel();
  }
  std::vector<torch::Tensor> float_buffers;
  int64_t buffer_total = 0;
  for (const auto& b : module.named_buffers(/*recurse=*/true)) {
    if (b.value().scalar_type() != torch::kFloat32) continue;
    float_buffers.push_back(b.value());
    buffer_total += b.value().numel();
  }
  data_ = torch::empty({total}, torch::kFloat32);
  grad_slot_ = torch::zeros({total + buffer_total + kSlots}, torch::kFloat32);
  grad_ = grad_slot_.narrow(0, 0, total);
  buffers_ = grad_slot_.narrow(0, total, buffer_total);
  torch::NoGradGuard no_grad;
  int64_t at = 0;
  for (auto& b : float_buffers) {
    auto view = buffers_.narrow(0, at, b.numel()).view(b.sizes());
    view.copy_(b);
    b.set_data(view);
    at += b.numel();
  }
  size_t i = 0;
  for (auto& p : named) {
    const Entry& e = entries_[i++];
    auto view = shaped_view(data_, e.offset, e.shape, channels_last);
    view.copy_(p.value());
    p.value().set_data(view);
    p.value().mutable_grad() = shaped_view(grad_, e.offset, e.shape, channels_last);
    params_.push_back(p.value());
  }
}

}  // namespace limbo::optim
