// ResNet-20 for CIFAR (He et al. 2016, section 4.2): a 3x3 conv with 16
// filters, three stages of three basic blocks (16, 32, 64 filters; stages two
// and three halve the resolution), global average pooling and a classifier.
// Shortcuts that change shape use option A: stride-2 subsampling and zero
// channel padding, so the net has 0.27M parameters as in the paper.
#include "common/error.h"
#include "models/net.h"

namespace limbo::models {
namespace {

torch::nn::Conv2d conv3x3(int64_t in, int64_t out, int64_t stride) {
  return torch::nn::Conv2d(
      torch::nn::Conv2dOptions(in, out, 3).stride(stride).padding(1).bias(false));
}

class BasicBlock : public torch::nn::Module {
 public:
  BasicBlock(int64_t in, int64_t out, int64_t stride) : pad_(out - in), stride_(stride) {
    conv1_ = register_module("conv1", conv3x3(in, out, stride));
    bn1_ = register_module("bn1", torch::nn::BatchNorm2d(out));
    conv2_ = register_module("conv2", conv3x3(out, out, 1));
    bn2_ = register_module("bn2", torch::nn::BatchNorm2d(out));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    auto h = torch::relu(bn1_->forward(conv1_->forward(x)));
    h = bn2_->forward(conv2_->forward(h));
    torch::Tensor shortcut = x;
    if (stride_ != 1 || pad_ != 0) {
      shortcut = x.slice(2, 0, x.size(2), stride_).slice(3, 0, x.size(3), stride_);
      shortcut = torch::constant_pad_nd(shortcut, {0, 0, 0, 0, pad_ / 2, pad_ - pad_ / 2});
    }
    return torch::relu(h + shortcut);
  }

 private:
  int64_t pad_, stride_;
  torch::nn::Conv2d conv1_{nullptr}, conv2_{nullptr};
  torch::nn::BatchNorm2d bn1_{nullptr}, bn2_{nullptr};
};

class ResNet20 : public Net {
 public:
  explicit ResNet20(const InputSpec& in) {
    conv_ = register_module("conv1", conv3x3(in.channels, 16, 1));
    bn_ = register_module("bn1", torch::nn::BatchNorm2d(16));
    int64_t channels = 16;
    const int64_t widths[3] = {16, 32, 64};
    for (int s = 0; s < 3; ++s) {
      for (int b = 0; b < 3; ++b) {
        int64_t stride = (s > 0 && b == 0) ? 2 : 1;
        auto block = std::make_shared<BasicBlock>(channels, widths[s], stride);
        blocks_.push_back(register_module(
            "layer" + std::to_string(s + 1) + "_" + std::to_string(b), block));
        channels = widths[s];
      }
    }
    fc_ = register_module("fc", torch::nn::Linear(64, in.num_classes));
    for (auto& m : modules(false)) {
      if (auto* c = m->as<torch::nn::Conv2d>())
        torch::nn::init::kaiming_normal_(c->weight, 0.0, torch::kFanOut, torch::kReLU);
    }
  }
  torch::Tensor forward(const torch::Tensor& x) override {
    auto h = torch::relu(bn_->forward(conv_->forward(x)));
    for (auto& b : blocks_) h = b->forward(h);
    h = torch::adaptive_avg_pool2d(h, {1, 1}).flatten(1);
    return fc_->forward(h);
  }

 private:
  torch::nn::Conv2d conv_{nullptr};
  torch::nn::BatchNorm2d bn_{nullptr};
  std::vector<std::shared_ptr<BasicBlock>> blocks_;
  torch::nn::Linear fc_{nullptr};
};

}  // namespace

NetPtr make_resnet20(const InputSpec& in) {
  if (in.height < 8 || in.width < 8) throw InvalidInput("resnet20 needs images of at least 8x8");
  return std::make_shared<ResNet20>(in);
}

}  // namespace limbo::models
