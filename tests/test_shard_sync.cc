// Sharded optimizer state across a re-formation, with members as threads of
// this process (each its own model and Gloo group on a shared store): what
// a gather made before a change is worth after the state was re-sharded;
// and the homes in /dev/shm that ended jobs leave.
#include <gtest/gtest.h>

#include <sys/wait.h>
#include <unistd.h>

#include <torch/torch.h>

#include <chrono>
#include <cmath>
#include <csignal>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>

#include "comm/collective.h"
#include "elastic/allreduce_update.h"
#include "elastic/elastic_membership.h"
#include "elastic/shards.h"
#include "member_threads.h"
#include "models/net.h"
#include "optim/batch_policy.h"
#include "optim/flat_params.h"
#include "train/step.h"

using namespace limbo;

namespace {

struct Mlp : models::Net {
  Mlp() {
    fc1 = register_module("fc1", torch::nn::Linear(16, 40));
    fc2 = register_module("fc2", torch::nn::Linear(40, 4));
  }
  torch::Tensor forward(const torch::Tensor& x) override { return fc2(torch::relu(fc1(x))); }
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
};

}  // namespace

// Found: a membership change agreed after the last step gathered the whole
// state on every member at step s, re-formed (each member then holds its
// new shard only), and the final gather at the same step s returned at
// once, as if still gathered: the writer's final checkpoint had no
// optimizer state. Now a new group forgets the gather, and the final one
// gathers the re-sharded state whole again, equal to what it was.
TEST(ShardSync, AGatherBeforeARegroupingIsMadeAgainAfterIt) {
  torch::manual_seed(3);
  auto init = std::make_shared<Mlp>();
  limbo::testing::expect_no_member_errors(limbo::testing::on_member_threads(2, [&](int r, comm::GroupOptions go) {
    Mlp net;
    {
      torch::NoGradGuard ng;
      for (size_t i = 0; i < net.parameters().size(); ++i) net.parameters()[i].copy_(init->parameters()[i]);
    }
    optim::FlatParams flat(net);
    optim::OptimizerOptions oo;
    oo.algorithm = "adamw";
    auto opt = std::make_shared<train::OptimizerStep>(optim::make_optimizer(oo), 0.0);
    train::TrainStep step(net, flat, train::LossKind::CrossEntropy, false);
    elastic::ReduceOptions ro;
    ro.shard_state = true;
    go.prefix = "first";
    std::shared_ptr<comm::Collective> g1 = comm::make_gloo_group(go, r, 2);
    elastic::AllReduceUpdate rule(g1, opt, flat, ro);
    rule.start(flat.data(), flat.buffers());
    torch::manual_seed(100 + r);
    const int64_t steps = 3;
    for (int64_t s = 0; s < steps; ++s) {
      auto x = torch::randn({8, 16});
      auto y = torch::randint(0, 4, {8});
      train::StepContext ctx{flat.data(), flat.grad(), flat.grad_with_slot(), 0.0, 8, 16, 0.01, s, {}};
      ctx.loss = step.gradient(x, y, [&](double loss) {
        ctx.loss = loss;
        rule.backward_starts(ctx);
      });
      rule.apply(ctx);
    }
    const int64_t n = flat.numel();
    optim::Optimizer& o = opt->optimizer();
    // The change agreed after the last step: the state whole everywhere.
    rule.gather_state(o, steps, true);
    ASSERT_EQ(o.state()[0].numel(), n);
    std::vector<torch::Tensor> whole;
    for (const auto& t : o.state()) whole.push_back(t.clone());
    // The group re-forms and re-shards.
    rule.set_group(nullptr);
    go.prefix = "second";
    std::shared_ptr<comm::Collective> g2 = comm::make_gloo_group(go, r, 2);
    rule.set_group(g2);
    train::TrainState st;
    st.step = steps;
    optim::BatchSizePolicy policy(optim::BatchPolicyOptions{});
    train::SyncTargets targets{flat.data(), flat.buffers(), o, st, policy, nullptr, 0, {}, {}};
    elastic::Round round;
    round.number = 2;
    round.members = {0, 1};
    elastic::sync_sharded_state(*g2, targets, rule, round);
    ASSERT_LT(o.state()[0].numel(), n);  // this member's shard only
    // The final checkpoint's gather, at the same step.
    rule.gather_state(o, steps, true);
    ASSERT_EQ(o.state()[0].numel(), n) << "the final gather returned without gathering";
    for (size_t i = 0; i < whole.size(); ++i) EXPECT_TRUE(torch::equal(o.state()[i], whole[i])) << i;
  }));
}

// Found: a launcher SIGKILLed (Slurm's KillWait) never removes its job's
// shard homes, and they stayed in /dev/shm. The next launcher on the host
// removes the homes of every job none of whose homes here has a running
// owner; a job with one live owner keeps all of its homes (the others may
// be a dead member's, still to be handed on), and so does the job the
// launcher joins.
TEST(ShardSync, HomesThatEndedJobsLeftAreRemovedAndLiveJobsKeepTheirs) {
  const std::string dead = "0123456789abcdef", live = "fedcba9876543210", joined = "00000000ffffffff";
  auto made_by_a_dead_process = [](const std::string& name) {
    const pid_t child = ::fork();
    if (child == 0) {
      elastic::ShardHome h(name, 64, 0, 32, 1);
      ::_exit(h.shared() ? 0 : 1);  // the name stays: nobody unlinks it
    }
    int status = 0;
    ::waitpid(child, &status, 0);
    return WIFEXITED(status) && WEXITSTATUS(status) == 0;
  };
  ASSERT_TRUE(made_by_a_dead_process("/limbo-zero-" + dead + "-m1-r1"));
  ASSERT_TRUE(made_by_a_dead_process("/limbo-zero-" + dead + "-m2-r1-c0"));
  ASSERT_TRUE(made_by_a_dead_process("/limbo-zero-" + live + "-m3-r1"));
  ASSERT_TRUE(made_by_a_dead_process("/limbo-zero-" + joined + "-m5-r1"));
  elastic::ShardHome mine("/limbo-zero-" + live + "-m4-r1", 64, 32, 64, 1);  // this process: running
  ASSERT_TRUE(mine.shared());
  auto exists = [](const std::string& name) { return ::access(("/dev/shm/" + name).c_str(), F_OK) == 0; };
  EXPECT_EQ(elastic::remove_orphaned_homes(joined), 2);
  EXPECT_FALSE(exists("limbo-zero-" + dead + "-m1-r1"));
  EXPECT_FALSE(exists("limbo-zero-" + dead + "-m2-r1-c0"));
  EXPECT_TRUE(exists("limbo-zero-" + live + "-m3-r1"));
  EXPECT_TRUE(exists("limbo-zero-" + live + "-m4-r1"));
  EXPECT_TRUE(exists("limbo-zero-" + joined + "-m5-r1"));
  EXPECT_EQ(elastic::remove_homes("limbo-zero-" + live + "-") + elastic::remove_homes("limbo-zero-" + joined + "-"), 3);
}

// A home with a log (shard_weights) is updated in place, chunk by chunk:
// a process SIGKILLed anywhere in that update (computing a chunk, copying
// it over, between chunks) leaves a home that another process finishes
// from the log to exactly the values of an update never cut short. Each
// trial forks a process that updates a 1M-element home and kills it after
// a growing delay; this process then finishes the home (taking over the
// dead process's claim) and compares every element, bit for bit.
TEST(ShardHome, AnUpdateInPlaceKilledAnywhereIsFinishedExactlyFromItsLog) {
  const int64_t n = int64_t{1} << 20;
  const std::string name = "/limbo-test-roll-" + std::to_string(::getpid());
  elastic::ShardHome home(name, n, 0, n, 3, /*logged=*/true);
  ASSERT_TRUE(home.shared());
  ASSERT_TRUE(home.logged());
  // w, m, v at step 4 and the log of step 5; the rule: a small Adam, with
  // busy work that leaves the values alone, so that a chunk takes a while.
  auto start = [&] {
    for (int64_t i = 0; i < n; ++i) {
      home.state(0, 0)[i] = std::sin(0.001f * static_cast<float>(i));
      home.state(0, 1)[i] = 0.01f * std::cos(0.003f * static_cast<float>(i));
      home.state(0, 2)[i] = 0.001f + 0.0001f * static_cast<float>(i % 97);
    }
    home.begin_log();
    for (int64_t i = 0; i < n; ++i) home.log()[i] = 0.1f * std::sin(0.007f * static_cast<float>(i) + 1.0f);
    home.commit(0, 4, 4, true);
    home.log_written(5, 0.01, false);
  };
  auto update_of = [](elastic::ShardHome& h) {
    return [&h](int64_t a, int64_t b, int64_t steps, bool has, double lr, const std::vector<float*>& out) {
      EXPECT_TRUE(has);
      const float bc = 1.0f - std::pow(0.9f, static_cast<float>(steps + 1));
      for (int64_t i = a; i < b; ++i) {
        const float g = h.log()[i];
        const float m = 0.9f * h.state(0, 1)[i] + 0.1f * g;
        const float v = 0.99f * h.state(0, 2)[i] + 0.01f * g * g;
        volatile float busy = 0;
        for (int k = 0; k < 40; ++k) busy = busy + static_cast<float>(k) * m;
        out[0][i - a] = h.state(0, 0)[i] - static_cast<float>(lr) * (m / bc) / (std::sqrt(v) + 1e-8f);
        out[1][i - a] = m;
        out[2][i - a] = v;
      }
    };
  };
  // The values of an update never cut short, and how long it takes.
  start();
  const auto t0 = std::chrono::steady_clock::now();
  ASSERT_TRUE(home.roll_forward(5, update_of(home), true));
  const double whole = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  ASSERT_EQ(home.version_of(5), 0);
  EXPECT_EQ(home.optimizer_steps(0), 5);
  std::vector<float> expect[3];
  for (int s = 0; s < 3; ++s) expect[s].assign(home.state(0, s), home.state(0, s) + n);

  const int trials = 12;
  int cut_midway = 0;
  for (int t = 0; t < trials; ++t) {
    start();
    ASSERT_EQ(home.version_of(4), 0);
    ASSERT_EQ(home.version_of(5), -1);
    const pid_t child = ::fork();
    if (child == 0) {
      auto h = elastic::ShardHome::open(name);
      if (h) h->roll_forward(5, update_of(*h), true);
      ::_exit(0);
    }
    const double delay = whole * (0.05 + 0.9 * t / (trials - 1));
    std::this_thread::sleep_for(std::chrono::duration<double>(delay));
    ::kill(child, SIGKILL);
    int status = 0;
    ::waitpid(child, &status, 0);
    if (home.version_of(5) < 0 && home.cursor() > 0) ++cut_midway;
    ASSERT_TRUE(home.roll_forward(5, update_of(home), true)) << "trial " << t;
    ASSERT_EQ(home.version_of(5), 0);
    EXPECT_EQ(home.optimizer_steps(0), 5);
    EXPECT_EQ(home.log_step(), -1);
    for (int s = 0; s < 3; ++s)
      ASSERT_EQ(std::memcmp(expect[s].data(), home.state(0, s), sizeof(float) * n), 0)
          << "trial " << t << ", slot " << s << " differs from an update never cut short";
  }
  // Some kills fell in the middle of the update (not all before it or
  // after it): what this test is about.
  std::printf("%d of %d kills fell inside the update (%.3f s long)\n", cut_midway, trials, whole);
  EXPECT_GE(cut_midway, 1) << "no kill fell inside the update (" << whole << " s long)";
  home.unlink();
}
