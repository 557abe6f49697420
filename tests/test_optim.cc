// The optimizers (SGD against libtorch's own torch::optim::SGD; Adam and
// AdamW against torch::optim::Adam / AdamW and against PyTorch for Python on
// recorded gradients), gradient clipping, flat parameter storage, and
// learning-rate schedules.
#include <gtest/gtest.h>

#include <cmath>
#include <fstream>
#include <limits>

#include "common/error.h"
#include "models/net.h"
#include "optim/flat_params.h"
#include "optim/lr_schedule.h"
#include "optim/adam.h"
#include "optim/clip.h"
#include "optim/sgd.h"
#include "test_util.h"

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

OptimizerOptions adam_options(const std::string& algo) {
  OptimizerOptions o;
  o.algorithm = algo;
  o.beta1 = 0.9;
  o.beta2 = 0.98;
  o.eps = 1e-6;
  o.weight_decay = 0.01;
  return o;
}

// Recorded gradients: mixed scales (so eps matters for some weights), signs
// that change, a few exact zeros.
torch::Tensor recorded_gradients(int64_t steps, int64_t n) {
  torch::manual_seed(7);
  auto g = torch::randn({steps, n});
  auto scale = torch::logspace(-6, 1, n);
  g = g * scale;
  g.index_put_({torch::indexing::Slice(), torch::indexing::Slice(0, 5)}, 0.0);
  return g.contiguous();
}

class AdamMatchesTorch : public ::testing::TestWithParam<std::string> {};

// 100 steps of Limbo's Adam / AdamW on one flat tensor against libtorch's
// torch::optim::Adam / AdamW on the same tensor, with a learning rate that
// changes every step (schedules and policies pass it per step).
TEST_P(AdamMatchesTorch, OnRecordedGradients) {
  const std::string algo = GetParam();
  const int64_t n = 2000, steps = 100;
  auto g = recorded_gradients(steps, n);
  torch::manual_seed(3);
  torch::Tensor w = torch::randn({n});
  auto ref = w.clone().requires_grad_(true);
  auto o = adam_options(algo);
  auto ours = make_optimizer(o);
  std::unique_ptr<torch::optim::Optimizer> theirs;
  if (algo == "adamw")
    theirs = std::make_unique<torch::optim::AdamW>(
        std::vector<torch::Tensor>{ref},
        torch::optim::AdamWOptions(1e-3).betas({o.beta1, o.beta2}).eps(o.eps).weight_decay(o.weight_decay));
  else
    theirs = std::make_unique<torch::optim::Adam>(
        std::vector<torch::Tensor>{ref},
        torch::optim::AdamOptions(1e-3).betas({o.beta1, o.beta2}).eps(o.eps).weight_decay(o.weight_decay));
  double worst = 0;
  for (int64_t t = 0; t < steps; ++t) {
    const double lr = 3e-3 * (1.0 - 0.005 * t);
    theirs->param_groups()[0].options().set_lr(lr);
    ref.mutable_grad() = g[t].clone();
    theirs->step();
    ASSERT_TRUE(ours->step(w, g[t].contiguous(), lr));
    worst = std::max(worst, (w - ref.detach()).abs().max().item<double>());
  }
  EXPECT_EQ(ours->steps(), steps);
  EXPECT_EQ(ours->state_names(), (std::vector<std::string>{"exp_avg", "exp_avg_sq"}));
  // libtorch's own kernels round differently from one fused pass by a few
  // ulps of the weights (|w| < 5 here).
  EXPECT_LT(worst, 2e-6) << algo;
  RecordProperty("max_abs_diff", std::to_string(worst));
}

INSTANTIATE_TEST_SUITE_P(Algorithms, AdamMatchesTorch, ::testing::Values("adam", "adamw"));

// The requirement's oracle: torch.optim.Adam and torch.optim.AdamW of
// PyTorch for Python, replaying the same recorded gradients at a constant
// rate; every weight after every step within 4 float32 ulps (+1e-7).
TEST(Adam, EqualsPyTorchForPythonOnRecordedGradients) {
  if (!limbo::testing::have_python_torch()) GTEST_SKIP() << "python3-torch is not installed";
  const int64_t n = 2000, steps = 100;
  const double lr = 3e-3;
  auto g = recorded_gradients(steps, n);
  limbo::testing::TempDir d;
  for (std::string algo : {"adam", "adamw"}) {
    torch::manual_seed(3);
    torch::Tensor w0 = torch::randn({n});
    torch::Tensor w = w0.clone();
    auto o = adam_options(algo);
    auto opt = make_optimizer(o);
    std::vector<torch::Tensor> after;
    for (int64_t t = 0; t < steps; ++t) {
      opt->step(w, g[t].contiguous(), lr);
      after.push_back(w.clone());
    }
    auto all = torch::cat({w0, g.view({-1}), torch::stack(after).view({-1})});
    const std::string file = d.file(algo + ".bin");
    std::ofstream(file, std::ios::binary)
        .write(reinterpret_cast<const char*>(all.data_ptr<float>()), all.numel() * 4);
    std::string out;
    const int rc = limbo::testing::run_python(
        "check_adam.py", {file, algo, std::to_string(n), std::to_string(steps), "0.003", "0.9", "0.98", "1e-06", "0.01"},
        &out);
    EXPECT_EQ(rc, 0) << out;
    EXPECT_NE(out.find("0 beyond tolerance"), std::string::npos) << out;
    std::printf("%s", out.c_str());
  }
}

TEST(Adam, RefusesBadSettings) {
  auto o = adam_options("adam");
  o.beta1 = 1.0;
  EXPECT_THROW(make_optimizer(o), InvalidInput);
  o = adam_options("adamw");
  o.eps = -1;
  EXPECT_THROW(make_optimizer(o), InvalidInput);
  o.algorithm = "lamb";
  EXPECT_THROW(make_optimizer(o), InvalidInput);
}

// The state goes by name and count: a snapshot restores the next update
// exactly, set_state() adopts a peer's state, and scale_momentum() touches
// exp_avg only (0: everything starts afresh).
TEST(Optimizer, StateSnapshotsRestoreTheNextUpdateExactly) {
  const int64_t n = 300;
  auto g = recorded_gradients(4, n);
  torch::Tensor w = torch::ones({n});
  auto a = make_optimizer(adam_options("adamw"));
  EXPECT_FALSE(a->has_state());
  a->step(w, g[0].contiguous(), 1e-2);
  a->step(w, g[1].contiguous(), 1e-2);
  auto snap = a->snapshot();
  torch::Tensor w_snap = w.clone();
  a->step(w, g[2].contiguous(), 1e-2);
  torch::Tensor w_next = w.clone();
  a->restore(snap);
  EXPECT_EQ(a->steps(), 2);
  torch::Tensor w2 = w_snap.clone();
  a->step(w2, g[2].contiguous(), 1e-2);
  EXPECT_TRUE(torch::equal(w2, w_next));
  // A second optimizer given the first's state makes the same next update.
  auto b = make_optimizer(adam_options("adamw"));
  b->set_state(a->snapshot().tensors, a->steps());
  torch::Tensor w3 = w2.clone(), w4 = w2.clone();
  a->step(w3, g[3].contiguous(), 1e-2);
  b->step(w4, g[3].contiguous(), 1e-2);
  EXPECT_TRUE(torch::equal(w3, w4));
  auto v_before = b->state()[1].clone();
  auto m_before = b->state()[0].clone();
  b->scale_momentum(0.5);
  EXPECT_TRUE(torch::equal(b->state()[0], m_before * 0.5));
  EXPECT_TRUE(torch::equal(b->state()[1], v_before));
  b->scale_momentum(0);
  EXPECT_FALSE(b->has_state());
  EXPECT_EQ(b->steps(), 0);
  // Wrong shapes are refused, naming the tensor.
  EXPECT_THROW(b->set_state({torch::zeros({n})}, 1), InvalidInput);
}

// Under the square-root rule at batch ratio kappa, Adam runs with
// 1 - beta = kappa (1 - beta) and eps / sqrt(kappa): the same updates as an
// Adam configured with those values.
TEST(Adam, TheBatchScaleSetsTheSquareRootRulesBetasAndEps) {
  const int64_t n = 400;
  auto g = recorded_gradients(5, n);
  auto o = adam_options("adamw");
  auto scaled = make_optimizer(o);
  scaled->set_batch_scale(4.0);
  auto p = o;
  p.beta1 = 1.0 - 4.0 * (1.0 - o.beta1);
  p.beta2 = 1.0 - 4.0 * (1.0 - o.beta2);
  p.eps = o.eps / 2.0;
  auto plain = make_optimizer(p);
  torch::Tensor w1 = torch::ones({n}), w2 = torch::ones({n});
  for (int t = 0; t < 5; ++t) {
    scaled->step(w1, g[t].contiguous(), 1e-3);
    plain->step(w2, g[t].contiguous(), 1e-3);
  }
  EXPECT_TRUE(torch::allclose(w1, w2, 1e-6, 1e-7));
  // A kappa so large that kappa (1 - beta) passes 1: both betas stop at 0
  // (no average of the past left) and eps is divided by sqrt(1000): the
  // update of an Adam set that way, from the same state.
  scaled->set_batch_scale(1000.0);
  auto clamped = o;
  clamped.beta1 = 0.0;
  clamped.beta2 = 0.0;
  clamped.eps = o.eps / std::sqrt(1000.0);
  auto at_zero = make_optimizer(clamped);
  const auto before = scaled->snapshot();
  at_zero->set_state(before.tensors, before.steps);
  torch::Tensor w3 = w1.clone();
  EXPECT_TRUE(scaled->step(w1, g[0].contiguous(), 1e-3));
  at_zero->step(w3, g[0].contiguous(), 1e-3);
  EXPECT_TRUE(torch::allclose(w1, w3, 1e-6, 1e-7));
  EXPECT_TRUE(torch::allclose(scaled->state()[0], g[0], 1e-6, 1e-7));  // exp_avg is the gradient alone
}

// The parameter server's SGD form (rate inside the buffer) equals PyTorch's
// form at a constant rate.
TEST(Sgd, TheRateInsideTheBufferAgreesAtAConstantRate) {
  const int64_t n = 500;
  auto g = recorded_gradients(10, n);
  auto o = sgd_options(0.9, 0, 1e-3, false);
  Sgd torch_form(o);
  o.lr_in_buffer = true;
  Sgd ps_form(o);
  torch::Tensor w1 = torch::ones({n}), w2 = torch::ones({n});
  for (int t = 0; t < 10; ++t) {
    torch_form.step(w1, g[t].contiguous(), 0.05);
    ps_form.step(w2, g[t].contiguous(), 0.05);
  }
  EXPECT_TRUE(torch::allclose(w1, w2, 1e-5, 1e-6));
  EXPECT_TRUE(torch::allclose(ps_form.state()[0], torch_form.state()[0] * 0.05, 1e-5, 1e-7));
}

// optim.clip_grad_norm on the flat gradient equals
// torch::nn::utils::clip_grad_norm_ (PyTorch's rule) on the parameters'
// own gradients: the same norm, the same clipped values.
TEST(Clip, EqualsTorchClipGradNormOverTheParameters) {
  torch::manual_seed(0);
  models::ModelOptions mo;
  mo.name = "mlp";
  mo.width = 32;
  auto net = models::make_model(mo, {1, 8, 8, 10});
  FlatParams flat(*net);
  auto x = torch::randn({16, 1, 8, 8});
  auto y = torch::randint(0, 10, {16});
  for (double max_norm : {0.05, 1e6}) {
    flat.zero_grad();
    torch::nn::functional::cross_entropy(net->forward(x), y).backward();
    std::vector<torch::Tensor> grads;
    for (auto& p : net->parameters()) grads.push_back(p.grad().clone());
    // The reference on copies of the per-parameter gradients.
    std::vector<torch::Tensor> ref;
    for (auto& gr : grads) ref.push_back(torch::zeros_like(gr).requires_grad_(true));
    for (size_t i = 0; i < ref.size(); ++i) ref[i].mutable_grad() = grads[i].clone();
    const double want = torch::nn::utils::clip_grad_norm_(ref, max_norm);
    const double got = clip_grad_norm(flat.grad(), max_norm);
    EXPECT_NEAR(got, want, 1e-6 * want);
    auto params = net->parameters();
    for (size_t i = 0; i < params.size(); ++i)
      EXPECT_TRUE(torch::allclose(params[i].grad(), ref[i].grad(), 1e-6, 1e-9)) << "parameter " << i;
    if (max_norm < want) EXPECT_NEAR(grad_norm(flat.grad()), max_norm, 1e-5 * max_norm);
    else EXPECT_TRUE(torch::equal(torch::cat(grads.empty() ? std::vector<torch::Tensor>{} : [&] {
                       std::vector<torch::Tensor> v;
                       for (auto& t : grads) v.push_back(t.view({-1}));
                       return v;
                     }()), flat.grad()))
        << "a gradient below the limit is left exactly as it was";
  }
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

// With include_frozen (the Python front end), a frozen float32 parameter
// sits in the flat buffers as a view, with no gradient while frozen
// (attach_grad leaves `.grad` undefined and its view zeros, so an
// optimizer skips it); unfrozen later, its gradient lands in its view.
TEST(FlatParams, FrozenParametersIncludedMayBeUnfrozenLater) {
  torch::manual_seed(3);
  torch::nn::Sequential net(torch::nn::Linear(4, 3), torch::nn::ReLU(), torch::nn::Linear(3, 2));
  auto frozen_w = net->named_parameters()["0.weight"];
  frozen_w.requires_grad_(false);
  const auto before = frozen_w.detach().clone();
  FlatParams flat(*net, /*channels_last=*/false, /*include_frozen=*/true);
  EXPECT_EQ(flat.numel(), 12 + 3 + 6 + 2);
  EXPECT_EQ(flat.frozen_numel(), 0);
  ASSERT_EQ(flat.parameters().size(), 4u);
  EXPECT_EQ(flat.entries()[0].name, "0.weight");
  EXPECT_TRUE(torch::equal(frozen_w, before));
  EXPECT_EQ(frozen_w.data_ptr<float>(), flat.data().data_ptr<float>());
  EXPECT_FALSE(frozen_w.requires_grad());
  EXPECT_FALSE(frozen_w.grad().defined());
  auto x = torch::randn({5, 4});
  auto step = [&] {
    flat.release_grads();
    net->forward(x).sum().backward();
    flat.attach_grads(/*keep=*/true);
  };
  step();
  EXPECT_FALSE(frozen_w.grad().defined()) << "frozen: no gradient for an optimizer to step with";
  EXPECT_EQ(flat.grad().narrow(0, 0, 12).abs().sum().item<float>(), 0.0f) << "frozen: zeros on the wire";
  EXPECT_GT(flat.grad().narrow(0, 12, 11).abs().sum().item<double>(), 0);
  // Unfrozen: the same backward now gives it a gradient, in its view.
  frozen_w.requires_grad_(true);
  step();
  ASSERT_TRUE(frozen_w.grad().defined());
  EXPECT_EQ(frozen_w.grad().data_ptr<float>(), flat.grad().data_ptr<float>());
  EXPECT_GT(flat.grad().narrow(0, 0, 12).abs().sum().item<double>(), 0);
  // Frozen again: its last gradient leaves the view (zeroed once).
  frozen_w.requires_grad_(false);
  step();
  EXPECT_FALSE(frozen_w.grad().defined());
  EXPECT_EQ(flat.grad().narrow(0, 0, 12).abs().sum().item<float>(), 0.0f) << "a frozen parameter's old gradient";
  // A dropped gradient (a bucket that stayed off the wire) stays dropped
  // until autograd gives it a new one.
  frozen_w.requires_grad_(true);
  step();
  flat.drop_grad(0);
  flat.attach_grads(/*keep=*/true);
  EXPECT_FALSE(frozen_w.grad().defined());
  EXPECT_EQ(flat.grad().narrow(0, 0, 12).abs().sum().item<float>(), 0.0f);
  step();
  EXPECT_TRUE(frozen_w.grad().defined());
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
