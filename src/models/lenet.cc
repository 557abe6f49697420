// LeNet as in Caffe's MNIST example: conv 20@5x5, max-pool 2, conv 50@5x5,
// max-pool 2, fully connected 500 + ReLU, fully connected to the classes.
#include "common/error.h"
#include "models/net.h"

namespace limbo::models {
namespace {

class LeNet : public Net {
 public:
  explicit LeNet(const InputSpec& in) {
    conv1_ = register_module("conv1", torch::nn::Conv2d(torch::nn::Conv2dOptions(in.channels, 20, 5)));
    conv2_ = register_module("conv2", torch::nn::Conv2d(torch::nn::Conv2dOptions(20, 50, 5)));
    int64_t h = ((in.height - 4) / 2 - 4) / 2, w = ((in.width - 4) / 2 - 4) / 2;
    fc1_ = register_module("fc1", torch::nn::Linear(50 * h * w, 500));
    fc2_ = register_module("fc2", torch::nn::Linear(500, in.num_classes));
  }
  torch::Tensor forward(const torch::Tensor& x) override {
    auto h = torch::max_pool2d(conv1_->forward(x), 2);
    h = torch::max_pool2d(conv2_->forward(h), 2);
    h = torch::relu(fc1_->forward(h.flatten(1)));
    return fc2_->forward(h);
  }

 private:
  torch::nn::Conv2d conv1_{nullptr}, conv2_{nullptr};
  torch::nn::Linear fc1_{nullptr}, fc2_{nullptr};
};

}  // namespace

NetPtr make_lenet(const InputSpec& in) {
  if (in.height < 16 || in.width < 16)
    throw InvalidInput("lenet needs images of at least 16x16, got " + std::to_string(in.height) +
                       "x" + std::to_string(in.width));
  return std::make_shared<LeNet>(in);
}

}  // namespace limbo::models
