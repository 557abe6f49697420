// End-to-end tests of the `limbo` binary as a real process: training to a
// real accuracy, kill -9 and exact resume, eval/export, and clear errors on
// bad input.
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>
#include <signal.h>

#include <chrono>
#include <thread>

#include "common/files.h"
#include "models/net.h"
#include "optim/flat_params.h"
#include "test_util.h"
#include "train/checkpoint.h"

using namespace limbo;
using limbo::testing::run_limbo;
using limbo::testing::slurp;
using limbo::testing::TempDir;

namespace {

const char* kFmnist = "/usr/share/datasets/fashion-mnist";

bool have_fmnist() { return file_exists(std::string(kFmnist) + "/train-images-idx3-ubyte.gz"); }

nlohmann::json summary(const std::string& dir) {
  return nlohmann::json::parse(slurp(dir + "/summary.json"));
}

// Flat weights stored in a LeNet-on-Fashion-MNIST checkpoint.
torch::Tensor weights_of(const std::string& ckpt) {
  torch::manual_seed(0);
  models::ModelOptions mo;
  mo.name = "lenet";
  auto net = models::make_model(mo, {1, 28, 28, 10});
  optim::FlatParams flat(*net);
  train::load_checkpoint(ckpt, *net, nullptr);
  return flat.data().clone();
}

TEST(Cli, HelpForEverySubcommand) {
  auto r = run_limbo({"--help"});
  EXPECT_EQ(r.exit_code, 0);
  for (const char* sub : {"train", "eval", "export", "config", "status"}) {
    EXPECT_NE(r.output.find(sub), std::string::npos);
    auto s = run_limbo({sub, "--help"});
    EXPECT_EQ(s.exit_code, 0) << sub;
    EXPECT_NE(s.output.find("--"), std::string::npos) << s.output;
  }
}

TEST(Cli, TrainsLeNetOnAFashionMnistSubsetToARealAccuracy) {
  if (!have_fmnist()) GTEST_SKIP() << "dataset-fashion-mnist is not installed";
  TempDir d;
  auto r = run_limbo({"train", "--run-dir", d.path(), "--set", "data.train_limit=12000", "--set",
                      "data.test_limit=2000", "--set", "train.epochs=2", "--set", "optim.lr=0.02"});
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("test accuracy:"), std::string::npos);
  auto s = summary(d.path());
  EXPECT_GE(s["test_accuracy"].get<double>(), 0.72) << s.dump();
  for (const char* k : {"test_accuracy", "test_loss", "epochs", "steps", "samples", "wall_seconds",
                        "samples_per_second"})
    EXPECT_TRUE(s.contains(k)) << k;
  EXPECT_EQ(s["steps"].get<int64_t>(), 2 * 188);
  EXPECT_EQ(s["samples"].get<int64_t>(), 24000);
  // metrics.jsonl: train lines with the documented fields, and eval lines.
  std::istringstream lines(slurp(d.file("metrics.jsonl")));
  std::string line;
  int train = 0, eval = 0;
  while (std::getline(lines, line)) {
    auto j = nlohmann::json::parse(line);
    if (j["kind"] == "train") {
      ++train;
      for (const char* k : {"step", "epoch", "loss", "lr", "batch_size", "samples_per_second"})
        EXPECT_TRUE(j.contains(k)) << k;
    } else if (j["kind"] == "eval") {
      ++eval;
      EXPECT_TRUE(j.contains("test_accuracy"));
    }
  }
  EXPECT_GE(train, 8);
  EXPECT_EQ(eval, 2);
  EXPECT_NE(slurp(d.file("config.toml")).find("train_limit = 12000"), std::string::npos);

  // eval and export read the checkpoint.
  auto e = run_limbo({"eval", "--checkpoint", d.file("checkpoint.pt")});
  ASSERT_EQ(e.exit_code, 0) << e.output;
  auto ej = nlohmann::json::parse(e.output.substr(e.output.rfind("{\"checkpoint\"")));
  EXPECT_NEAR(ej["test_accuracy"].get<double>(), s["test_accuracy"].get<double>(), 1e-9);
  auto x = run_limbo({"export", "--checkpoint", d.file("checkpoint.pt"), "--out", d.file("w.safetensors")});
  ASSERT_EQ(x.exit_code, 0) << x.output;
  EXPECT_GT(slurp(d.file("w.safetensors")).size(), 431080u * 4);
}

// With AdamW and clipping: the checkpoint carries the moments and the update
// count, so `--resume` continues the same run; `limbo export` reads it.
TEST(Cli, KilledRunResumesToTheSameWeights) {
  if (!have_fmnist()) GTEST_SKIP() << "dataset-fashion-mnist is not installed";
  TempDir full, part;
  std::vector<std::string> common = {"--set", "data.train_limit=2000", "--set", "data.test_limit=500",
                                     "--set", "train.epochs=2", "--set", "train.threads=1",
                                     "--set", "optim.schedule=cosine", "--set", "optim.algorithm=adamw",
                                     "--set", "optim.lr=0.002", "--set", "optim.clip_grad_norm=1.0"};
  auto args = [&](const std::string& dir, std::vector<std::string> extra) {
    std::vector<std::string> a = {"train", "--run-dir", dir};
    a.insert(a.end(), common.begin(), common.end());
    a.insert(a.end(), extra.begin(), extra.end());
    return a;
  };
  auto r = run_limbo(args(full.path(), {}));
  ASSERT_EQ(r.exit_code, 0) << r.output;

  // 2000 / 64 -> 32 steps per epoch. Pause right after the epoch-1 checkpoint
  // and a few steps into epoch 2 (its progress is lost), then kill -9.
  std::string log = part.file("log.txt");
  pid_t pid = limbo::testing::spawn_limbo(args(part.path(), {"--set", "train.pause_at_step=36"}), log);
  ASSERT_TRUE(limbo::testing::wait_for_text(log, "paused at step 36", 120)) << slurp(log);
  ::kill(pid, SIGKILL);
  auto killed = limbo::testing::wait_child(pid, log);
  EXPECT_EQ(killed.signal, SIGKILL);
  EXPECT_FALSE(file_exists(part.file("summary.json")));

  auto resumed = run_limbo(args(part.path(), {"--resume"}));
  ASSERT_EQ(resumed.exit_code, 0) << resumed.output;
  auto s = summary(part.path());
  EXPECT_EQ(s["resumed_from_step"].get<int64_t>(), 32);
  EXPECT_EQ(s["steps"], summary(full.path())["steps"]);
  auto a = weights_of(full.file("checkpoint.pt")), b = weights_of(part.file("checkpoint.pt"));
  EXPECT_TRUE(torch::allclose(a, b, 1e-6, 1e-7)) << (a - b).abs().max().item<float>();
  EXPECT_NEAR(s["test_accuracy"].get<double>(), summary(full.path())["test_accuracy"].get<double>(),
              1e-9);
  auto x = run_limbo({"export", "--checkpoint", part.file("checkpoint.pt"), "--out", part.file("w.safetensors")});
  EXPECT_EQ(x.exit_code, 0) << x.output;
}

TEST(Cli, BadInputGivesAClearErrorAndExitCode2) {
  TempDir d;
  struct Case {
    std::vector<std::string> args;
    std::vector<std::string> needles;
  };
  std::string bad_idx = d.file("fm");
  make_dirs(bad_idx);
  limbo::testing::write_bytes(bad_idx + "/train-images-idx3-ubyte", "\x12\x34\x56\x78garbage", false);
  for (const char* f : {"train-labels-idx1-ubyte", "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"})
    limbo::testing::write_bytes(bad_idx + "/" + f, limbo::testing::idx_bytes({1}, {0}), false);
  limbo::testing::write_bytes(d.file("bad.toml"), "[optim]\nlr = -1\n", false);
  std::vector<Case> cases = {
      {{"train", "--set", "optim.lr=-0.1"}, {"optim.lr", "-0.1", "out of range"}},
      {{"train", "--set", "optim.momentun=0.5"}, {"optim.momentun", "optim.momentum"}},
      {{"train", "--config", d.file("bad.toml")}, {"optim.lr", "bad.toml"}},
      {{"train", "--run-dir", d.file("r1"), "--set", "data.path=/nonexistent"},
       {"/nonexistent/train-images-idx3-ubyte"}},
      {{"train", "--run-dir", d.file("r2"), "--set", "data.path=" + bad_idx},
       {bad_idx + "/train-images-idx3-ubyte", "bad magic"}},
      {{"train", "--run-dir", d.file("r3"), "--resume", "--set", "data.dataset=synthetic"},
       {"--resume", "no checkpoint"}},
      {{"eval", "--checkpoint", d.file("missing.pt")}, {"missing.pt", "does not exist"}},
      {{"launch", "--nproc", "2", "--max-workers", "4", "--start-workers", "5", "--run-dir", d.file("r4")},
       {"--start-workers 5", "--max-workers 4"}},
      // The schedule's largest count caps the job too (a first round that
      // waited for more would wait for ever).
      {{"launch", "--nproc", "2", "--start-workers", "4", "--elastic-schedule", "0:2", "--run-dir", d.file("r5")},
       {"--start-workers 4", "--elastic-schedule", "--max-workers"}},
  };
  for (const auto& c : cases) {
    auto r = run_limbo(c.args);
    EXPECT_EQ(r.exit_code, 2) << r.output;
    EXPECT_EQ(r.signal, 0);
    for (const auto& n : c.needles) EXPECT_NE(r.output.find(n), std::string::npos) << r.output;
  }
  EXPECT_FALSE(file_exists(d.file("r2/checkpoint.pt")));
}


// `limbo train --status` serves a page for a running job; `limbo status`
// reads it by run directory or address; bad addresses and dead jobs are
// refused clearly, and a bad address writes nothing.
TEST(Cli, StatusOfARunningJobAndItsErrors) {
  TempDir d;
  const std::string run = d.file("run");
  pid_t job = limbo::testing::spawn_limbo(
      {"train", "--run-dir", run, "--status", "127.0.0.1:0", "--set", "data.dataset=synthetic",
       "--set", "model.name=mlp", "--set", "train.epochs=400", "--set", "train.log_every=5",
       "--set", "train.progress=false"},
      d.file("train.log"));
  limbo::testing::KillOnExit children{{job}};
  ASSERT_TRUE(limbo::testing::wait_for_text(run + "/status.url", "http://127.0.0.1:", 60))
      << limbo::testing::slurp(d.file("train.log"));
  ASSERT_TRUE(limbo::testing::wait_for_text(run + "/metrics.jsonl", "\"kind\":\"train\"", 60));
  std::this_thread::sleep_for(std::chrono::milliseconds(800));  // one tail period
  auto r = run_limbo({"status", run});
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("job train"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("1 members"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("samples/s"), std::string::npos) << r.output;
  std::string url = limbo::testing::slurp(run + "/status.url");
  const std::string addr = url.substr(7, url.find('/', 7) - 7);
  r = run_limbo({"status", addr});
  EXPECT_EQ(r.exit_code, 0) << r.output;
  ::kill(job, SIGTERM);
  limbo::testing::wait_child(job, d.file("train.log"), 60);
  r = run_limbo({"status", run});  // the job is gone
  EXPECT_EQ(r.exit_code, 3) << r.output;
  EXPECT_NE(r.output.find(addr), std::string::npos) << r.output;
  r = run_limbo({"status", d.path()});  // no status.url there
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find("status.url"), std::string::npos) << r.output;
  for (const std::string bad : {"localhost", "127.0.0.1:99999", "203.0.113.7:0"}) {
    r = run_limbo({"train", "--run-dir", d.file("bad"), "--status", bad, "--set", "data.dataset=synthetic"});
    EXPECT_EQ(r.exit_code, 2) << bad << ": " << r.output;
    EXPECT_NE(r.output.find("--status"), std::string::npos) << r.output;
    EXPECT_FALSE(file_exists(d.file("bad"))) << "a refused --status wrote the run directory";
  }
}

// Found: the C++ benchmarks read their arguments in pairs, so a lone flag
// (`--help`, or `--reps` without a value) was silently ignored and the whole
// benchmark ran. Now --help prints the usage and a bad flag stops them with
// exit code 2 before anything runs.
TEST(BenchTools, HelpPrintsUsageAndBadFlagsStopBeforeAnythingRuns) {
  limbo::testing::TempDir d;
  for (const std::string bench : {"limbo_bench_ps_roundtrip", "limbo_bench_allreduce"}) {
    const std::string exe = std::string(LIMBO_BENCH_DIR) + "/" + bench;
    auto run = [&](const std::vector<std::string>& rest) {
      std::vector<std::string> args = {exe};
      args.insert(args.end(), rest.begin(), rest.end());
      const std::string log = d.file(bench + ".log");
      return limbo::testing::wait_child(limbo::testing::spawn_process(args, log), log, 60);
    };
    auto help = run(std::vector<std::string>(1, "--help"));
    EXPECT_EQ(help.exit_code, 0) << bench << ": " << help.output;
    EXPECT_NE(help.output.find("usage: "), std::string::npos) << help.output;
    EXPECT_NE(help.output.find("--reps"), std::string::npos) << help.output;
    EXPECT_EQ(help.output.find("GB/s"), std::string::npos) << bench << " ran the benchmark: " << help.output;
    const std::vector<std::vector<std::string>> bads = {{"--reps"}, {"--bogus", "1"}, {"--reps", "many"}, {"--reps", "2.5"}};
    for (const auto& bad : bads) {
      auto r = run(bad);
      EXPECT_EQ(r.exit_code, 2) << bench << " " << bad[0] << ": " << r.output;
      EXPECT_NE(r.output.find("usage: "), std::string::npos) << r.output;
      EXPECT_EQ(r.output.find("GB/s"), std::string::npos) << bench << " ran the benchmark: " << r.output;
    }
  }
}

}  // namespace
