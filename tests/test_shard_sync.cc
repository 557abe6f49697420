// Sharded optimizer state across a re-formation, with members as threads of
// this process (each its own model and Gloo group on a shared store): what
// a gather made before a change is worth after the state was re-sharded;
// and the homes in /dev/shm that ended jobs leave.
#include <gtest/gtest.h>

#include <sys/wait.h>
#include <unistd.h>

#include <torch/torch.h>

#include <memory>
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
