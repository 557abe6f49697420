// The model interface and the registry of models by name.
//
// A Net is a torch::nn::Module mapping a float batch [N, C, H, W] to class
// logits [N, num_classes]. Input shapes come from the dataset (InputSpec), so
// one model name works on Fashion-MNIST (1x28x28) and CIFAR-10 (3x32x32).
// Parameter initialisation uses libtorch's defaults, the same as PyTorch's,
// drawn from the global torch generator (seed it first for determinism).
#pragma once

#include <torch/torch.h>

#include <memory>
#include <string>
#include <vector>

namespace limbo::models {

struct InputSpec {
  int64_t channels = 1, height = 28, width = 28;
  int64_t num_classes = 10;
};

struct ModelOptions {
  std::string name = "lenet";  // a built-in name, or "torchscript" (a user's module at `path`)
  std::string path;            // torchscript: the archive written by torch.jit.save
  int64_t width = 256;  // mlp: hidden units per layer
  int64_t depth = 2;    // mlp: hidden layers
  bool channels_last = true;  // conv weights and inputs in channels-last memory order
};

class Net : public torch::nn::Module {
 public:
  // Model outputs for a batch (class scores [B, C, ...] or regression outputs).
  virtual torch::Tensor forward(const torch::Tensor& x) = 0;
  // Modules that compute their own loss (model.loss = "module"): the scalar
  // loss of a batch. Built-in models have none (throws InvalidInput).
  virtual torch::Tensor forward_loss(const torch::Tensor& x, const torch::Tensor& y);
  // Class scores [B, C] for accuracy; false when the model has none (a
  // module-loss model without a `predict` method).
  virtual bool can_predict() const { return true; }
  virtual torch::Tensor predict(const torch::Tensor& x) { return forward(x); }
};
using NetPtr = std::shared_ptr<Net>;

// Builds a model; throws InvalidInput for unknown names or inputs the model
// cannot take (e.g. an image too small for LeNet's two 5x5 convolutions).
// "torchscript" loads opt.path (see torchscript.h); the input spec is not used.
NetPtr make_model(const ModelOptions& opt, const InputSpec& in);
const std::vector<std::string>& model_names();

// Factories (one file each).
NetPtr make_mlp(const ModelOptions& opt, const InputSpec& in);
NetPtr make_lenet(const InputSpec& in);
NetPtr make_cifar_quick(const InputSpec& in);
NetPtr make_resnet20(const InputSpec& in);

int64_t parameter_count(torch::nn::Module& m);

}  // namespace limbo::models
