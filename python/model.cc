// The user's nn.Module as Limbo sees it, and changes made to it (python/core.h).
#include "core.h"

namespace limbo::python {

std::shared_ptr<torch::nn::Module> module_tree(const Named& params, const Named& buffers) {
  auto root = std::make_shared<torch::nn::Module>("Model");
  auto place = [&](const std::string& name) -> std::pair<torch::nn::Module*, std::string> {
    torch::nn::Module* m = root.get();
    size_t at = 0;
    for (size_t dot; (dot = name.find('.', at)) != std::string::npos; at = dot + 1) {
      const std::string part = name.substr(at, dot - at);
      if (part.empty()) throw InvalidInput("the model names a tensor '" + name + "' with an empty part");
      auto children = m->named_children();
      if (auto* c = children.find(part)) {
        m = c->get();
      } else {
        m = m->register_module(part, std::make_shared<torch::nn::Module>(part)).get();
      }
    }
    return {m, name.substr(at)};
  };
  for (const auto& [name, t] : params) {
    auto [m, leaf] = place(name);
    m->register_parameter(leaf, t, t.requires_grad());
  }
  for (const auto& [name, t] : buffers) {
    auto [m, leaf] = place(name);
    m->register_buffer(leaf, t);
  }
  return root;
}

void Core::check_model() const {
  const auto& ps = flat_->parameters();
  const auto& es = flat_->entries();
  const float* base = flat_->data().data_ptr<float>();
  for (size_t i = 0; i < ps.size(); ++i) {
    if (ps[i].defined() && ps[i].scalar_type() != torch::kFloat32)
      throw InvalidInput("parameter '" + es[i].name + "' became " + std::string(c10::toString(ps[i].scalar_type())) +
                         " after limbo.Job took the model (model.half() or .to(dtype)?); Limbo trains float32 "
                         "parameters: keep the model in float32 and compute in bf16 under torch.autocast");
    if (!ps[i].defined() || ps[i].sizes().vec() != es[i].shape || ps[i].data_ptr<float>() != base + es[i].offset)
      throw InvalidInput("parameter '" + es[i].name + "' changed after limbo.Job took the model (its data was "
                         "replaced or resized); build the model completely before creating the job");
  }
}

}  // namespace limbo::python
