#include "models/torchscript.h"

#include <torch/script.h>

#include <set>

#include "common/error.h"
#include "common/files.h"

namespace limbo::models {
namespace {

class TorchScriptNet : public Net {
 public:
  TorchScriptNet(torch::jit::Module m, std::string path) : jit_(std::move(m)), path_(std::move(path)) {
    std::map<const void*, std::string> seen;
    mirror(jit_, *this, "", seen);
    has_predict_ = jit_.find_method("predict").has_value();
    train(true);
  }

  torch::Tensor forward(const torch::Tensor& x) override {
    return as_tensor(jit_.forward({x}), "forward(x)");
  }
  torch::Tensor forward_loss(const torch::Tensor& x, const torch::Tensor& y) override {
    auto out = as_tensor(jit_.forward({x, y}), "forward(x, y)");
    if (out.numel() != 1)
      throw InvalidInput("TorchScript model '" + path_ + "': with model.loss = \"module\", "
                         "forward(x, y) must return the scalar loss, it returned shape " +
                         c10::str(out.sizes()));
    return out.reshape({});
  }
  bool can_predict() const override { return has_predict_; }
  torch::Tensor predict(const torch::Tensor& x) override {
    if (!has_predict_) return forward(x);
    return as_tensor(jit_.get_method("predict")({x}), "predict(x)");
  }
  void train(bool on) override {
    torch::nn::Module::train(on);
    jit_.train(on);
  }
  torch::jit::Module& script() { return jit_; }

 private:
  torch::Tensor as_tensor(const c10::IValue& v, const char* what) {
    if (!v.isTensor())
      throw InvalidInput("TorchScript model '" + path_ + "': " + what + " must return one tensor, "
                         "it returned " + v.tagKind());
    return v.toTensor();
  }

  // Registers the script module's own parameters and buffers in `dst` and
  // recurses into its submodules.
  void mirror(const torch::jit::Module& src, torch::nn::Module& dst, const std::string& prefix,
              std::map<const void*, std::string>& seen) {
    auto check_unique = [&](const torch::Tensor& t, const std::string& name) {
      auto [it, fresh] = seen.emplace(t.unsafeGetTensorImpl(), name);
      if (!fresh)
        throw InvalidInput("TorchScript model '" + path_ + "': '" + name + "' is the same tensor as '" +
                           it->second + "'; tied (shared) parameters are not supported");
    };
    for (const auto& p : src.named_parameters(/*recurse=*/false)) {
      if (p.value.scalar_type() != torch::kFloat32)
        throw InvalidInput("TorchScript model '" + path_ + "': parameter '" + prefix + p.name +
                           "' is " + std::string(c10::toString(p.value.scalar_type())) +
                           "; Limbo trains float32 parameters (call .float() before saving)");
      check_unique(p.value, prefix + p.name);
      // A parameter the user froze (requires_grad_(False) before saving)
      // stays frozen: FlatParams leaves it out of training altogether.
      dst.register_parameter(p.name, p.value, p.value.requires_grad());
    }
    for (const auto& b : src.named_buffers(/*recurse=*/false)) {
      check_unique(b.value, prefix + b.name);
      dst.register_buffer(b.name, b.value);
    }
    for (const auto& c : src.named_children()) {
      auto child = std::make_shared<torch::nn::Module>();
      mirror(c.value, *child, prefix + c.name + ".", seen);
      dst.register_module(c.name, child);
    }
  }

  torch::jit::Module jit_;
  std::string path_;
  bool has_predict_ = false;
};

}  // namespace

NetPtr load_torchscript(const std::string& path) {
  if (path.empty())
    throw InvalidInput("model.name = \"torchscript\" needs model.path = the file written by "
                       "torch.jit.save");
  if (!file_exists(path)) throw InvalidInput("TorchScript model '" + path + "' does not exist");
  torch::jit::Module m;
  try {
    m = torch::jit::load(path, torch::kCPU);
  } catch (const c10::Error& e) {
    std::string msg = e.what_without_backtrace();
    throw InvalidInput("TorchScript model '" + path + "' cannot be loaded (write it with "
                       "torch.jit.save(torch.jit.script(model), path)): " + msg.substr(0, 300));
  }
  if (!m.find_method("forward"))
    throw InvalidInput("TorchScript model '" + path + "' has no forward method");
  return std::make_shared<TorchScriptNet>(std::move(m), path);
}

torch::jit::Module* script_module(Net& net) {
  auto* t = dynamic_cast<TorchScriptNet*>(&net);
  return t ? &t->script() : nullptr;
}

}  // namespace limbo::models
