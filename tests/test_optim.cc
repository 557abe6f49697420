// SGD (against libtorch's own torch::optim::SGD, which implements PyTorch's
// rule), flat parameter storage, and learning-rate schedules.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>

#include "common/error.h"
#include "models/net.h"
#include "optim/flat_params.h"
#include "optim/lr_schedule.h"
#include "optim/sgd.h"

using namespace limbo;
using namespace limbo::optim;

namespace {

OptimizerOptions sgd_options(double momentum, double dampening, double wd, bool nesterov) {
  OptimizerOptions o;
  o.momentum = momentum;
  o.dampening = dampening;
  o.weight_decay = wd;
  o.nesterov = nesterov;
  return o;
}

struct SgdCase {
  double momentum, dampening, wd;
  bool nesterov;
};

class SgdMatchesTorch : public ::testing::TestWithParam<SgdCase> {};

TEST_P(SgdMatchesTorch, OverManySteps) {
  auto c = GetParam();
  torch::manual_seed(0);
  models::ModelOptions mo;
  mo.name = "mlp";
  mo.width = 16;
  models::InputSpec in{1, 4, 4, 3};
  auto ours = models::make_model(mo, in);
  torch::manual_seed(0);
  auto ref = models::make_model(mo, in);
  FlatParams flat(*ours);
  Sgd sgd(sgd_options(c.momentum, c.dampening, c.wd, c.nesterov));
  torch::optim::SGD tsgd(ref->parameters(), torch::optim::SGDOptions(0.05)
                                                .momentum(c.momentum)
                                                .dampening(c.dampening)
                                                .weight_decay(c.wd)
                                                .nesterov(c.nesterov));
  for (int step = 0; step < 20; ++step) {
    auto x = torch::randn({8, 1, 4, 4});
    auto y = torch::randint(0, 3, {8});
    double lr = 0.05 * (1.0 + 0.1 * step);  // the rate may change every step
    static_cast<torch::optim::SGDOptions&>(tsgd.param_groups()[0].options()).lr(lr);
    flat.zero_grad();
    torch::nn::functional::cross_entropy(ours->forward(x), y).backward();
    sgd.step(flat.data(), flat.grad(), lr);
    tsgd.zero_grad();
    torch::nn::functional::cross_entropy(ref->forward(x), y).backward();
    tsgd.step();
  }
  auto a = ours->parameters(), b = ref->parameters();
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i)
    EXPECT_TRUE(torch::allclose(a[i], b[i], 1e-5, 1e-6)) << "parameter " << i;
}

INSTANTIATE_TEST_SUITE_P(Variants, SgdMatchesTorch,
                         ::testing::Values(SgdCase{0, 0, 0, false}, SgdCase{0.9, 0, 0, false},
                                           SgdCase{0.9, 0, 5e-4, true}, SgdCase{0.5, 0.3, 1e-3, false}));

TEST(Sgd, RejectsNesterovWithoutMomentum) {
  EXPECT_THROW(Sgd(sgd_options(0.0, 0.0, 0.0, true)), InvalidInput);
}

TEST(FlatParams, ParametersAndGradientsLiveInTheFlatBuffers) {
  models::ModelOptions mo;
  mo.name = "lenet";
  auto net = models::make_model(mo, {1, 28, 28, 10});
  auto before = net->parameters();
  std::vector<torch::Tensor> values;
  for (auto& p : before) values.push_back(p.detach().clone());
  FlatParams flat(*net);
  EXPECT_EQ(flat.numel(), models::parameter_count(*net));
  auto params = net->parameters();
  for (size_t i = 0; i < params.size(); ++i) EXPECT_TRUE(torch::equal(params[i], values[i]));
  // Writing the flat buffer changes the parameters.
  flat.data().fill_(0.5);
  EXPECT_EQ(params[0].view(-1)[0].item<float>(), 0.5f);
  // Backward accumulates into the flat gradient, twice = double.
  flat.zero_grad();
  auto x = torch::randn({2, 1, 28, 28});
  net->forward(x).sum().backward();
  auto once = flat.grad().clone();
  EXPECT_GT(once.abs().sum().item<double>(), 0);
  net->forward(x).sum().backward();
  EXPECT_TRUE(torch::allclose(flat.grad(), 2 * once));
  EXPECT_EQ(params[0].grad().data_ptr<float>(), flat.grad().data_ptr<float>());
}

// A user's frozen parameters (requires_grad = false) are left out: no
// place in the flat buffers (so no bucket, no all-reduce, no update), no
// gradient, and their values untouched by anything done to the flat buffers.
TEST(FlatParams, FrozenParametersAreLeftOut) {
  torch::manual_seed(3);
  torch::nn::Sequential net(torch::nn::Linear(4, 3), torch::nn::ReLU(), torch::nn::Linear(3, 2));
  auto frozen_w = net->named_parameters()["0.weight"];
  frozen_w.requires_grad_(false);
  const auto frozen_before = frozen_w.detach().clone();
  FlatParams flat(*net);
  EXPECT_EQ(flat.numel(), 3 + 6 + 2);  // 0.bias, 2.weight, 2.bias
  EXPECT_EQ(flat.frozen_numel(), 12);
  std::vector<std::string> names;
  for (const auto& e : flat.entries()) names.push_back(e.name);
  EXPECT_EQ(names, (std::vector<std::string>{"0.bias", "2.weight", "2.bias"}));
  EXPECT_EQ(flat.parameters().size(), 3u);
  flat.zero_grad();
  net->forward(torch::randn({5, 4})).sum().backward();
  EXPECT_FALSE(frozen_w.grad().defined());
  EXPECT_GT(flat.grad().abs().sum().item<double>(), 0);
  flat.data().sub_(flat.grad(), 0.1);  // an update
  EXPECT_TRUE(torch::equal(frozen_w, frozen_before));
}

// Buffers of every dtype travel through the float32 region and come back
// exactly: float16/bfloat16 as float32, float64 as three 24-bit pieces of
// its bits (any value: found by a review, values beyond float32's range came
// back as NaN), integers and bools as three 24-bit pieces, down to int64's
// extremes.
TEST(FlatParams, BuffersOfEveryDtypeRoundTripExactlyThroughTheRegion) {
  torch::nn::Module m;
  auto f64 = m.register_buffer("f64", torch::tensor({1.0 / 3.0, -2.5e-12, 123456789.123456789, 1e300, -4e-320,
                                                     std::numeric_limits<double>::infinity(), -0.0},
                                                    torch::kFloat64));
  auto f16 = m.register_buffer("f16", torch::tensor({0.1, -65504.0}, torch::kFloat64).to(torch::kFloat16));
  auto bf16 = m.register_buffer("bf16", torch::tensor({3.0e38, -1.5}, torch::kFloat64).to(torch::kBFloat16));
  auto i64 = m.register_buffer("i64", torch::tensor({std::numeric_limits<int64_t>::min(), int64_t{-1}, int64_t{0},
                                                     (int64_t{1} << 40) + 3, std::numeric_limits<int64_t>::max()}));
  auto i32 = m.register_buffer("i32", torch::tensor({-7, 1 << 30}, torch::kInt32));
  auto u8 = m.register_buffer("u8", torch::tensor({0, 255}, torch::kUInt8));
  auto flag = m.register_buffer("flag", torch::tensor({true, false, true}));
  auto f32 = m.register_buffer("f32", torch::tensor({0.25f, -4.0f}));
  FlatParams flat(m);
  EXPECT_EQ(flat.averaged_numel(), 2 + 2 + 2);  // f32, f16, bf16 one float each
  EXPECT_EQ(flat.buffer_numel(), flat.averaged_numel() + 3 * (7 + 5 + 2 + 2 + 3));
  std::vector<torch::Tensor> want;
  for (const auto& b : flat.buffer_entries()) want.push_back(b.tensor.clone());
  flat.buffers_to_flat();
  for (const auto& b : flat.buffer_entries())  // (a float32 buffer is the region: it stays)
    if (b.carry != FlatParams::Carry::InPlace) b.tensor.zero_();
  flat.flat_to_buffers();
  for (size_t i = 0; i < want.size(); ++i)
    EXPECT_TRUE(torch::equal(flat.buffer_entries()[i].tensor, want[i])) << flat.buffer_entries()[i].name;
  // The float32 buffer is the region itself.
  EXPECT_EQ(f32.data_ptr<float>(), flat.buffers().data_ptr<float>());
  // save_buffers / restore_buffers put every dtype back.
  auto saved = flat.save_buffers();
  i64.fill_(5);
  flag.fill_(false);
  f64.fill_(0.0);
  flat.restore_buffers(saved);
  for (size_t i = 0; i < want.size(); ++i) EXPECT_TRUE(torch::equal(flat.buffer_entries()[i].tensor, want[i]));
}

TEST(FlatParams, ChannelsLastLayoutGivesTheSameGradients) {
  models::ModelOptions mo;
  mo.name = "lenet";
  torch::manual_seed(3);
  auto a = models::make_model(mo, {1, 28, 28, 10});
  torch::manual_seed(3);
  auto b = models::make_model(mo, {1, 28, 28, 10});
  FlatParams fa(*a, false), fb(*b, true);
  EXPECT_TRUE(torch::equal(a->parameters()[0], b->parameters()[0]));  // same values
  EXPECT_TRUE(b->parameters()[2].is_contiguous(at::MemoryFormat::ChannelsLast));  // conv2 (20 in)
  EXPECT_FALSE(b->parameters()[2].is_contiguous());
  auto x = torch::randn({4, 1, 28, 28});
  auto y = torch::randint(0, 10, {4});
  fa.zero_grad();
  fb.zero_grad();
  torch::nn::functional::cross_entropy(a->forward(x), y).backward();
  torch::nn::functional::cross_entropy(b->forward(x.contiguous(at::MemoryFormat::ChannelsLast)), y)
      .backward();
  auto pa = a->parameters(), pb = b->parameters();
  for (size_t i = 0; i < pa.size(); ++i)
    EXPECT_TRUE(torch::allclose(pa[i].grad(), pb[i].grad(), 1e-4, 1e-6)) << i;
  EXPECT_EQ(pb[0].grad().data_ptr<float>(), fb.grad().data_ptr<float>());
}

LrScheduleOptions base(const std::string& kind) {
  LrScheduleOptions o;
  o.kind = kind;
  o.base_lr = 0.1;
  return o;
}

TEST(LrSchedule, Constant) {
  LrSchedule s(base("constant"));
  EXPECT_DOUBLE_EQ(s.lr(0, 0), 0.1);
  EXPECT_DOUBLE_EQ(s.lr(55.5, 9999), 0.1);
}

TEST(LrSchedule, Step) {
  auto o = base("step");
  o.step_epochs = 2;
  o.gamma = 0.5;
  LrSchedule s(o);
  EXPECT_DOUBLE_EQ(s.lr(1.99, 0), 0.1);
  EXPECT_DOUBLE_EQ(s.lr(2.0, 0), 0.05);
  EXPECT_DOUBLE_EQ(s.lr(5.0, 0), 0.025);
}

TEST(LrSchedule, Multistep) {
  auto o = base("multistep");
  o.milestones = {3, 7};
  LrSchedule s(o);
  EXPECT_DOUBLE_EQ(s.lr(2.9, 0), 0.1);
  EXPECT_NEAR(s.lr(3.0, 0), 0.01, 1e-15);
  EXPECT_NEAR(s.lr(9.0, 0), 0.001, 1e-15);
}

TEST(LrSchedule, Cosine) {
  auto o = base("cosine");
  o.cosine_epochs = 10;
  o.min_lr = 0.001;
  LrSchedule s(o);
  EXPECT_DOUBLE_EQ(s.lr(0, 0), 0.1);
  EXPECT_NEAR(s.lr(5, 0), 0.001 + 0.099 * 0.5, 1e-12);
  EXPECT_NEAR(s.lr(10, 0), 0.001, 1e-12);
  EXPECT_NEAR(s.lr(12, 0), 0.001, 1e-12);
}

TEST(LrSchedule, CaffeInv) {
  auto o = base("inv");
  o.inv_gamma = 1e-4;
  o.inv_power = 0.75;
  LrSchedule s(o);
  EXPECT_DOUBLE_EQ(s.lr(0, 0), 0.1);
  EXPECT_NEAR(s.lr(3.0, 10000), 0.1 * std::pow(2.0, -0.75), 1e-12);
}

TEST(LrSchedule, LinearWarmupComposes) {
  auto o = base("step");
  o.step_epochs = 1;
  o.gamma = 0.5;
  o.warmup_epochs = 2;
  o.warmup_start_factor = 0.0;
  LrSchedule s(o);
  EXPECT_DOUBLE_EQ(s.lr(0, 0), 0.0);
  EXPECT_NEAR(s.lr(0.5, 0), 0.1 * 0.25, 1e-12);
  EXPECT_NEAR(s.lr(1.5, 0), 0.05 * 0.75, 1e-12);
  EXPECT_NEAR(s.lr(2.0, 0), 0.025, 1e-12);
}

TEST(LrSchedule, RejectsBadSettings) {
  EXPECT_THROW(LrSchedule(base("exp")), InvalidInput);
  EXPECT_THROW(LrSchedule(base("multistep")), InvalidInput);
  EXPECT_THROW(parse_milestones("5,3", "optim.milestones"), InvalidInput);
  EXPECT_THROW(parse_milestones("5,x", "optim.milestones"), InvalidInput);
  EXPECT_EQ(parse_milestones("1,2.5", "k"), (std::vector<double>{1, 2.5}));
}

}  // namespace
