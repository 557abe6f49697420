// Caffe's cifar10_quick: three 5x5 convolutions (32, 32, 64 filters, pad 2),
// each followed by 3x3 stride-2 pooling (max, then average twice; Caffe rounds
// pooled sizes up, hence ceil_mode), a 64-unit fully connected layer and the
// classifier. ReLU placement follows the Caffe prototxt.
#include "common/error.h"
#include "models/net.h"

namespace limbo::models {
namespace {

int64_t pooled(int64_t n) { return (n - 3 + 1) / 2 + 1; }  // ceil((n-3)/2)+1

class CifarQuick : public Net {
 public:
  explicit CifarQuick(const InputSpec& in) {
    using torch::nn::Conv2dOptions;
    conv1_ = register_module("conv1", torch::nn::Conv2d(Conv2dOptions(in.channels, 32, 5).padding(2)));
    conv2_ = register_module("conv2", torch::nn::Conv2d(Conv2dOptions(32, 32, 5).padding(2)));
    conv3_ = register_module("conv3", torch::nn::Conv2d(Conv2dOptions(32, 64, 5).padding(2)));
    int64_t h = pooled(pooled(pooled(in.height))), w = pooled(pooled(pooled(in.width)));
    ip1_ = register_module("ip1", torch::nn::Linear(64 * h * w, 64));
    ip2_ = register_module("ip2", torch::nn::Linear(64, in.num_classes));
  }
  torch::Tensor forward(const torch::Tensor& x) override {
    namespace F = torch::nn::functional;
    auto h = F::max_pool2d(conv1_->forward(x), F::MaxPool2dFuncOptions(3).stride(2).ceil_mode(true));
    h = torch::relu(h);
    h = torch::relu(conv2_->forward(h));
    h = F::avg_pool2d(h, F::AvgPool2dFuncOptions(3).stride(2).ceil_mode(true));
    h = torch::relu(conv3_->forward(h));
    h = F::avg_pool2d(h, F::AvgPool2dFuncOptions(3).stride(2).ceil_mode(true));
    return ip2_->forward(ip1_->forward(h.flatten(1)));
  }

 private:
  torch::nn::Conv2d conv1_{nullptr}, conv2_{nullptr}, conv3_{nullptr};
  torch::nn::Linear ip1_{nullptr}, ip2_{nullptr};
};

}  // namespace

NetPtr make_cifar_quick(const InputSpec& in) {
  if (in.height < 8 || in.width < 8)
    throw InvalidInput("cifar-quick needs images of at least 8x8");
  return std::make_shared<CifarQuick>(in);
}

}  // namespace limbo::models
