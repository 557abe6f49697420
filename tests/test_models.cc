// The model registry: output shapes and parameter counts for both input
// shapes the datasets give.
#include <gtest/gtest.h>

#include "common/error.h"
#include "models/net.h"

using namespace limbo;
using namespace limbo::models;

namespace {

struct ModelCase {
  std::string name;
  InputSpec in;
  int64_t params;
};

void PrintTo(const ModelCase& c, std::ostream* os) {
  *os << c.name << " on " << c.in.channels << "x" << c.in.height << "x" << c.in.width;
}

class ModelShape : public ::testing::TestWithParam<ModelCase> {};

TEST_P(ModelShape, ForwardAndParameterCount) {
  auto c = GetParam();
  ModelOptions o;
  o.name = c.name;
  auto net = make_model(o, c.in);
  EXPECT_EQ(parameter_count(*net), c.params);
  auto y = net->forward(torch::randn({3, c.in.channels, c.in.height, c.in.width}));
  EXPECT_EQ(y.sizes(), (std::vector<int64_t>{3, c.in.num_classes}));
  y.sum().backward();
  for (auto& p : net->parameters()) EXPECT_TRUE(p.grad().defined());
}

INSTANTIATE_TEST_SUITE_P(
    Registry, ModelShape,
    ::testing::Values(
        // mlp 784-256-256-10
        ModelCase{"mlp", {1, 28, 28, 10}, 784 * 256 + 256 + 256 * 256 + 256 + 2570},
        // Caffe LeNet: 520 + 25050 + 400500 + 5010
        ModelCase{"lenet", {1, 28, 28, 10}, 431080},
        ModelCase{"lenet", {3, 32, 32, 10}, 1500 + 20 + 25050 + 1250 * 500 + 500 + 5010},
        // cifar10_quick: 2432 + 25632 + 51264 + 65600 + 650
        ModelCase{"cifar-quick", {3, 32, 32, 10}, 145578},
        // ResNet-20 (option A shortcuts), 0.27M: stem 432+32, stage 1
        // 3*(2*2304+64), stage 2 13952+2*(2*9216+128), stage 3
        // 55552+2*(2*36864+256), classifier 650.
        ModelCase{"resnet20", {3, 32, 32, 10}, 269722},
        ModelCase{"resnet20", {1, 28, 28, 10}, 269722 - 2 * 16 * 9}),
    [](const auto& info) {
      std::string n = info.param.name + "_" + std::to_string(info.param.in.channels) + "ch";
      for (auto& ch : n) if (ch == '-') ch = '_';
      return n;
    });

TEST(Models, UnknownNameAndTooSmallInputAreRejected) {
  ModelOptions o;
  o.name = "alexnet";
  try {
    make_model(o, {1, 28, 28, 10});
    FAIL();
  } catch (const InvalidInput& e) {
    EXPECT_NE(std::string(e.what()).find("lenet"), std::string::npos);
  }
  o.name = "lenet";
  EXPECT_THROW(make_model(o, {1, 8, 8, 10}), InvalidInput);
}

}  // namespace
