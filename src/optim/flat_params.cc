#include "optim/flat_params.h"

#include "common/error.h"

namespace limbo::optim {

FlatParams::FlatParams(torch::nn::Module& module) {
  auto named = module.named_parameters(/*recurse=*/true);
  int64_t total = 0;
  for (const auto& p : named) {
    if (p.value().scalar_type() != torch::kFloat32)
      throw Error("FlatParams supports float32 parameters only; '" + p.key() + "' is " +
                  std::string(c10::toString(p.value().scalar_type())));
    entries_.push_back({p.key(), p.value().sizes().vec(), total, p.value().numel()});
    total += p.value().numel();
  }
  data_ = torch::empty({total}, torch::kFloat32);
  grad_ = torch::zeros({total}, torch::kFloat32);
  torch::NoGradGuard no_grad;
  size_t i = 0;
  for (auto& p : named) {
    const Entry& e = entries_[i++];
    auto view = data_.narrow(0, e.offset, e.numel).view(e.shape);
    view.copy_(p.value());
    p.value().set_data(view);
    p.value().mutable_grad() = grad_.narrow(0, e.offset, e.numel).view(e.shape);
  }
}

}  // namespace limbo::optim
