// Jobs across two "hosts": two network namespaces joined by a bridge.
// An elastic job (one `limbo launch` in each, the rendezvous store on the
// first) and a parameter-server job (the shard and a learner on the first,
// a learner on the second, encrypted with CURVE keys). Needs root and
// iproute2 (CI runs as root); skipped otherwise.
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>
#include <signal.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <map>
#include <memory>
#include <regex>
#include <sstream>

#include "common/files.h"
#include "job_checks.h"
#include "netns.h"
#include "test_util.h"

using limbo::testing::slurp;
using limbo::testing::TempDir;
using limbo::testing::VirtualHosts;

namespace {

class TwoHosts : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!limbo::file_exists("/usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz"))
      GTEST_SKIP() << "dataset-fashion-mnist is not installed";
    hosts_ = std::make_unique<VirtualHosts>(2);
    if (!hosts_->ok()) GTEST_SKIP() << hosts_->why();
    a_ = hosts_->ns(0);
    b_ = hosts_->ns(1);
  }
  std::unique_ptr<VirtualHosts> hosts_;
  std::string a_, b_;
};

TEST_F(TwoHosts, LaunchersOnTwoHostsFormOneJob) {
  TempDir d;
  const std::string run = d.file("run");
  const std::string rdzv = hosts_->ip(0) + ":29611";
  auto launch = [&](const std::string& ns, const std::string& log) {
    return limbo::testing::spawn_process(
        {"/usr/sbin/ip", "netns", "exec", ns, LIMBO_BINARY, "launch", "--nproc", "1",
         "--min-workers", "2", "--rdzv", rdzv, "--", "--run-dir", run,
         "--set", "model.name=mlp", "--set", "model.width=64", "--set", "data.train_limit=3000",
         "--set", "data.test_limit=300", "--set", "data.batch_size=16", "--set", "train.epochs=3",
         "--set", "train.threads=1", "--set", "train.progress=false",
         "--set", "train.sample_log=true"},
        log);
  };
  pid_t host_a = launch(a_, d.file("a.log"));
  ASSERT_TRUE(limbo::testing::wait_for_text(d.file("a.log"), "store at", 30)) << slurp(d.file("a.log"));
  pid_t host_b = launch(b_, d.file("b.log"));
  auto ra = limbo::testing::wait_child(host_a, d.file("a.log"));
  auto rb = limbo::testing::wait_child(host_b, d.file("b.log"));
  ASSERT_EQ(ra.exit_code, 0) << ra.output << "\n--- host b ---\n" << rb.output;
  ASSERT_EQ(rb.exit_code, 0) << rb.output;
  EXPECT_NE(rb.output.find("joining the job whose rendezvous store is at " + rdzv), std::string::npos)
      << rb.output;
  EXPECT_NE(ra.output.find("membership round 1: workers [1,2]"), std::string::npos) << ra.output;
  auto s = nlohmann::json::parse(slurp(run + "/summary.json"));
  EXPECT_EQ(s["workers"].get<int64_t>(), 2);
  EXPECT_EQ(s["samples"].get<int64_t>(), 3 * 3000);
  // Both hosts' workers finished with the same weights.
  std::vector<std::string> finals;
  for (const auto& e : std::filesystem::directory_iterator(run))
    if (e.path().filename().string().rfind("final-", 0) == 0) finals.push_back(slurp(e.path()));
  ASSERT_EQ(finals.size(), 2u);
  EXPECT_EQ(finals[0], finals[1]);
}

// Slurm's warning reaches each host's launcher on its own: the hosting
// launcher's worker (not the writer) may leave in a change of its own
// before the other host's worker has its signal. The hosting launcher keeps
// coordinating and keeps the store up while the job stops, so the other
// worker gets a round of its own (even below --min-workers), writes the
// checkpoint and leaves; both exit 75 and a resume trains every sample once.
// (A CI run lost the checkpoint this way: the hosting launcher exited with
// its worker, and the writer on the other host had no round to leave in.)
TEST_F(TwoHosts, ASignalReachingTheHostsOneAfterTheOtherStillCheckpoints) {
  TempDir d;
  const std::string run = d.file("run");
  const std::string rdzv = hosts_->ip(0) + ":29612";
  const int epochs = 8;
  auto launch = [&](const std::string& ns, const std::string& log, bool resume) {
    std::vector<std::string> argv = {
        "/usr/sbin/ip", "netns", "exec", ns, LIMBO_BINARY, "launch", "--nproc", "1", "--min-workers", "2",
        "--rdzv", rdzv, "--", "--run-dir", run, "--set", "model.name=mlp", "--set", "model.width=64",
        "--set", "data.train_limit=3000", "--set", "data.test_limit=300", "--set", "data.batch_size=16",
        "--set", "train.epochs=" + std::to_string(epochs), "--set", "train.threads=1",
        "--set", "train.progress=false", "--set", "train.sample_log=true",
        "--set", "train.checkpoint_every_epochs=0", "--set", "train.slow_step_ms=" + std::string(resume ? "0" : "20")};
    if (resume) argv.push_back("--resume");
    return limbo::testing::spawn_process(argv, log);
  };
  pid_t host_a = launch(a_, d.file("a.log"), false);
  ASSERT_TRUE(limbo::testing::wait_for_text(d.file("a.log"), "store at", 30)) << slurp(d.file("a.log"));
  pid_t host_b = launch(b_, d.file("b.log"), false);
  ASSERT_TRUE(limbo::testing::wait_for_text(run + "/metrics.jsonl", "\"kind\":\"train\"", 60))
      << slurp(d.file("a.log")) << slurp(d.file("b.log"));
  // The hosting launcher's worker made the non-writer: killed, restarted,
  // it rejoins with the newest id (the lowest id of a round writes).
  std::smatch m;
  const std::string a_text = slurp(d.file("a.log"));
  ASSERT_TRUE(std::regex_search(a_text, m, std::regex("worker rank 0 pid ([0-9]+)"))) << a_text;
  ::kill(std::stoi(m[1]), SIGKILL);
  ASSERT_TRUE(limbo::testing::wait_for_text(d.file("a.log"), ": workers [2,3]", 60))
      << slurp(d.file("a.log")) << slurp(d.file("b.log"));
  ::kill(host_a, SIGUSR1);
  ASSERT_TRUE(limbo::testing::wait_for_text(d.file("a.log"), "leaving the job after step", 30))
      << slurp(d.file("a.log"));
  ::kill(host_b, SIGUSR1);
  auto ra = limbo::testing::wait_child(host_a, d.file("a.log"));
  auto rb = limbo::testing::wait_child(host_b, d.file("b.log"));
  EXPECT_EQ(ra.exit_code, 75) << ra.output << "\n--- host b ---\n" << rb.output;
  EXPECT_EQ(rb.exit_code, 75) << rb.output;
  ASSERT_TRUE(limbo::file_exists(run + "/checkpoint.pt")) << ra.output << "\n--- host b ---\n" << rb.output;
  EXPECT_FALSE(limbo::file_exists(run + "/summary.json")) << "completed before the warning; pace the job";
  EXPECT_NE(rb.output.find("leaving the job after step"), std::string::npos) << rb.output;
  // The resume on both hosts: every sample once an epoch across the runs.
  host_a = launch(a_, d.file("a2.log"), true);
  ASSERT_TRUE(limbo::testing::wait_for_text(d.file("a2.log"), "store at", 30)) << slurp(d.file("a2.log"));
  host_b = launch(b_, d.file("b2.log"), true);
  ra = limbo::testing::wait_child(host_a, d.file("a2.log"));
  rb = limbo::testing::wait_child(host_b, d.file("b2.log"));
  ASSERT_EQ(ra.exit_code, 0) << ra.output << "\n--- host b ---\n" << rb.output;
  ASSERT_EQ(rb.exit_code, 0) << rb.output;
  limbo::testing::expect_exactly_once(run, epochs, 3000);
}

TEST_F(TwoHosts, ParameterServerJobAcrossHostsWithCurveKeys) {
  TempDir d;
  const std::string run = d.file("run");
  auto kg = limbo::testing::run_limbo({"keygen", "--out", d.file("job.keys")});
  ASSERT_EQ(kg.exit_code, 0) << kg.output;
  const std::string endpoint = hosts_->ip(0) + ":29711";
  const std::vector<std::string> cfg = {
      "--keys", d.file("job.keys"), "--set", "model.name=mlp", "--set", "model.width=64",
      // 4 epochs (376 batches): long enough that a learner whose process
      // starts a second late on a loaded machine still gets batches.
      "--set", "data.train_limit=6000", "--set", "data.test_limit=500", "--set", "train.epochs=4",
      "--set", "train.threads=1", "--set", "train.progress=false", "--set", "optim.lr=0.05",
      "--set", "ps.protocol=softsync", "--set", "ps.softsync_n=2"};
  auto in_ns = [&](const std::string& ns, std::vector<std::string> args, const std::string& log) {
    std::vector<std::string> argv = {"/usr/sbin/ip", "netns", "exec", ns, LIMBO_BINARY};
    argv.insert(argv.end(), args.begin(), args.end());
    argv.insert(argv.end(), cfg.begin(), cfg.end());
    return limbo::testing::spawn_process(argv, log);
  };
  pid_t shard = in_ns(a_, {"ps-server", "--bind", "tcp://" + endpoint, "--dir", run + "/shard-0"}, d.file("shard.log"));
  ASSERT_TRUE(limbo::testing::wait_for_text(run + "/shard-0/endpoint", "tcp://", 30)) << slurp(d.file("shard.log"));
  pid_t la = in_ns(a_, {"worker", "--servers", endpoint, "--learner-id", "0", "--run-dir", run}, d.file("la.log"));
  pid_t lb = in_ns(b_, {"worker", "--servers", endpoint, "--learner-id", "1", "--run-dir", run}, d.file("lb.log"));
  auto ra = limbo::testing::wait_child(la, d.file("la.log"));
  auto rb = limbo::testing::wait_child(lb, d.file("lb.log"));
  EXPECT_EQ(ra.exit_code, 0) << ra.output;
  EXPECT_EQ(rb.exit_code, 0) << rb.output;
  ::kill(shard, SIGTERM);
  auto rs = limbo::testing::wait_child(shard, d.file("shard.log"));
  EXPECT_EQ(rs.exit_code, 0) << rs.output;
  auto s = nlohmann::json::parse(slurp(run + "/shard-0/summary.json"));
  EXPECT_EQ(s["gradients_per_learner"].size(), 2u) << s.dump();  // both hosts' learners contributed
  EXPECT_GE(s["curve_peers_accepted"].get<int64_t>(), 2);
  EXPECT_DOUBLE_EQ(s["epoch"].get<double>(), 4.0);
  auto fin = nlohmann::json::parse(slurp(run + "/final.json"));
  EXPECT_GT(fin["test_accuracy"].get<double>(), 0.45);
}

}  // namespace
