// Two hosts of two workers each, in network namespaces (tests/netns.h):
// the hierarchical all-reduce (comm/hier_group.h) trains to the same bits
// as one flat Gloo group, and when a worker is killed or frozen on either
// host the others re-form at once and finish. With sharded optimizer state
// (optim.shard_state), a host lost whole loses no shard (each has a copy on
// another host), and two hosts lost together fall back to the checkpoint.
// Needs root and iproute2; skipped otherwise.
#include <gtest/gtest.h>
#include <signal.h>

#include <filesystem>
#include <map>
#include <memory>
#include <regex>
#include <set>
#include <thread>

#include "checkpoint_checks.h"
#include "host_job.h"
#include "job_checks.h"
#include "netns.h"
#include "test_util.h"

using limbo::testing::HostJob;
using limbo::testing::slurp;
using limbo::testing::VirtualHosts;
using namespace std::chrono_literals;

namespace {

class TwoByTwo : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!limbo::testing::have_fmnist()) GTEST_SKIP() << "dataset-fashion-mnist is not installed";
    hosts_ = std::make_unique<VirtualHosts>(2);
    if (!hosts_->ok()) GTEST_SKIP() << hosts_->why();
  }
  std::unique_ptr<VirtualHosts> hosts_;
};

// Host A's launcher and its two workers first (they take the first ids, so
// ranks 0 and 1), then host B's; the job starts with all four
// (--start-workers), whatever the minimum.
bool start(HostJob& job, int min_workers) {
  job.launcher_extra.insert(job.launcher_extra.end(), {"--start-workers", "4"});
  job.launch(0, 2, min_workers);
  if (!job.registered(0, 2)) return false;
  job.launch(1, 2, min_workers);
  if (!job.training(4)) {
    ADD_FAILURE() << "four workers never trained together" << job.all_logs();
    return false;
  }
  return true;
}

// The ranks host h's workers reported for their rounds of `world` workers.
std::set<int> ranks_on(const HostJob& job, int h, int world) {
  std::set<int> out;
  const std::string log = slurp(job.log(h));
  const std::regex line(std::to_string(world) + " workers, rank ([0-9]+)");
  for (std::sregex_iterator it(log.begin(), log.end(), line), end; it != end; ++it) out.insert(std::stoi((*it)[1]));
  return out;
}

std::string one_final(const std::string& run) {
  for (const auto& e : std::filesystem::directory_iterator(run))
    if (e.path().filename().string().rfind("final-", 0) == 0) return slurp(e.path());
  return "";
}

}  // namespace

// The same job, hierarchical and flat: every member of each ends with the
// same weights, and the two jobs end with the same bits (with hosts holding
// ranks 0, 1 and 2, 3, both sum ((x0 + x1) + (x2 + x3))). Each worker logs
// which transport its round used.
TEST_F(TwoByTwo, HierarchicalAndFlatJobsEndWithTheSameBits) {
  std::map<bool, std::string> finals;
  for (bool hierarchical : {true, false}) {
    HostJob job{*hosts_, 2};
    job.train_limit = 2000;
    job.train_extra = {"--set", std::string("comm.hierarchical=") + (hierarchical ? "true" : "false")};
    ASSERT_TRUE(start(job, 4));
    job.wait_all();
    for (int h : {0, 1}) ASSERT_EQ(job.results[h].exit_code, 0) << job.all_logs();
    EXPECT_EQ(ranks_on(job, 0, 4), (std::set<int>{0, 1})) << job.all_logs();
    EXPECT_EQ(ranks_on(job, 1, 4), (std::set<int>{2, 3})) << job.all_logs();
    const std::string transport = hierarchical ? "hierarchical" : "gloo";
    for (int h : {0, 1})
      EXPECT_NE(slurp(job.log(h)).find("4 workers, rank " + std::to_string(2 * h) + ", " + transport), std::string::npos)
          << job.all_logs();
    limbo::testing::expect_identical_finals(job.run, 4);
    limbo::testing::expect_exactly_once(job.run, 2, 2000);
    finals[hierarchical] = one_final(job.run);
  }
  ASSERT_FALSE(finals[true].empty());
  EXPECT_EQ(finals[true], finals[false]);
}

// A worker SIGKILLed on host B, then one SIGSTOPped on host A: each time
// the others re-form at once, first as a hierarchical group of 2 + 1, then
// as a flat group of one worker per host, and the job finishes with every
// sample used once per epoch. (A launcher whose other worker goes on does
// not start a lost one again.) Replicated SGD, and sharded AdamW (the
// fourth review: a frozen member's shard is adopted like a killed one's,
// across hosts too; nothing falls back to a checkpoint).
TEST_F(TwoByTwo, AWorkerKilledOrFrozenOnEitherHostTheOthersReformAtOnce) {
  for (const bool shard : {false, true}) {
    SCOPED_TRACE(shard ? "sharded adamw" : "replicated sgd");
    HostJob job{*hosts_, 8};
    if (shard)
      job.train_extra = {"--set", "optim.algorithm=\"adamw\"", "--set", "optim.lr=0.002", "--set",
                         "optim.shard_state=true"};
    ASSERT_TRUE(start(job, 2));
    std::this_thread::sleep_for(1s);

    auto b = job.workers(1);
    ASSERT_EQ(b.size(), 2u) << job.all_logs();
    double t0 = limbo::testing::wall_now();
    ::kill(b[0], SIGKILL);
    for (int i = 0; i < 200 && job.reformed_after(t0) < 0; ++i) std::this_thread::sleep_for(50ms);
    const double killed = job.reformed_after(t0);
    EXPECT_GT(killed, 0) << job.all_logs();
    EXPECT_LT(killed, 5) << "re-formed only after a timeout";
    std::this_thread::sleep_for(1s);

    auto a = job.workers(0);
    ASSERT_EQ(a.size(), 2u) << job.all_logs();
    t0 = limbo::testing::wall_now();
    ::kill(a[1], SIGSTOP);
    for (int i = 0; i < 200 && job.reformed_after(t0) < 0; ++i) std::this_thread::sleep_for(50ms);
    const double frozen = job.reformed_after(t0);
    EXPECT_GT(frozen, 0) << job.all_logs();
    EXPECT_LT(frozen, 5) << "re-formed only after a timeout";
    ::kill(a[1], SIGKILL);
    ::kill(a[1], SIGCONT);

    job.wait_all();
    for (int h : {0, 1}) EXPECT_EQ(job.results[h].exit_code, 0) << job.all_logs();
    const std::string logs = job.all_logs();
    EXPECT_NE(logs.find("4 workers, rank 0, hierarchical"), std::string::npos) << logs;
    EXPECT_NE(logs.find("3 workers, rank 0, hierarchical"), std::string::npos) << logs;
    EXPECT_NE(logs.find("2 workers, rank 0, gloo"), std::string::npos) << logs;
    EXPECT_EQ(logs.find("falling back"), std::string::npos) << logs;
    limbo::testing::expect_exactly_once(job.run, 8, 3000);
    std::cout << "re-formed " << killed << " s after the kill, " << frozen << " s after the stop\n";
  }
}

// Host B (ranks 2 and 3) lost whole: as rank 2 starts step 21 it SIGKILLs
// every process of its host, its launcher and the other worker, then
// itself (or, the fourth review, SIGSTOPs them: a host frozen whole, whose
// shards are neither gone nor reachable). With sharded AdamW state, the
// shards of B's workers have copies on host A (rank 2's on rank 0, rank
// 3's on rank 1), updated in every step; the two survivors re-shard from
// them and finish. Their weights and optimizer state equal, bit for bit,
// those of a replicated run with the same history, every sample is used
// once, and nothing falls back to a checkpoint. (Without the copies the
// state of step 20 would be lost: B's homes in /dev/shm name B's host, and
// A reads no other host's.)
TEST_F(TwoByTwo, AHostLostWholeLosesNoShardOfTheOptimizerState) {
  struct Case {
    const char* name;
    bool shard, freeze;
  };
  std::map<std::string, std::unique_ptr<HostJob>> jobs;  // each keeps its run directory
  for (const Case c : {Case{"replicated", false, false}, Case{"sharded", true, false},
                       Case{"sharded, host frozen", true, true}}) {
    SCOPED_TRACE(c.name);
    jobs[c.name] = std::make_unique<HostJob>(*hosts_, 2);
    HostJob& job = *jobs[c.name];
    job.train_limit = 2000;
    job.train_extra = {"--set", "optim.algorithm=\"adamw\"", "--set", "optim.lr=0.002",
                       "--set", "train.testing_die_at_step=20", "--set", "train.testing_die_rank=2",
                       "--set", "train.testing_die_with_host=true",
                       "--set", std::string("train.testing_die_by_freezing=") + (c.freeze ? "true" : "false"),
                       "--set", std::string("optim.shard_state=") + (c.shard ? "true" : "false")};
    ASSERT_TRUE(start(job, 1));
    if (c.freeze) {
      job.wait_all(120, {1});
      for (pid_t p : hosts_->pids(1)) ::kill(p, SIGKILL);
      for (pid_t p : hosts_->pids(1)) ::kill(p, SIGCONT);
    } else {
      job.wait_all();
      EXPECT_EQ(job.results[1].signal, SIGKILL) << job.all_logs();
    }
    EXPECT_EQ(job.results[0].exit_code, 0) << job.all_logs();
    EXPECT_EQ(ranks_on(job, 0, 4), (std::set<int>{0, 1})) << job.all_logs();
    EXPECT_EQ(ranks_on(job, 1, 4), (std::set<int>{2, 3})) << job.all_logs();
    const std::string logs = job.all_logs();
    EXPECT_NE(logs.find(std::string("testing: rank 2 ") + (c.freeze ? "freezes" : "dies") + " starting step 21"),
              std::string::npos)
        << logs;
    EXPECT_NE(logs.find("2 workers, rank 0"), std::string::npos) << logs;
    EXPECT_EQ(logs.find("falling back"), std::string::npos) << logs;
    if (!c.freeze) {
      EXPECT_TRUE(job.workers(1).empty()) << "host B still runs a process";
    }
    limbo::testing::expect_exactly_once(job.run, 2, 2000);
    if (!c.shard) continue;
    // The re-forming after the loss moved the state of step 20 from the
    // homes and copies on host A: each member received its new shard.
    int reformed = 0;
    for (const auto& r : limbo::testing::records(job.run))
      if (r.value("kind", "") == "membership" && r.value("reason", "") != "start") {
        ++reformed;
        EXPECT_EQ(r["step"].get<int64_t>(), 20) << r.dump();
        EXPECT_EQ(r["world"].get<int64_t>(), 2) << r.dump();
        EXPECT_GT(r["shard_bytes_received"].get<int64_t>(), 0) << r.dump();
      }
    EXPECT_EQ(reformed, 1) << logs;
  }
  limbo::testing::expect_same_checkpoint(jobs["replicated"]->run, jobs["sharded"]->run);
  limbo::testing::expect_same_checkpoint(jobs["replicated"]->run, jobs["sharded, host frozen"]->run);
}

// Three hosts of one worker each; a shard's copy is on the next host
// (rank 1's on host C). Hosts B and C are frozen together a few steps
// after the first checkpoint, then killed: rank 1's shard and its copy
// are both gone. The survivor says so, falls back to the newest checkpoint
// (every 10 steps, and at the end of each epoch), losing at most the steps
// since it, and finishes alone. (The checkpoint's writer keeps only its
// shard after writing, so a loss right after one falls back too.)
TEST(ShardedHosts, TwoHostsLostTogetherFallBackToTheNewestCheckpoint) {
  if (!limbo::testing::have_fmnist()) GTEST_SKIP() << "dataset-fashion-mnist is not installed";
  VirtualHosts hosts(3);
  if (!hosts.ok()) GTEST_SKIP() << hosts.why();
  HostJob job{hosts, 3};
  job.train_limit = 2000;
  job.launcher_extra = {"--start-workers", "3"};
  job.train_extra = {"--set", "optim.algorithm=\"adamw\"", "--set", "optim.lr=0.002", "--set",
                     "optim.shard_state=true", "--set", "train.checkpoint_every_steps=10"};
  job.launch(0, 1, 1);
  ASSERT_TRUE(job.registered(0));
  job.launch(1, 1, 1);
  ASSERT_TRUE(job.registered(1));
  job.launch(2, 1, 1);
  ASSERT_TRUE(job.training(3)) << job.all_logs();
  for (int i = 0; i < 600 && !std::filesystem::exists(job.run + "/checkpoint.pt"); ++i)
    std::this_thread::sleep_for(100ms);
  ASSERT_TRUE(std::filesystem::exists(job.run + "/checkpoint.pt")) << job.all_logs();
  std::this_thread::sleep_for(200ms);
  hosts.signal_host(1, SIGSTOP);
  hosts.signal_host(2, SIGSTOP);
  ASSERT_TRUE(limbo::testing::wait_for_text(job.log(0), "falling back", 60)) << job.all_logs();
  hosts.signal_host(1, SIGKILL);
  hosts.signal_host(2, SIGKILL);
  job.wait_all();
  ASSERT_EQ(job.results[0].exit_code, 0) << job.all_logs();
  const std::string log = slurp(job.log(0));
  std::smatch m;
  ASSERT_TRUE(std::regex_search(log, m, std::regex("the optimizer state of step ([0-9]+) is lost.*falling back to "
                                                   "the newest checkpoint \\(step ([0-9]+) here\\)")))
      << log;
  const int64_t lost = std::stoll(m[1]) - std::stoll(m[2]);
  EXPECT_GE(lost, 0) << log;
  EXPECT_LE(lost, 10) << "more steps lost than the checkpoint interval" << log;
  std::cout << "lost at step " << m[1] << ", fell back to step " << m[2] << "\n";
  auto s = nlohmann::json::parse(slurp(job.run + "/summary.json"));
  EXPECT_EQ(s["epochs"].get<double>(), 3.0);
  EXPECT_EQ(s["workers"].get<int64_t>(), 1);
  EXPECT_GT(s["test_accuracy"].get<double>(), 0.5);
}

// The fourth review: elastic.momentum = rescale scaled the owner's home of
// each shard but not its copy on the next host, so a later host loss
// restored momentum that the rescaling had missed. Three hosts of one
// worker each (ranks 0, 1, 2 in launch order; rank r's copy on host r + 1);
// host C is lost whole at step 15 (3 -> 2 members: the momentum is
// rescaled, in the homes and in the copies of the new shards), then host B
// at step 30 (rank 1's shard comes from its copy on host A). Under each
// momentum mode the sharded job ends bit for bit where the replicated one
// does.
TEST(ShardedHosts, TheCopiesFollowElasticMomentumThroughALaterHostLoss) {
  if (!limbo::testing::have_fmnist()) GTEST_SKIP() << "dataset-fashion-mnist is not installed";
  VirtualHosts hosts(3);
  if (!hosts.ok()) GTEST_SKIP() << hosts.why();
  for (const std::string mode : {"rescale", "reset"}) {
    std::map<bool, std::unique_ptr<HostJob>> jobs;  // each keeps its run directory
    for (bool shard : {false, true}) {
      SCOPED_TRACE(mode + (shard ? ", sharded" : ", replicated"));
      jobs[shard] = std::make_unique<HostJob>(hosts, 2);
      HostJob& job = *jobs[shard];
      job.train_limit = 2400;
      job.launcher_extra = {"--start-workers", "3"};
      job.train_extra = {"--set", "optim.algorithm=\"sgd\"", "--set", "optim.lr=0.01", "--set", "optim.momentum=0.9",
                         "--set", "elastic.momentum=\"" + mode + "\"", "--set", "train.testing_die_with_host=true",
                         "--set", std::string("optim.shard_state=") + (shard ? "true" : "false")};
      job.host_train_extra[1] = {"--set", "train.testing_die_at_step=30", "--set", "train.testing_die_rank=1",
                                 "--set", "train.testing_die_after_changes=1"};
      job.host_train_extra[2] = {"--set", "train.testing_die_at_step=15", "--set", "train.testing_die_rank=2"};
      job.launch(0, 1, 1);
      ASSERT_TRUE(job.registered(0));
      job.launch(1, 1, 1);
      ASSERT_TRUE(job.registered(1));
      job.launch(2, 1, 1);
      job.wait_all();
      const std::string logs = job.all_logs();
      ASSERT_EQ(job.results[0].exit_code, 0) << logs;
      for (int h : {0, 1, 2}) EXPECT_EQ(ranks_on(job, h, 3), (std::set<int>{h})) << logs;
      EXPECT_NE(logs.find("testing: rank 2 dies starting step 16"), std::string::npos) << logs;
      EXPECT_NE(logs.find("testing: rank 1 dies starting step 31"), std::string::npos) << logs;
      EXPECT_EQ(logs.find("falling back"), std::string::npos) << logs;
      limbo::testing::expect_exactly_once(job.run, 2, 2400);
    }
    // Three members for the first 15 steps: the sharded path reduces the
    // gradient in a bucket without the tail (buffers, loss, flag), the
    // replicated one in a bucket with it, so Gloo's ring cuts them into
    // other chunks and adds three members' values in another order (two
    // members' sums are the same bits either way). Measured: every weight
    // within 9e-8 and the momentum within 5e-7 of the replicated run's
    // (a few float32 ulps); a copy that missed a momentum rescale at the
    // later loss would be off by a third of the momentum.
    limbo::testing::expect_close_checkpoint(jobs[false]->run, jobs[true]->run, 1e-4, 1e-6);
  }
}
