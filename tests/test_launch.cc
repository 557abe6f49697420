// Data-parallel training through `limbo launch` with real processes: the
// result equals single-process training at the global batch, for an even and
// an odd number of workers, and a killed worker stops the job with an error
// instead of a hang.
#include <gtest/gtest.h>

#include <map>
#include <nlohmann/json.hpp>
#include <signal.h>

#include <regex>
#include <sstream>

#include "common/files.h"
#include "common/process.h"
#include "models/net.h"
#include "optim/flat_params.h"
#include "test_util.h"
#include "train/checkpoint.h"

using namespace limbo;
using limbo::testing::run_limbo;
using limbo::testing::slurp;
using limbo::testing::TempDir;

namespace {

bool have_fmnist() {
  return file_exists("/usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz");
}

torch::Tensor mlp_weights(const std::string& ckpt, int width = 64) {
  models::ModelOptions mo;
  mo.name = "mlp";
  mo.width = width;
  auto net = models::make_model(mo, {1, 28, 28, 10});
  optim::FlatParams flat(*net);
  train::load_checkpoint(ckpt, *net, nullptr);
  return flat.data().clone();
}

std::vector<std::string> job(const std::string& dir, int batch) {
  // 1000 samples: the last global batch is uneven across 3 workers.
  return {"--run-dir", dir, "--set", "model.name=mlp", "--set", "model.width=64",
          "--set", "data.train_limit=1000", "--set", "data.test_limit=500",
          "--set", "data.batch_size=" + std::to_string(batch), "--set", "train.epochs=2",
          "--set", "train.threads=1", "--set", "optim.lr=0.05", "--set", "optim.weight_decay=1e-4"};
}

class LaunchEquivalence : public ::testing::TestWithParam<int> {};

TEST_P(LaunchEquivalence, MatchesOneProcessAtTheGlobalBatch) {
  if (!have_fmnist()) GTEST_SKIP() << "dataset-fashion-mnist is not installed";
  const int workers = GetParam(), b = 16;
  TempDir single, multi;
  auto args = job(single.path(), b * workers);
  args.insert(args.begin(), "train");
  auto r1 = run_limbo(args);
  ASSERT_EQ(r1.exit_code, 0) << r1.output;
  std::vector<std::string> la = {"launch", "--nproc", std::to_string(workers), "--"};
  auto j = job(multi.path(), b);
  la.insert(la.end(), j.begin(), j.end());
  auto r2 = run_limbo(la);
  ASSERT_EQ(r2.exit_code, 0) << r2.output;
  auto s1 = nlohmann::json::parse(slurp(single.file("summary.json")));
  auto s2 = nlohmann::json::parse(slurp(multi.file("summary.json")));
  EXPECT_EQ(s1["steps"], s2["steps"]);
  EXPECT_EQ(s1["samples"], s2["samples"]);
  EXPECT_EQ(s2["update_rule"], "allreduce");
  auto a = mlp_weights(single.file("checkpoint.pt")), c = mlp_weights(multi.file("checkpoint.pt"));
  EXPECT_TRUE(torch::allclose(a, c, 1e-4, 1e-5)) << (a - c).abs().max().item<float>();
  EXPECT_NEAR(s1["test_accuracy"].get<double>(), s2["test_accuracy"].get<double>(), 0.01);
}

INSTANTIATE_TEST_SUITE_P(Workers, LaunchEquivalence, ::testing::Values(2, 3));

// comm.compression: the gradient crosses the wire in 16 bits. Training
// still matches the float32 job's accuracy on the same data (error
// feedback), the weights differ from it (the rounding happened), and bad
// settings are refused.
TEST(Launch, CompressedGradientsTrainAsWellAsFloat32) {
  if (!have_fmnist()) GTEST_SKIP() << "dataset-fashion-mnist is not installed";
  std::map<std::string, std::pair<double, torch::Tensor>> got;
  for (const std::string c : {"none", "bf16", "fp16"}) {
    TempDir d;
    std::vector<std::string> la = {"launch", "--nproc", "2", "--"};
    auto j = job(d.path(), 16);
    j[7] = "data.train_limit=6000";
    la.insert(la.end(), j.begin(), j.end());
    // A learning rate and a test set at which seed-to-seed noise stays
    // below a point (at lr 0.05 and 500 test images it was 17 points).
    la.insert(la.end(), {"--set", "comm.compression=" + c, "--set", "optim.lr=0.01", "--set",
                         "data.test_limit=2000"});
    auto r = run_limbo(la);
    ASSERT_EQ(r.exit_code, 0) << c << ": " << r.output;
    auto s = nlohmann::json::parse(slurp(d.file("summary.json")));
    got[c] = {s["test_accuracy"].get<double>(), mlp_weights(d.file("checkpoint.pt"))};
  }
  for (const char* c : {"bf16", "fp16"}) {
    EXPECT_NEAR(got[c].first, got["none"].first, 0.02) << c;
    EXPECT_FALSE(torch::equal(got[c].second, got["none"].second)) << c << ": no rounding happened?";
  }
  TempDir d;
  auto bad = run_limbo({"train", "--run-dir", d.file("x"), "--set", "comm.compression=fp8"});
  EXPECT_EQ(bad.exit_code, 2) << bad.output;
  EXPECT_NE(bad.output.find("comm.compression"), std::string::npos) << bad.output;
  bad = run_limbo({"train", "--run-dir", d.file("y"), "--set", "comm.compression=bf16", "--set",
                   "elastic.direct_allreduce=false"});
  EXPECT_EQ(bad.exit_code, 2) << bad.output;
  EXPECT_NE(bad.output.find("direct_allreduce"), std::string::npos) << bad.output;
}

TEST(Launch, IsgdDecidesOnTheGlobalLossAndMatchesOneProcess) {
  // Every worker must see the same (all-reduced) loss, trigger on the same
  // batches and run the same extra iterations on all-reduced gradients;
  // then the job equals one process at the global batch.
  if (!have_fmnist()) GTEST_SKIP() << "dataset-fashion-mnist is not installed";
  TempDir single, multi;
  std::vector<std::string> isgd = {"--set", "optim.algorithm=isgd", "--set", "isgd.k=0.5",
                                   "--set", "train.epochs=3"};
  auto args = job(single.path(), 32);
  args.insert(args.begin(), "train");
  args.insert(args.end(), isgd.begin(), isgd.end());
  auto r1 = run_limbo(args);
  ASSERT_EQ(r1.exit_code, 0) << r1.output;
  std::vector<std::string> la = {"launch", "--nproc", "2", "--"};
  auto j = job(multi.path(), 16);
  la.insert(la.end(), j.begin(), j.end());
  la.insert(la.end(), isgd.begin(), isgd.end());
  auto r2 = run_limbo(la);
  ASSERT_EQ(r2.exit_code, 0) << r2.output;
  auto s1 = nlohmann::json::parse(slurp(single.file("summary.json")));
  auto s2 = nlohmann::json::parse(slurp(multi.file("summary.json")));
  EXPECT_GT(s1["isgd_triggered_batches"].get<int64_t>(), 0);
  EXPECT_EQ(s1["isgd_triggered_batches"], s2["isgd_triggered_batches"]);
  EXPECT_EQ(s1["isgd_extra_iterations"], s2["isgd_extra_iterations"]);
  auto a = mlp_weights(single.file("checkpoint.pt")), c = mlp_weights(multi.file("checkpoint.pt"));
  EXPECT_TRUE(torch::allclose(a, c, 1e-4, 1e-5)) << (a - c).abs().max().item<float>();
}

TEST(Launch, AKilledWorkerStopsTheJobWithAnError) {
  if (!have_fmnist()) GTEST_SKIP() << "dataset-fashion-mnist is not installed";
  TempDir d;
  std::vector<std::string> la = {"launch", "--nproc", "3", "--"};
  auto j = job(d.file("run"), 8);
  j.insert(j.end(), {"--set", "train.epochs=50"});
  la.insert(la.end(), j.begin(), j.end());
  std::string log = d.file("log.txt");
  pid_t launcher = limbo::testing::spawn_limbo(la, log);
  ASSERT_TRUE(limbo::testing::wait_for_text(log, "worker rank 2 pid", 30)) << slurp(log);
  std::smatch m;
  std::string text = slurp(log);
  ASSERT_TRUE(std::regex_search(text, m, std::regex("worker rank 1 pid ([0-9]+)")));
  pid_t victim = std::stoi(m[1]);
  // Let training start (rank 0 writes metrics), then kill rank 1.
  ASSERT_TRUE(limbo::testing::wait_for_text(d.file("run/metrics.jsonl"), "\"kind\":\"train\"", 60))
      << slurp(log);
  ASSERT_EQ(::kill(victim, SIGKILL), 0);
  auto r = limbo::testing::wait_child(launcher, log);
  // The launcher reports the worker's death and exits with its status; the
  // survivors are stopped (by SIGTERM, or by their own PeerFailure first).
  EXPECT_EQ(r.exit_code, 128 + SIGKILL) << r.output;
  EXPECT_NE(r.output.find("worker rank 1"), std::string::npos) << r.output;
}

// elastic.shares = "pace": the worker of rank 1 held to a tenth of a core by a
// cgroup cpu quota (a real slow member, not a sleep) is dealt a smaller slice
// of every batch once the paces are agreed; the weights are still those of
// one process at the global batch (each member weighs by its samples).
TEST(Launch, SharesByPaceFollowAWorkerHeldToAFractionOfACore) {
  if (!have_fmnist()) GTEST_SKIP() << "dataset-fashion-mnist is not installed";
  ASSERT_TRUE(limbo::testing::CpuLimit::available()) << "the cgroup v1 cpu controller (root) makes the slow member";
  TempDir single, multi;
  // Steps long enough (a wider MLP, 96 samples a member) that compute, not
  // the step's overhead, sets their time. At a rate of 0.005 the training
  // does not grow float rounding: at 0.05 one process on 1 and on 2 threads
  // ended 1 % apart after these 64 steps, and at 0.01, with shares moving
  // from step 14, the weights ended 3e-5 apart (the per-step losses agreed
  // to 1e-7 for 40 steps, then the rounding grew).
  const std::vector<std::string> heavier = {"--set", "train.epochs=4", "--set", "model.width=256",
                                            "--set", "data.train_limit=3000", "--set", "optim.lr=0.005"};
  auto args = job(single.path(), 192);
  args.insert(args.begin(), "train");
  args.insert(args.end(), heavier.begin(), heavier.end());
  auto r1 = run_limbo(args);
  ASSERT_EQ(r1.exit_code, 0) << r1.output;
  std::vector<std::string> la = {"launch", "--nproc", "2", "--"};
  auto j = job(multi.file("run"), 96);
  j.insert(j.end(), heavier.begin(), heavier.end());
  j.insert(j.end(), {"--set", "elastic.shares=pace", "--set", "train.log_every=5"});
  la.insert(la.end(), j.begin(), j.end());
  const std::string log = multi.file("log.txt");
  pid_t launcher = limbo::testing::spawn_limbo(la, log);
  limbo::testing::KillOnExit guard{{launcher}};
  ASSERT_TRUE(limbo::testing::wait_for_text(log, "worker rank 1 pid", 30)) << slurp(log);
  std::smatch m;
  const std::string text = slurp(log);
  ASSERT_TRUE(std::regex_search(text, m, std::regex("worker rank 1 pid ([0-9]+)")));
  // A tenth of a core, in a 10 ms quota period: the member's pace, measured
  // over a quarter of a second rather than a step or a few (each a few ms),
  // sees the quota: its share settled at 0.06-0.09 (paces over the last 2-3
  // steps swung it between 0.05 and 0.45).
  limbo::testing::CpuLimit slow("limbo-test-" + std::to_string(::getpid()), 0.1, 10000);
  slow.add(std::stoi(m[1]));
  auto r = limbo::testing::wait_child(launcher, log);
  guard.pids.clear();
  ASSERT_EQ(r.exit_code, 0) << r.output;
  // Float rounding of other sums over 64 steps (the weights 3e-8 apart,
  // relatively); members weighted by anything but their samples would be
  // off by far more.
  auto a = mlp_weights(single.file("checkpoint.pt"), 256), c = mlp_weights(multi.file("run/checkpoint.pt"), 256);
  const double apart = ((a - c).norm() / a.norm()).item<double>();
  EXPECT_LT(apart, 1e-4) << "largest difference " << (a - c).abs().max().item<float>();
  std::printf("the weights' relative distance from one process's: %.3g\n", apart);
  std::vector<nlohmann::json> train;
  std::istringstream in(slurp(multi.file("run/metrics.jsonl")));
  for (std::string line; std::getline(in, line);) {
    auto rec = nlohmann::json::parse(line);
    if (rec["kind"] == "train") train.push_back(rec);
  }
  ASSERT_GT(train.size(), 2u);
  EXPECT_EQ(train.front()["step"], 5);
  EXPECT_EQ(train.front()["shares"], nlohmann::json({0.5, 0.5}));  // before any pace is agreed
  // Paces are published every step and the CLI's shares hold data.prefetch
  // + 2 steps after their publication: the first (step 1) from step 7 (a
  // publication every 8 steps held them back to 14, a lag of 16 to 24). The
  // records at 10, 15, 16 (an epoch's end) and 20 have them.
  int early = 0;
  for (const auto& rec : train)
    if (rec["step"].get<int>() >= 7 && rec["step"].get<int>() < 24) {
      EXPECT_NE(rec["shares"], nlohmann::json({0.5, 0.5})) << rec.dump();
      ++early;
    }
  EXPECT_GT(early, 0);
  for (const auto& rec : train)
    std::printf("step %d shares %s paces %s\n", rec["step"].get<int>(), rec["shares"].dump().c_str(),
                rec.contains("paces") ? rec["paces"].dump().c_str() : "-");
  const auto& last = train.back();
  ASSERT_EQ(last["shares"].size(), 2u);
  EXPECT_LT(last["shares"][1].get<double>(), 0.25) << last.dump();
  std::printf("the held worker's last share: %.4f\n", last["shares"][1].get<double>());
  EXPECT_LT(last["paces"][1].get<double>(), last["paces"][0].get<double>()) << last.dump();
}

// A host or container held to a fraction of a core: the launcher gives its
// worker the cores the quota allows (1), not every core of the machine (2
// here). More compute threads than the quota only spin out its periods: on
// three hosts held to 100 %, 50 % and 25 % of a core, two threads a worker
// made equal shares run at 0.64x DDP's one.
TEST(Launch, AWorkerOfALauncherHeldToHalfACoreGetsOneThread) {
  ASSERT_TRUE(limbo::testing::CpuLimit::available()) << "the cgroup v1 cpu controller (root) holds the launcher";
  if (limbo::usable_cores() < 2) GTEST_SKIP() << "one core: a worker gets one thread anyway";
  TempDir dir;
  limbo::testing::CpuLimit half("limbo-test-half-" + std::to_string(::getpid()), 0.5);
  const std::string procs = "/sys/fs/cgroup/cpu/limbo-test-half-" + std::to_string(::getpid()) + "/cgroup.procs";
  // The launcher starts in the group (what it starts stays there); its
  // worker is a shell that writes what it was given.
  auto held = [&](const std::vector<std::string>& args, const std::string& log) {
    std::vector<std::string> argv = {"/bin/sh", "-c", "echo $$ > \"$0\" && exec \"$@\"", procs, LIMBO_BINARY};
    argv.insert(argv.end(), args.begin(), args.end());
    return limbo::testing::wait_child(limbo::testing::spawn_process(argv, log), log, 120);
  };
  const std::string seen = dir.file("threads.txt");
  auto r = held({"launch", "--nproc", "1", "--", "/bin/sh", "-c", "echo \"$LIMBO_THREADS\" > " + seen},
                dir.file("launch.log"));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_EQ(slurp(seen), "1\n") << r.output;
  EXPECT_NE(r.output.find("1 workers, 1 threads each"), std::string::npos) << r.output;
  // The same launcher outside the group splits the machine's cores.
  const std::string free_seen = dir.file("free.txt");
  auto f = run_limbo({"launch", "--nproc", "1", "--", "/bin/sh", "-c", "echo \"$LIMBO_THREADS\" > " + free_seen});
  ASSERT_EQ(f.exit_code, 0) << f.output;
  EXPECT_EQ(slurp(free_seen), std::to_string(limbo::usable_cores()) + "\n") << f.output;
  // LIMBO_THREADS in the launcher's environment is the user's choice.
  ::setenv("LIMBO_THREADS", "3", 1);
  auto c = held({"launch", "--nproc", "1", "--", "/bin/sh", "-c", "echo \"$LIMBO_THREADS\" > " + free_seen},
                dir.file("chosen.log"));
  ::unsetenv("LIMBO_THREADS");
  ASSERT_EQ(c.exit_code, 0) << c.output;
  EXPECT_EQ(slurp(free_seen), "3\n") << c.output;
  // `limbo train` alone in the group takes one thread by default too.
  if (!have_fmnist()) return;
  auto t = held({"train", "--run-dir", dir.file("run"), "--set", "model.name=mlp", "--set", "data.train_limit=256",
                 "--set", "data.test_limit=64", "--set", "train.epochs=1"},
                dir.file("train.log"));
  ASSERT_EQ(t.exit_code, 0) << t.output;
  EXPECT_NE(t.output.find(", 1 threads,"), std::string::npos) << t.output;
}

// Found: `limbo launch --run-dir D` (before --) was taken by the
// parameter-server launcher but silently ignored by the data-parallel one,
// whose run went to runs/launch-<time>. Both launchers take it now; a
// different --run-dir after -- is refused.
TEST(Launch, RunDirBeforeTheDoubleDashIsTheJobsRunDirectory) {
  if (!have_fmnist()) GTEST_SKIP() << "dataset-fashion-mnist is not installed";
  TempDir d;
  for (const char* elastic : {"no", "yes"}) {
    const std::string run = d.file(std::string("run-") + elastic);
    std::vector<std::string> la = {"launch", "--nproc", "2", "--run-dir", run};
    if (std::string(elastic) == "yes") la.insert(la.end(), {"--min-workers", "1"});
    la.push_back("--");
    auto j = job(run, 16);
    la.insert(la.end(), j.begin() + 2, j.end());  // without the job's own --run-dir
    auto r = run_limbo(la);
    ASSERT_EQ(r.exit_code, 0) << elastic << ": " << r.output;
    auto s = nlohmann::json::parse(slurp(run + "/summary.json"));
    EXPECT_EQ(s["samples"].get<int64_t>(), 2 * 1000) << elastic;
  }
  auto clash = run_limbo({"launch", "--nproc", "1", "--run-dir", d.file("a"), "--", "--run-dir", d.file("b")});
  EXPECT_EQ(clash.exit_code, 2) << clash.output;
  EXPECT_NE(clash.output.find("differ"), std::string::npos) << clash.output;
  EXPECT_FALSE(file_exists(d.file("a"))) << "a refused launch wrote its run directory";
  EXPECT_FALSE(file_exists(d.file("b")));
}

}  // namespace
