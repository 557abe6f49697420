// The gradient all-reduce in buckets, overlapped with backward
// (elastic/bucket_reducer.h): bucket layout, bitwise equality with the
// sequential path for the same layout, and a failure during an overlapped
// bucket. Members are threads of this process, each with its own model and
// its own Gloo group on a shared store.
#include <gtest/gtest.h>

#include <torch/torch.h>

#include <functional>
#include <thread>

#include "comm/collective.h"
#include "comm/store.h"
#include "member_threads.h"
#include "common/error.h"
#include "elastic/allreduce_update.h"
#include "models/net.h"
#include "optim/flat_params.h"
#include "train/step.h"

using namespace limbo;

namespace {

// An MLP with a BatchNorm layer: float buffers ride in the all-reduce too.
struct BnMlp : models::Net {
  BnMlp() {
    fc1 = register_module("fc1", torch::nn::Linear(64, 96));
    bn = register_module("bn", torch::nn::BatchNorm1d(96));
    fc2 = register_module("fc2", torch::nn::Linear(96, 96));
    fc3 = register_module("fc3", torch::nn::Linear(96, 10));
  }
  torch::Tensor forward(const torch::Tensor& x) override {
    auto h = fc1(x);
    // Backward sleeps on its way into fc1, after the later layers' buckets
    // are ready: those are reduced during backward on any machine.
    if (h.requires_grad())
      h.register_hook([](torch::Tensor g) {
        std::this_thread::sleep_for(std::chrono::milliseconds(15));
        return g;
      });
    return fc3(torch::relu(fc2(torch::relu(bn(h)))));
  }
  torch::nn::Linear fc1{nullptr}, fc2{nullptr}, fc3{nullptr};
  torch::nn::BatchNorm1d bn{nullptr};
};

// A model whose backward reads a float buffer (a fixed per-feature scale):
// the gradients of the first layer go through it.
struct ScaledMlp : models::Net {
  ScaledMlp() {
    fc1 = register_module("fc1", torch::nn::Linear(64, 96));
    fc2 = register_module("fc2", torch::nn::Linear(96, 96));
    fc3 = register_module("fc3", torch::nn::Linear(96, 10));
    scale = register_buffer("scale", torch::linspace(0.5, 2.0, 96));
  }
  torch::Tensor forward(const torch::Tensor& x) override {
    return fc3(torch::relu(fc2(torch::relu(fc1(x) * scale))));
  }
  torch::nn::Linear fc1{nullptr}, fc2{nullptr}, fc3{nullptr};
  torch::Tensor scale;
};

using NetFactory = std::function<std::shared_ptr<models::Net>()>;
NetFactory g_factory = [] { return std::make_shared<BnMlp>(); };

std::shared_ptr<train::OptimizerStep> sgd_with_momentum(double mu) {
  optim::OptimizerOptions o;
  o.momentum = mu;
  return std::make_shared<train::OptimizerStep>(optim::make_optimizer(o), 0.0);
}

// One member: model, flat parameters, optimizer, its data.
struct Member {
  std::shared_ptr<models::Net> net = g_factory();
  optim::FlatParams flat{*net};
  std::shared_ptr<train::OptimizerStep> sgd = sgd_with_momentum(0.9);
  train::TrainStep step{*net, flat, train::LossKind::CrossEntropy, false};
  std::vector<torch::Tensor> xs, ys;
};

struct RunResult {
  std::vector<torch::Tensor> weights, buffers;
  std::vector<elastic::ReducerStats> stats;
};

std::vector<std::unique_ptr<Member>> make_members(int world, int steps) {
  torch::manual_seed(11);
  std::vector<std::unique_ptr<Member>> ms;
  for (int r = 0; r < world; ++r) {
    auto m = std::make_unique<Member>();
    for (int s = 0; s < steps; ++s) {
      const int64_t b = r == world - 1 && s == steps - 1 ? 5 : 8;  // one short batch
      m->xs.push_back(torch::randn({b, 64}));
      m->ys.push_back(torch::randint(0, 10, {b}));
    }
    ms.push_back(std::move(m));
  }
  return ms;
}

// Runs `steps` data-parallel steps on `world` threads and returns each
// member's final weights and buffers.
RunResult run_members(int world, int steps, int64_t bucket_bytes, bool overlap,
                      comm::Compression compression, const std::string& prefix) {
  auto ms = make_members(world, steps);
  comm::StoreServer store("127.0.0.1", 0);
  RunResult out;
  out.weights.resize(world);
  out.buffers.resize(world);
  out.stats.resize(world);
  std::vector<std::thread> threads;
  std::vector<std::string> errors(world);
  for (int r = 0; r < world; ++r) {
    threads.emplace_back([&, r] {
      try {
        Member& m = *ms[r];
        comm::GroupOptions go;
        go.store_port = store.port();
        go.prefix = prefix;
        go.timeout = std::chrono::milliseconds(20000);
        std::shared_ptr<comm::Collective> group = comm::make_gloo_group(go, r, world);
        elastic::ReduceOptions ro;
        ro.bucket_bytes = bucket_bytes;
        ro.overlap = overlap;
        ro.compression = compression;
        elastic::AllReduceUpdate rule(group, m.sgd, m.flat, ro);
        rule.start(m.flat.data(), m.flat.buffers());
        int64_t global = 0;
        for (int s = 0; s < steps; ++s) {
          global = 0;
          for (int q = 0; q < world; ++q) global += ms[q]->xs[s].size(0);
          train::StepContext ctx{m.flat.data(), m.flat.grad(), m.flat.grad_with_slot(), 0.0,
                                 m.xs[s].size(0), global, 0.05, s, {}};
          ctx.loss = m.step.gradient(m.xs[s], m.ys[s], [&](double loss) {
            ctx.loss = loss;
            rule.backward_starts(ctx);
          });
          rule.apply(ctx);
        }
        out.weights[r] = m.flat.data().clone();
        out.buffers[r] = m.flat.buffers().clone();
        out.stats[r] = rule.reducer().stats();
      } catch (const std::exception& e) {
        errors[r] = e.what();
      }
    });
  }
  for (auto& t : threads) t.join();
  for (int r = 0; r < world; ++r) EXPECT_EQ(errors[r], "") << "member " << r;
  return out;
}

}  // namespace

TEST(Buckets, FollowBackwardOrderAndEndOnParameterBoundaries) {
  BnMlp net;
  optim::FlatParams flat(net);
  const auto& e = flat.entries();
  for (int64_t bytes : {int64_t{0}, int64_t{1}, int64_t{4096}, int64_t{30000}, int64_t{1} << 30}) {
    for (bool tail : {true, false}) {
      auto bs = elastic::plan_buckets(flat, bytes, tail);
      ASSERT_FALSE(bs.empty());
      // Bucket 0 ends the buffer; each later bucket ends where the one before began.
      EXPECT_EQ(bs.front().end, tail ? flat.grad_with_slot().numel() : flat.numel());
      EXPECT_EQ(bs.back().begin, 0);
      size_t params = 0;
      for (size_t b = 0; b < bs.size(); ++b) {
        if (b > 0) {
          EXPECT_EQ(bs[b].end, bs[b - 1].begin);
        }
        params += bs[b].params.size();
        // Parameters in backward order: descending indices, contiguous.
        for (size_t k = 1; k < bs[b].params.size(); ++k) EXPECT_EQ(bs[b].params[k], bs[b].params[k - 1] - 1);
        EXPECT_EQ(bs[b].begin, e[bs[b].params.back()].offset);
        // Every bucket but the last holds at least the bucket size.
        const int64_t grad_end = std::min(bs[b].end, flat.numel());
        if (bytes > 0 && b + 1 < bs.size()) {
          EXPECT_GE((grad_end - bs[b].begin) * 4, bytes);
        }
      }
      EXPECT_EQ(params, e.size());
      if (bytes == 0 || bytes == (int64_t{1} << 30)) {
        EXPECT_EQ(bs.size(), 1u);
      }
      if (bytes == 1) {
        EXPECT_EQ(bs.size(), e.size());  // one parameter each
      }
    }
  }
}

// Overlapped and sequential reductions of the same buckets give the same
// bits on every member (three members: the ring's summation order depends
// on the layout, so only the same layout is comparable bitwise). The
// overlapped run really started buckets while backward was running.
TEST(Overlap, BitwiseEqualToTheSequentialPathForTheSameBuckets) {
  const int world = 3, steps = 6;
  const int64_t bucket = 4 << 10;  // three buckets for this model
  for (auto comp : {comm::Compression::None, comm::Compression::Bf16}) {
    SCOPED_TRACE(comm::compression_name(comp));
    auto seq = run_members(world, steps, bucket, false, comp, std::string("seq-") + comm::compression_name(comp));
    auto ovl = run_members(world, steps, bucket, true, comp, std::string("ovl-") + comm::compression_name(comp));
    ASSERT_EQ(seq.weights.size(), static_cast<size_t>(world));
    int64_t started_in_backward = 0;
    for (int r = 0; r < world; ++r) {
      ASSERT_TRUE(seq.weights[r].defined() && ovl.weights[r].defined());
      EXPECT_TRUE(torch::equal(seq.weights[r], ovl.weights[r])) << "member " << r;
      EXPECT_TRUE(torch::equal(seq.buffers[r], ovl.buffers[r])) << "member " << r;
      EXPECT_TRUE(torch::equal(ovl.weights[r], ovl.weights[0])) << "members disagree";
      EXPECT_EQ(seq.stats[r].buckets_started_in_backward, 0);
      EXPECT_EQ(seq.stats[r].buckets, int64_t{steps} * 3);
      started_in_backward += ovl.stats[r].buckets_started_in_backward;
    }
    EXPECT_GT(started_in_backward, 0) << "no bucket was reduced while backward ran";
    // And the buckets do sum: the result is the single-bucket result up to rounding.
    auto one = run_members(world, steps, 0, false, comp, std::string("one-") + comm::compression_name(comp));
    const double tol = comp == comm::Compression::None ? 1e-5 : 1e-2;  // bf16 sums round to 8 bits
    EXPECT_LT((one.weights[0] - seq.weights[0]).abs().max().item<double>(), tol);
    EXPECT_FALSE(torch::equal(one.weights[0], make_members(1, 1)[0]->flat.data()));  // it trained
  }
}

// Backward may read float buffers; they must keep their values until it
// ends (they are scaled and summed in place only afterwards). Two members'
// first step equals the weighted mean gradient computed by hand, for both
// paths and with the buffers in several buckets' company.
TEST(Overlap, BackwardSeesTheFloatBuffersUnchanged) {
  g_factory = [] { return std::make_shared<ScaledMlp>(); };
  for (bool overlap : {true, false}) {
    SCOPED_TRACE(overlap ? "overlap" : "sequential");
    auto got = run_members(2, 1, 4 << 10, overlap, comm::Compression::None, overlap ? "buf-o" : "buf-s");
    // By hand: member 0's initial weights, each member's mean gradient
    // weighted by its batch share, one SGD step (momentum buffer = gradient).
    auto ms = make_members(2, 1);
    Member& ref = *ms[0];
    const double total = ms[0]->xs[0].size(0) + ms[1]->xs[0].size(0);
    torch::Tensor g = torch::zeros_like(ref.flat.grad());
    for (int r = 0; r < 2; ++r) {
      ref.step.gradient(ms[r]->xs[0], ms[r]->ys[0]);
      g += ref.flat.grad() * (ms[r]->xs[0].size(0) / total);
    }
    auto want = ref.flat.data() - 0.05 * g;
    for (int r = 0; r < 2; ++r) {
      ASSERT_TRUE(got.weights[r].defined());
      EXPECT_TRUE(torch::allclose(got.weights[r], want, 1e-5, 1e-6))
          << "member " << r << ": max difference " << (got.weights[r] - want).abs().max().item<double>();
    }
  }
  g_factory = [] { return std::make_shared<BnMlp>(); };
}

// A peer lost while a bucket is in flight during backward: the step fails
// with PeerFailure, nothing is applied (weights, momentum, float buffers and
// error-feedback residuals as before the step), and the step redone in a
// re-formed group gives exactly what an undisturbed step gives.
TEST(Overlap, AFailureDuringAnOverlappedBucketFailsTheStepWhichIsRedone) {
  for (auto comp : {comm::Compression::None, comm::Compression::Fp16}) {
    SCOPED_TRACE(comm::compression_name(comp));
    auto ms = make_members(2, 2);
    // Reference: both steps undisturbed.
    auto ref = run_members(2, 2, 4 << 10, true, comp, std::string("ref-") + comm::compression_name(comp));
    comm::StoreServer store("127.0.0.1", 0);
    auto group_opts = [&](const std::string& prefix) {
      comm::GroupOptions go;
      go.store_port = store.port();
      go.prefix = prefix;
      go.timeout = std::chrono::milliseconds(20000);
      return go;
    };
    elastic::ReduceOptions ro;
    ro.bucket_bytes = 4 << 10;
    ro.overlap = true;
    ro.compression = comp;
    std::vector<std::unique_ptr<elastic::AllReduceUpdate>> rules(2);
    std::vector<std::shared_ptr<comm::Collective>> groups(2);
    std::vector<std::string> errors(2);
    std::vector<std::string> failure(2);
    auto step = [&](int r, int s, bool sabotage) {
      Member& m = *ms[r];
      const int64_t global = ms[0]->xs[s].size(0) + ms[1]->xs[s].size(0);
      train::StepContext ctx{m.flat.data(), m.flat.grad(), m.flat.grad_with_slot(), 0.0,
                             m.xs[s].size(0), global, 0.05, s, {}};
      // As the trainer does: the buffers are kept aside before forward and
      // put back when the step fails.
      auto buffers_before = m.flat.save_buffers();
      ctx.loss = m.step.gradient(m.xs[s], m.ys[s], [&](double loss) {
        ctx.loss = loss;
        rules[r]->backward_starts(ctx);
        if (sabotage) groups[r]->abort();  // this member's connections close mid-step
      });
      try {
        rules[r]->apply(ctx);
      } catch (const Error&) {
        m.flat.restore_buffers(buffers_before);
        throw;
      }
    };
    std::vector<torch::Tensor> w_before(2), v_before(2);
    std::vector<std::vector<torch::Tensor>> buf_before(2);
    std::vector<std::thread> threads;
    for (int r = 0; r < 2; ++r) {
      threads.emplace_back([&, r] {
        try {
          groups[r] = comm::make_gloo_group(group_opts("first"), r, 2);
          rules[r] = std::make_unique<elastic::AllReduceUpdate>(groups[r], ms[r]->sgd, ms[r]->flat, ro);
          rules[r]->start(ms[r]->flat.data(), ms[r]->flat.buffers());
          step(r, 0, false);
          w_before[r] = ms[r]->flat.data().clone();
          v_before[r] = ms[r]->sgd->optimizer().state()[0].clone();
          buf_before[r] = ms[r]->flat.save_buffers();
          try {
            step(r, 1, r == 1);
            failure[r] = "step 2 went through";
          } catch (const PeerFailure&) {
            failure[r] = "";
          } catch (const Timeout&) {
            failure[r] = "";
          }
          // Nothing of the failed step was applied.
          EXPECT_TRUE(torch::equal(ms[r]->flat.data(), w_before[r])) << "member " << r;
          EXPECT_TRUE(torch::equal(ms[r]->sgd->optimizer().state()[0], v_before[r])) << "member " << r;
          EXPECT_EQ(ms[r]->sgd->optimizer().steps(), 1) << "member " << r;
          const auto buf_after = ms[r]->flat.save_buffers();
          for (size_t i = 0; i < buf_after.size(); ++i)
            EXPECT_TRUE(torch::equal(buf_after[i], buf_before[r][i])) << "member " << r << " buffer " << i;
        } catch (const std::exception& e) {
          errors[r] = e.what();
        }
      });
    }
    for (auto& t : threads) t.join();
    ASSERT_EQ(errors[0], "");
    ASSERT_EQ(errors[1], "");
    EXPECT_EQ(failure[0], "") << "member 0";
    EXPECT_EQ(failure[1], "") << "member 1";
    EXPECT_GT(rules[0]->reducer().stats().buckets_started_in_backward, 0);
    // Re-form (a new group) and redo step 2.
    threads.clear();
    for (int r = 0; r < 2; ++r) {
      threads.emplace_back([&, r] {
        try {
          groups[r] = comm::make_gloo_group(group_opts("second"), r, 2);
          rules[r]->set_group(groups[r]);
          step(r, 1, false);
        } catch (const std::exception& e) {
          errors[r] = e.what();
        }
      });
    }
    for (auto& t : threads) t.join();
    ASSERT_EQ(errors[0], "");
    ASSERT_EQ(errors[1], "");
    for (int r = 0; r < 2; ++r) {
      EXPECT_TRUE(torch::equal(ms[r]->flat.data(), ref.weights[r])) << "member " << r;
      EXPECT_TRUE(torch::equal(ms[r]->flat.buffers(), ref.buffers[r])) << "member " << r;
    }
  }
}

namespace {

// A model with a buffer of every dtype a user may keep.
struct AllBuffers : models::Net {
  AllBuffers() {
    fc = register_module("fc", torch::nn::Linear(64, 10));
    f32 = register_buffer("f32", torch::zeros({3}));
    f16 = register_buffer("f16", torch::zeros({3}, torch::kFloat16));
    f64 = register_buffer("f64", torch::zeros({2}, torch::kFloat64));
    i64 = register_buffer("i64", torch::zeros({3}, torch::kInt64));
    i32 = register_buffer("i32", torch::zeros({1}, torch::kInt32));
    flag = register_buffer("flag", torch::zeros({2}, torch::kBool));
  }
  torch::Tensor forward(const torch::Tensor& x) override { return fc(x); }
  // Member r's own values (what its forward would have left).
  void set_member_values(int r) {
    torch::NoGradGuard no_grad;
    f32.fill_(r + 1.0);
    f16.fill_(2.0 * (r + 1));
    f64.copy_(torch::tensor({1.0 / 3.0 + r, 1e-9 * (r + 1)}, torch::kFloat64));
    i64.copy_(torch::tensor({int64_t{7} * r, (int64_t{1} << 40) + r, int64_t{-5} - r}));
    i32.fill_(100 + r);
    flag.copy_(torch::tensor({r == 0, r != 0}));
  }
  torch::nn::Linear fc{nullptr};
  torch::Tensor f32, f16, f64, i64, i32, flag;
};

// Runs fn(rank, group) on `world` threads, each with its own Gloo group.
void with_members(int world, const std::string& prefix,
                  const std::function<void(int, std::shared_ptr<comm::Collective>)>& fn) {
  limbo::testing::with_gloo_members(world, prefix, fn);
}

}  // namespace

// Every buffer follows one rule across data-parallel members: float32 and
// 16-bit float buffers become the batch-weighted mean; float64, integer and
// bool buffers member 0's value, exactly (as DDP broadcasts rank 0's). start() gives every
// member member 0's buffers of every dtype.
TEST(Buffers, EveryDtypeIsAveragedOrTakenFromMemberZero) {
  const int world = 3;
  const std::vector<int64_t> batch = {8, 8, 5};
  const double global = 21;
  std::vector<std::shared_ptr<AllBuffers>> nets(world);
  std::vector<std::vector<torch::Tensor>> after_start(world);
  g_factory = [] { return std::make_shared<AllBuffers>(); };
  auto ms = make_members(world, 1);
  g_factory = [] { return std::make_shared<BnMlp>(); };
  with_members(world, "all-buffers", [&](int r, std::shared_ptr<comm::Collective> group) {
    Member& m = *ms[r];
    auto& net = static_cast<AllBuffers&>(*m.net);
    elastic::ReduceOptions ro;
    elastic::AllReduceUpdate rule(group, m.sgd, m.flat, ro);
    net.set_member_values(r + 10);  // start(): member 0's values everywhere
    rule.start(m.flat.data(), m.flat.buffers());
    after_start[r] = m.flat.save_buffers();
    net.set_member_values(r);
    auto x = torch::randn({batch[r], 64});
    auto y = torch::randint(0, 10, {batch[r]});
    train::StepContext ctx{m.flat.data(), m.flat.grad(), m.flat.grad_with_slot(), 0.0, batch[r],
                           static_cast<int64_t>(global), 0.05, 0, {}};
    ctx.loss = m.step.gradient(x, y);
    auto res = rule.apply(ctx);
    EXPECT_FALSE(res.skipped);
  });
  AllBuffers want0;
  want0.set_member_values(10);
  for (int r = 0; r < world; ++r) {
    auto& net = static_cast<AllBuffers&>(*ms[r]->net);
    const auto& start = after_start[r];
    ASSERT_EQ(start.size(), 6u);
    // FlatParams orders buffers by how they travel: f32, f16, f64, then integers.
    EXPECT_TRUE(torch::equal(start[0], want0.f32));
    EXPECT_TRUE(torch::equal(start[1], want0.f16));
    EXPECT_TRUE(torch::equal(start[2], want0.f64));
    EXPECT_TRUE(torch::equal(start[3], want0.i64));
    EXPECT_TRUE(torch::equal(start[4], want0.i32));
    EXPECT_TRUE(torch::equal(start[5], want0.flag));
    // After a step: weighted means, and member 0's integers.
    double f32 = 0, f16 = 0;
    for (int q = 0; q < world; ++q) {
      const double share = batch[q] / global;
      f32 += share * (q + 1.0);
      f16 += share * 2.0 * (q + 1);
    }
    SCOPED_TRACE("member " + std::to_string(r));
    EXPECT_NEAR(net.f32[0].item<double>(), f32, 1e-6);
    EXPECT_NEAR(net.f16[0].item<double>(), f16, 2e-3);
    AllBuffers want;
    want.set_member_values(0);
    EXPECT_TRUE(torch::equal(net.f64, want.f64)) << net.f64;
    EXPECT_TRUE(torch::equal(net.i64, want.i64)) << net.i64;
    EXPECT_TRUE(torch::equal(net.i32, want.i32));
    EXPECT_TRUE(torch::equal(net.flag, want.flag));
    // And every member holds the same bits.
    EXPECT_TRUE(torch::equal(net.f16, static_cast<AllBuffers&>(*ms[0]->net).f16));
  }
}

// A gradient whose 16-bit sum overflows (fp16 tops out at 65504) is skipped
// by every member alike: weights and momentum stay, no residual takes in an
// infinity, and the next step trains normally.
TEST(Overlap, AnFp16OverflowIsSkippedByEveryMemberAndSpoilsNothing) {
  const int world = 2;
  g_factory = [] { return std::make_shared<ScaledMlp>(); };  // no BatchNorm to undo the scale
  auto ms = make_members(world, 2);
  g_factory = [] { return std::make_shared<BnMlp>(); };
  for (auto& m : ms) m->xs[0].mul_(1e6);  // gradients far beyond fp16's range
  std::vector<std::vector<bool>> skipped(world);
  std::vector<torch::Tensor> w0(world), w1(world), w2(world);
  with_members(world, "fp16-overflow", [&](int r, std::shared_ptr<comm::Collective> group) {
    Member& m = *ms[r];
    elastic::ReduceOptions ro;
    ro.bucket_bytes = 4 << 10;
    ro.compression = comm::Compression::Fp16;
    elastic::AllReduceUpdate rule(group, m.sgd, m.flat, ro);
    rule.start(m.flat.data(), m.flat.buffers());
    w0[r] = m.flat.data().clone();
    for (int s = 0; s < 2; ++s) {
      const int64_t global = ms[0]->xs[s].size(0) + ms[1]->xs[s].size(0);
      train::StepContext ctx{m.flat.data(), m.flat.grad(), m.flat.grad_with_slot(), 0.0,
                             m.xs[s].size(0), global, 0.05, s, {}};
      ctx.loss = m.step.gradient(m.xs[s], m.ys[s]);
      skipped[r].push_back(rule.apply(ctx).skipped);
      (s == 0 ? w1 : w2)[r] = m.flat.data().clone();
    }
  });
  for (int r = 0; r < world; ++r) {
    SCOPED_TRACE("member " + std::to_string(r));
    ASSERT_EQ(skipped[r].size(), 2u);
    EXPECT_TRUE(skipped[r][0]);
    EXPECT_FALSE(skipped[r][1]);
    EXPECT_TRUE(torch::equal(w1[r], w0[r]));  // the overflowing step changed nothing
    EXPECT_TRUE(torch::isfinite(w2[r]).all().item<bool>());
    EXPECT_FALSE(torch::equal(w2[r], w0[r]));  // the next one trained
    EXPECT_TRUE(torch::equal(w2[r], w2[0]));
  }
}

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  at::set_num_threads(1);
  return RUN_ALL_TESTS();
}

// The Python front end keeps frozen parameters in the flat buffers
// (FlatParams' include_frozen) so that a loop may unfreeze them. A bucket
// that every member had frozen at the group's previous step stays off the
// wire; a layer unfrozen at step s is still off it at s (its gradient of
// that step dropped alike on every member: zeros, `.grad` undefined) and
// is reduced from s + 1. The group's first step reduces every bucket.
TEST(Overlap, ABucketFrozenOnEveryMemberStaysOffTheWireUntilAStepAfterItIsUnfrozen) {
  const int world = 2, steps = 5, unfreeze_at = 2;
  struct Frozen {
    std::shared_ptr<ScaledMlp> net = std::make_shared<ScaledMlp>();
    std::unique_ptr<optim::FlatParams> flat;
    std::shared_ptr<train::OptimizerStep> sgd = sgd_with_momentum(0.9);
    std::vector<torch::Tensor> xs, ys;
  };
  torch::manual_seed(5);
  std::vector<std::unique_ptr<Frozen>> ms;
  for (int r = 0; r < world; ++r) {
    auto m = std::make_unique<Frozen>();
    m->net->fc1->weight.requires_grad_(false);
    m->net->fc1->bias.requires_grad_(false);
    m->flat = std::make_unique<optim::FlatParams>(*m->net, false, /*include_frozen=*/true);
    for (int s = 0; s < steps; ++s) {
      m->xs.push_back(torch::randn({8, 64}));
      m->ys.push_back(torch::randint(0, 10, {8}));
    }
    ms.push_back(std::move(m));
  }
  comm::StoreServer store("127.0.0.1", 0);
  std::vector<std::vector<int64_t>> payload(world);
  std::vector<std::vector<torch::Tensor>> fc1(world);  // fc1.weight after each step
  std::vector<std::vector<bool>> fc1_grad(world);     // whether fc1.weight had a gradient at the update
  std::vector<torch::Tensor> final_weights(world);
  std::vector<std::string> errors(world);
  std::vector<std::thread> threads;
  for (int r = 0; r < world; ++r) {
    threads.emplace_back([&, r] {
      try {
        Frozen& m = *ms[r];
        comm::GroupOptions go;
        go.store_port = store.port();
        go.prefix = "frozen";
        go.timeout = std::chrono::milliseconds(20000);
        std::shared_ptr<comm::Collective> group = comm::make_gloo_group(go, r, world);
        elastic::ReduceOptions ro;
        ro.bucket_bytes = 4 << 10;  // fc1 (24 KB) is a bucket of its own
        ro.overlap = true;
        ro.finish_in_backward = true;
        elastic::AllReduceUpdate rule(group, m.sgd, *m.flat, ro);
        rule.start(m.flat->data(), m.flat->buffers());
        for (int s = 0; s < steps; ++s) {
          if (s == unfreeze_at) m.net->fc1->weight.requires_grad_(true), m.net->fc1->bias.requires_grad_(true);
          train::StepContext ctx{m.flat->data(), m.flat->grad(), m.flat->grad_with_slot(), 0.0, 8, 16, 0.05, s, {}, {}};
          m.flat->release_grads();
          rule.backward_starts(ctx);
          auto loss = torch::nn::functional::cross_entropy(m.net->forward(m.xs[s]), m.ys[s]);
          ctx.loss = loss.item<double>();
          loss.backward();
          fc1_grad[r].push_back(m.net->fc1->weight.grad().defined());
          rule.apply(ctx);
          payload[r].push_back(rule.reducer().last_payload_bytes());
          fc1[r].push_back(m.net->fc1->weight.detach().clone());
        }
        final_weights[r] = m.flat->data().clone();
      } catch (const std::exception& e) {
        errors[r] = e.what();
      }
    });
  }
  for (auto& t : threads) t.join();
  for (int r = 0; r < world; ++r) ASSERT_EQ(errors[r], "") << "member " << r;
  const int64_t fc1_bytes = 4 * (96 * 64 + 96);
  const auto& p = payload[0];
  for (int s = 0; s < steps; ++s) std::cerr << "step " << s << ": " << p[s] << " bytes on the wire\n";
  EXPECT_EQ(p[1], p[0] - fc1_bytes) << "a bucket frozen on every member went on the wire";
  EXPECT_EQ(p[2], p[1]) << "the step that unfroze it still has it off the wire";
  EXPECT_EQ(p[3], p[0]) << "reduced from the next step";
  EXPECT_EQ(p[4], p[0]);
  for (int r = 0; r < world; ++r) {
    EXPECT_EQ(payload[r], p);
    EXPECT_FALSE(fc1_grad[r][1]);
    EXPECT_FALSE(fc1_grad[r][unfreeze_at]) << "the unfreezing step's gradient is dropped when backward returns";
    EXPECT_TRUE(fc1_grad[r][unfreeze_at + 1]);
    EXPECT_TRUE(torch::equal(fc1[r][unfreeze_at], fc1[r][0])) << "fc1 moved before it was reduced";
    EXPECT_FALSE(torch::equal(fc1[r][unfreeze_at + 1], fc1[r][unfreeze_at])) << "fc1 did not train once reduced";
    EXPECT_TRUE(torch::equal(final_weights[r], final_weights[0])) << "members disagree";
  }
}
