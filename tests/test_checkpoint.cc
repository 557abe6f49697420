// Checkpoints: round trip, exact resume (in process), refusal to overwrite,
// and interoperability with PyTorch for Python.
#include <gtest/gtest.h>

#include <cstdlib>

#include "common/error.h"
#include "common/files.h"
#include "models/net.h"
#include "optim/flat_params.h"
#include "optim/optimizer.h"
#include "train/checkpoint.h"
#include "train/safetensors.h"
#include "train/step.h"
#include "train/trainer.h"
#include "test_util.h"

using namespace limbo;
using namespace limbo::train;

namespace {

TrainerConfig small_config(const std::string& run_dir, int64_t epochs) {
  TrainerConfig c;
  c.source.dataset = "synthetic";
  c.source.train_limit = 300;
  c.source.test_limit = 100;
  c.model.name = "lenet";
  c.loader.batch_size = 32;
  c.optimizer.momentum = 0.9;
  c.optimizer.weight_decay = 1e-4;
  c.lr.kind = "step";
  c.lr.base_lr = 0.02;
  c.lr.step_epochs = 1;
  c.lr.gamma = 0.5;
  c.train.epochs = epochs;
  c.train.progress = false;
  c.threads.intra_op = 1;
  c.run_dir = run_dir;
  c.config_toml = "[train]\nepochs = " + std::to_string(epochs) + "\n";
  return c;
}

TEST(Checkpoint, RoundTripRestoresWeightsMomentumAndState) {
  limbo::testing::TempDir d;
  auto cfg = small_config(d.path(), 1);
  cfg.train.max_steps = 4;
  Trainer a(cfg);
  a.run();
  Trainer b(small_config("", 1));
  EXPECT_FALSE(torch::equal(a.params().data(), b.params().data()));
  auto st = load_checkpoint(d.file("checkpoint.pt"), b.model(), &b.optimizer());
  EXPECT_TRUE(torch::equal(a.params().data(), b.params().data()));
  EXPECT_TRUE(torch::equal(a.optimizer().state()[0], b.optimizer().state()[0]));
  EXPECT_EQ(st.step, 4);
  EXPECT_EQ(st.cursor.epoch, 0);
  EXPECT_EQ(st.cursor.position, 128);
  EXPECT_EQ(st.samples, 128);
  EXPECT_EQ(st.config_toml, cfg.config_toml);
  EXPECT_EQ(read_checkpoint_config(d.file("checkpoint.pt")), cfg.config_toml);
  // Parameters are still views of the flat buffer after loading.
  b.params().data().zero_();
  EXPECT_EQ(b.model().parameters()[0].abs().sum().item<float>(), 0.0f);
}

TrainerConfig with_algorithm(TrainerConfig c, const std::string& algo) {
  c.algorithm = algo;
  c.optimizer.algorithm = algo;
  if (algo != "sgd") {
    c.lr.base_lr = 1e-3;
    c.optimizer.weight_decay = 0.01;
    c.clip_grad_norm = 1.0;
  }
  return c;
}

class ResumeIsExact : public ::testing::TestWithParam<std::string> {};

// Two epochs straight, or one and a resume from its checkpoint: the same
// weights and optimizer state, bit for bit (SGD's momentum; AdamW's moments
// and update count, which its bias correction needs).
TEST_P(ResumeIsExact, ForEachOptimizer) {
  const std::string algo = GetParam();
  limbo::testing::TempDir full, part;
  Trainer a(with_algorithm(small_config(full.path(), 2), algo));
  auto sa = a.run();
  {
    Trainer b(with_algorithm(small_config(part.path(), 1), algo));  // stops after epoch 1
    b.run();
  }
  auto cfg = with_algorithm(small_config(part.path(), 2), algo);
  cfg.train.resume = true;
  Trainer c(cfg);
  auto sc = c.run();
  EXPECT_EQ(sc["resumed_from_step"].get<int64_t>(), 10);
  EXPECT_EQ(sa["steps"], sc["steps"]);
  EXPECT_EQ(sa["samples"], sc["samples"]);
  // Same thread count and data order: bit-identical.
  EXPECT_TRUE(torch::equal(a.params().data(), c.params().data()));
  ASSERT_EQ(a.optimizer().state().size(), c.optimizer().state().size());
  for (size_t i = 0; i < a.optimizer().state().size(); ++i)
    EXPECT_TRUE(torch::equal(a.optimizer().state()[i], c.optimizer().state()[i])) << a.optimizer().state_names()[i];
  EXPECT_EQ(a.optimizer().steps(), c.optimizer().steps());
  EXPECT_DOUBLE_EQ(sa["test_accuracy"].get<double>(), sc["test_accuracy"].get<double>());
}

INSTANTIATE_TEST_SUITE_P(Optimizers, ResumeIsExact, ::testing::Values("sgd", "adamw"));

// A checkpoint's AdamW state loads into torch.optim.AdamW of PyTorch for
// Python (cut from the flat buffer into the parameters' shapes), and the
// next step there equals Limbo's next step from the same checkpoint.
TEST(Checkpoint, AdamWStateLoadsIntoPyTorchAndTheNextStepAgrees) {
  if (!limbo::testing::have_python_torch()) GTEST_SKIP() << "python3-torch is not installed";
  limbo::testing::TempDir d;
  auto cfg = with_algorithm(small_config(d.path(), 1), "adamw");
  cfg.model.name = "mlp";
  cfg.optimizer.beta2 = 0.99;
  cfg.train.max_steps = 5;
  Trainer(cfg).run();
  auto tc = cfg;
  tc.run_dir.clear();
  Trainer b(tc);
  auto st = load_checkpoint(d.file("checkpoint.pt"), b.model(), &b.optimizer());
  ASSERT_EQ(b.optimizer().steps(), 5);
  torch::manual_seed(11);
  torch::Tensor g = torch::randn({b.params().numel()}) * 0.01;
  const double lr = 2e-3;
  b.optimizer().step(b.params().data(), g, lr);
  std::string names;
  for (const auto& p : b.model().named_parameters(true))
    if (p.value().requires_grad()) names += p.key() + "\n";
  limbo::testing::write_bytes(d.file("names.txt"), names, false);
  auto all = torch::cat({g, b.params().data()});
  limbo::testing::write_bytes(
      d.file("step.bin"), std::string(reinterpret_cast<const char*>(all.data_ptr<float>()), all.numel() * 4), false);
  std::string out;
  const int rc = limbo::testing::run_python("check_adam_state.py",
                                            {d.file("checkpoint.pt"), d.file("names.txt"), d.file("step.bin"),
                                             "0.002", "0.9", "0.99", "1e-08", "0.01"},
                                            &out);
  EXPECT_EQ(rc, 0) << out;
  EXPECT_NE(out.find("adamw state ok"), std::string::npos) << out;
  std::printf("%s", out.c_str());
}

// A checkpoint of SGD's state resumed by AdamW: the weights load, the
// optimizer starts afresh (and says so), nothing is mixed.
TEST(Checkpoint, AnotherOptimizersStateIsNotLoaded) {
  limbo::testing::TempDir d;
  auto cfg = small_config(d.path(), 1);
  cfg.train.max_steps = 2;
  Trainer(cfg).run();
  Trainer b(with_algorithm(small_config("", 1), "adamw"));
  load_checkpoint(d.file("checkpoint.pt"), b.model(), &b.optimizer());
  EXPECT_FALSE(b.optimizer().has_state());
  EXPECT_EQ(b.optimizer().steps(), 0);
}

// Found: resuming after the frozen set changed (the usual "unfreeze the
// backbone, then --resume") stepped an m-float state with n > m floats of
// parameters, writing past its end; with fewer trainable parameters it used
// the wrong slices. Now the load is refused, naming each parameter whose
// requires_grad changed, either way; the optimizer itself refuses a state of
// another size; and the same frozen set resumes.
TEST(Checkpoint, AStateSavedForOtherTrainableParametersIsRefusedByName) {
  limbo::testing::TempDir d;
  torch::nn::Sequential net(torch::nn::Linear(4, 3), torch::nn::Linear(3, 2));
  auto set_frozen = [&](bool frozen) {
    for (auto& p : net[0]->parameters()) p.set_requires_grad(!frozen);
  };
  auto trainable = [&] {
    int64_t n = 0;
    for (auto& p : net->parameters())
      if (p.requires_grad()) n += p.numel();
    return n;
  };
  optim::OptimizerOptions oo;
  oo.algorithm = "adamw";
  set_frozen(true);
  auto opt = optim::make_optimizer(oo);
  torch::Tensor w = torch::zeros({trainable()}), g = torch::ones({trainable()});
  opt->step(w, g, 0.01);
  TrainState st;
  save_checkpoint(d.file("c.pt"), *net, *opt, st);
  for (bool frozen : {false, true}) {
    SCOPED_TRACE(frozen ? "the same frozen set" : "unfrozen");
    set_frozen(frozen);
    auto fresh = optim::make_optimizer(oo);
    if (frozen) {
      EXPECT_NO_THROW(load_checkpoint(d.file("c.pt"), *net, fresh.get()));
      EXPECT_EQ(fresh->steps(), 1);
      continue;
    }
    try {
      load_checkpoint(d.file("c.pt"), *net, fresh.get());
      ADD_FAILURE() << "a state of 8 floats loaded for 23 trainable floats";
    } catch (const InvalidInput& e) {
      const std::string m = e.what();
      EXPECT_NE(m.find("0.weight (frozen then, trainable now)"), std::string::npos) << m;
      EXPECT_NE(m.find("0.bias (frozen then, trainable now)"), std::string::npos) << m;
      EXPECT_EQ(m.find("1.weight"), std::string::npos) << m;
    }
  }
  // The other way: saved with everything trainable, resumed with the first
  // layer frozen.
  set_frozen(false);
  auto all = optim::make_optimizer(oo);
  torch::Tensor w2 = torch::zeros({trainable()}), g2 = torch::ones({trainable()});
  all->step(w2, g2, 0.01);
  save_checkpoint(d.file("all.pt"), *net, *all, st);
  set_frozen(true);
  auto fewer = optim::make_optimizer(oo);
  try {
    load_checkpoint(d.file("all.pt"), *net, fewer.get());
    ADD_FAILURE() << "a state of 23 floats loaded for 8 trainable floats";
  } catch (const InvalidInput& e) {
    EXPECT_NE(std::string(e.what()).find("0.weight (trainable then, frozen now)"), std::string::npos) << e.what();
  }
  // The optimizer never steps a state of another size.
  auto small = optim::make_optimizer(oo);
  small->set_state({torch::zeros({8}), torch::zeros({8})}, 1);
  torch::Tensor big = torch::zeros({23}), big_g = torch::ones({23});
  EXPECT_THROW(small->step(big, big_g, 0.01), std::invalid_argument);
}

// Found: a checkpoint written without the optimizer's moments (by a member
// that held only its shard of a sharded state) kept the update count, so a
// resumed Adam started with zero moments at t = N + 1: its bias correction
// off, the first steps about 3x too long. Now the count restarts at 0 with
// the moments, as PyTorch starts a fresh state, and the load says so; the
// first update then equals a fresh optimizer's.
TEST(Checkpoint, NoMomentsMeansTheUpdateCountRestarts) {
  limbo::testing::TempDir d;
  torch::nn::Sequential net(torch::nn::Linear(4, 3));
  optim::OptimizerOptions oo;
  oo.algorithm = "adam";
  auto bare = optim::make_optimizer(oo);
  bare->set_state({}, 500);  // what a member holding only its shard writes
  TrainState st;
  save_checkpoint(d.file("c.pt"), *net, *bare, st);
  auto resumed = optim::make_optimizer(oo);
  ::testing::internal::CaptureStderr();
  load_checkpoint(d.file("c.pt"), *net, resumed.get());
  const std::string log = ::testing::internal::GetCapturedStderr();
  EXPECT_EQ(resumed->steps(), 0);
  EXPECT_FALSE(resumed->has_state());
  EXPECT_NE(log.find("holds no optimizer state"), std::string::npos) << log;
  auto fresh = optim::make_optimizer(oo);
  torch::Tensor a = torch::ones({15}), b = torch::ones({15}), g = torch::full({15}, 0.5f);
  resumed->step(a, g, 0.1);
  fresh->step(b, g, 0.1);
  EXPECT_TRUE(torch::equal(a, b));
  EXPECT_NEAR(1.0 - a[0].item<float>(), 0.1, 1e-6);  // one step of lr, not 3x
}

// train.accumulate: 4 micro-batches of 16 make the same steps as one batch
// of 64 (the same samples, the gradient summed in 4 parts: equal to float32
// rounding), with the step's batch in the records.
TEST(Accumulate, FourMicroBatchesOf16MakeTheStepsOfOneBatchOf64) {
  auto base = small_config("", 1);
  base.model.name = "mlp";  // no BatchNorm: micro-batches see the same weights and statistics
  base.train.max_steps = 8;
  base.lr.kind = "constant";
  base.loader.batch_size = 64;
  Trainer one(base);
  auto so = one.run();
  auto acc = base;
  acc.train.accumulate = 4;  // loader.batch_size stays the step's batch (the CLI multiplies)
  Trainer four(acc);
  auto sf = four.run();
  EXPECT_EQ(so["samples"], sf["samples"]);
  EXPECT_EQ(so["steps"], sf["steps"]);
  const double diff = (one.params().data() - four.params().data()).abs().max().item<double>();
  EXPECT_LT(diff, 1e-5) << "weights after 8 steps";
  EXPECT_TRUE(torch::allclose(one.optimizer().state()[0], four.optimizer().state()[0], 1e-4, 1e-6));
  EXPECT_EQ(four.step().micro_batches(), 4);
  std::printf("max |w(K=4, b=16) - w(K=1, b=64)| after 8 steps: %.3g\n", diff);
}

// The test above gives both runs the same 64 samples, so a step that
// skipped the split (one pass over the whole batch) would pass it too.
// Here the model records what each forward sees: with K = 4 a batch of 64
// goes through as four different parts of 16 (10 as 3, 3, 2, 2), the parts'
// losses differ, and their share-weighted gradients sum to the whole
// batch's gradient.
TEST(Accumulate, EachMicroBatchIsItsOwnPartOfTheBatch) {
  struct Probe : models::Net {
    Probe() { fc = register_module("fc", torch::nn::Linear(6, 3)); }
    torch::Tensor forward(const torch::Tensor& x) override {
      seen.push_back(x.size(0));
      firsts.push_back(x[0][0].item<float>());
      return fc(x);
    }
    torch::nn::Linear fc{nullptr};
    std::vector<int64_t> seen;
    std::vector<float> firsts;
  };
  for (const int64_t n : {64, 10}) {
    SCOPED_TRACE(n);
    torch::manual_seed(5);
    Probe net;
    optim::FlatParams flat(net);
    TrainStep step(net, flat, LossKind::CrossEntropy, false);
    torch::Tensor x = torch::randn({n, 6}), y = torch::randint(0, 3, {n});
    const double whole_loss = step.gradient(x, y);
    const torch::Tensor whole = flat.grad().clone();
    net.seen.clear();
    net.firsts.clear();
    step.set_micro_batches(4);
    const double parts_loss = step.gradient(x, y);
    const std::vector<int64_t> want = n == 64 ? std::vector<int64_t>{16, 16, 16, 16} : std::vector<int64_t>{3, 3, 2, 2};
    EXPECT_EQ(net.seen, want);
    const int64_t a = want[0], b = want[0] + want[1];
    EXPECT_EQ(net.firsts, (std::vector<float>{x[0][0].item<float>(), x[a][0].item<float>(), x[b][0].item<float>(),
                                              x[b + want[2]][0].item<float>()}));
    EXPECT_NEAR(parts_loss, whole_loss, 1e-5);
    EXPECT_TRUE(torch::allclose(flat.grad(), whole, 1e-5, 1e-6));
  }
}

TEST(Trainer, DeterministicForASeedAndThreadCount) {
  auto cfg = small_config("", 1);
  cfg.train.max_steps = 6;
  Trainer a(cfg), b(cfg);
  a.run();
  b.run();
  EXPECT_TRUE(torch::equal(a.params().data(), b.params().data()));
  cfg.train.seed = 2;
  cfg.loader.seed = 2;
  Trainer c(cfg);
  c.run();
  EXPECT_FALSE(torch::equal(a.params().data(), c.params().data()));
}

TEST(Checkpoint, RefusesToOverwriteARunWithoutResume) {
  limbo::testing::TempDir d;
  auto cfg = small_config(d.path(), 1);
  cfg.train.max_steps = 1;
  Trainer(cfg).run();
  try {
    Trainer(cfg).run();
    FAIL();
  } catch (const InvalidInput& e) {
    EXPECT_NE(std::string(e.what()).find("--resume"), std::string::npos);
  }
}

TEST(Checkpoint, ShapeMismatchAndGarbageAreClearErrors) {
  limbo::testing::TempDir d;
  auto cfg = small_config(d.path(), 1);
  cfg.train.max_steps = 1;
  Trainer(cfg).run();
  auto other = small_config("", 1);
  other.model.name = "mlp";
  Trainer m(other);
  EXPECT_THROW(load_checkpoint(d.file("checkpoint.pt"), m.model(), nullptr), InvalidInput);
  limbo::testing::write_bytes(d.file("junk.pt"), "not a checkpoint", false);
  EXPECT_THROW(load_checkpoint(d.file("junk.pt"), m.model(), nullptr), InvalidInput);
  EXPECT_THROW(load_checkpoint(d.file("none.pt"), m.model(), nullptr), InvalidInput);
}

TEST(Checkpoint, PyTorchReadsCheckpointAndSafetensors) {
  if (std::system("/usr/bin/python3 -c 'import torch' 2>/dev/null") != 0)
    GTEST_SKIP() << "python3-torch is not installed";
  limbo::testing::TempDir d;
  auto cfg = small_config(d.path(), 1);
  cfg.model.name = "resnet20";  // has buffers (BatchNorm) as well as parameters
  cfg.train.max_steps = 2;
  Trainer t(cfg);
  t.run();
  write_safetensors(d.file("model.safetensors"), state_dict(t.model()), {{"format", "pt"}});
  std::string cmd = std::string("/usr/bin/python3 ") + LIMBO_SOURCE_DIR +
                    "/tests/python/check_interop.py " + d.file("checkpoint.pt") + " " +
                    d.file("model.safetensors") + " 2>&1";
  FILE* p = ::popen(cmd.c_str(), "r");
  ASSERT_NE(p, nullptr);
  std::string out;
  char buf[512];
  while (std::fgets(buf, sizeof buf, p)) out += buf;
  int rc = ::pclose(p);
  EXPECT_EQ(rc, 0) << out;
  EXPECT_NE(out.find("interop ok"), std::string::npos) << out;
}

}  // namespace
