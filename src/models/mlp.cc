// Multi-layer perceptron: flatten, `depth` hidden Linear+ReLU layers of
// `width` units, then a Linear classifier.
#include "common/error.h"
#include "models/net.h"

namespace limbo::models {
namespace {

class Mlp : public Net {
 public:
  Mlp(const ModelOptions& opt, const InputSpec& in) {
    int64_t features = in.channels * in.height * in.width;
    for (int64_t i = 0; i < opt.depth; ++i) {
      hidden_.push_back(register_module("fc" + std::to_string(i + 1),
                                        torch::nn::Linear(features, opt.width)));
      features = opt.width;
    }
    out_ = register_module("fc" + std::to_string(opt.depth + 1),
                           torch::nn::Linear(features, in.num_classes));
  }
  torch::Tensor forward(const torch::Tensor& x) override {
    auto h = x.flatten(1);
    for (auto& l : hidden_) h = torch::relu(l->forward(h));
    return out_->forward(h);
  }

 private:
  std::vector<torch::nn::Linear> hidden_;
  torch::nn::Linear out_{nullptr};
};

}  // namespace

NetPtr make_mlp(const ModelOptions& opt, const InputSpec& in) {
  if (opt.width < 1 || opt.depth < 0)
    throw InvalidInput("mlp: model.width must be >= 1 and model.depth >= 0");
  return std::make_shared<Mlp>(opt, in);
}

}  // namespace limbo::models
