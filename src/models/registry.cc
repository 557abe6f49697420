#include "common/error.h"
#include "models/net.h"
#include "models/torchscript.h"

namespace limbo::models {

const std::vector<std::string>& model_names() {
  static const std::vector<std::string> names = {"mlp", "lenet", "cifar-quick", "resnet20",
                                                  "torchscript"};
  return names;
}

torch::Tensor Net::forward_loss(const torch::Tensor&, const torch::Tensor&) {
  throw InvalidInput("model.loss = \"module\" needs a TorchScript model whose forward(x, y) "
                     "returns the loss; built-in models use cross_entropy");
}

NetPtr make_model(const ModelOptions& opt, const InputSpec& in) {
  if (opt.name == "torchscript") return load_torchscript(opt.path);
  if (in.channels <= 0 || in.height <= 0 || in.width <= 0 || in.num_classes < 2)
    throw InvalidInput("model '" + opt.name + "': bad input shape " +
                       std::to_string(in.channels) + "x" + std::to_string(in.height) + "x" +
                       std::to_string(in.width) + " with " + std::to_string(in.num_classes) +
                       " classes");
  if (opt.name == "mlp") return make_mlp(opt, in);
  if (opt.name == "lenet") return make_lenet(in);
  if (opt.name == "cifar-quick") return make_cifar_quick(in);
  if (opt.name == "resnet20") return make_resnet20(in);
  std::string all;
  for (const auto& n : model_names()) all += (all.empty() ? "" : ", ") + n;
  throw InvalidInput("unknown model '" + opt.name + "'; allowed: " + all);
}

int64_t parameter_count(torch::nn::Module& m) {
  int64_t n = 0;
  for (const auto& p : m.parameters()) n += p.numel();
  return n;
}

}  // namespace limbo::models
