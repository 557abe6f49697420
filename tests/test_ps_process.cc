// Parameter-server jobs as real processes: end-to-end accuracy, a learner
// killed under hardsync, a shard killed and restarted, a refused handshake.
#include <gtest/gtest.h>
#include <signal.h>
#include <unistd.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <map>
#include <string>
#include <thread>

#include "common/files.h"
#include "test_util.h"

namespace {

using json = nlohmann::json;
using limbo::testing::slurp;
using limbo::testing::spawn_limbo;
using limbo::testing::TempDir;
using limbo::testing::wait_child;
using limbo::testing::wait_for_text;

json read_json(const std::string& path) { return json::parse(limbo::read_file(path)); }

std::vector<std::string> mlp_args(int epochs) {
  return {"--set", "model.name=mlp", "--set", "train.epochs=" + std::to_string(epochs), "--set", "optim.lr=0.05",
          "--set", "data.test_limit=2000", "--set", "train.threads=1", "--set", "ps.heartbeat_timeout=1",
          "--set", "ps.request_timeout=30", "--set", "train.progress=false"};
}

std::vector<std::string> cat(std::vector<std::string> a, const std::vector<std::string>& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

TEST(PsJob, FourLearnersSoftsyncReachRealAccuracy) {
  TempDir d;
  const std::string run = d.file("run");
  auto r = limbo::testing::run_limbo(cat({"launch", "--mode", "async", "--servers", "2", "--workers", "4",
                                          "--protocol", "softsync", "--softsync-n", "2", "--run-dir", run, "--"},
                                         cat(mlp_args(1), {"--set", "ps.part_mb=0.01"})));  // ~40 parts per push
  ASSERT_EQ(r.exit_code, 0) << r.output;
  auto s = read_json(run + "/summary.json");
  for (const char* k : {"staleness_mean", "staleness_p99", "staleness_max", "updates", "gradients_dropped",
                        "gradients_rejected", "test_accuracy"})
    EXPECT_TRUE(s.contains(k)) << k << " missing from " << s.dump();
  // Chance is 0.10; under the loaded suite one run ended at 0.7455 (the
  // flake of an earlier stop), so the bound leaves room for staleness.
  EXPECT_GT(s["test_accuracy"].get<double>(), 0.60) << s.dump();
  EXPECT_EQ(s["learners"].size(), 4u);
  EXPECT_EQ(s["softsync_n"], 2);
  // lambda 4, n 2: c = 2, so about half as many updates as gradients
  // (1-softsync would make one update a gradient; hardsync one per 4).
  // Measured 1.95 and 1.97 alone, and once 1.64 under the loaded suite:
  // updates with fewer than c gradients come from partial flushes when
  // learners fall behind.
  const double ratio = s["gradients_accepted"].get<double>() / s["updates"].get<double>();
  EXPECT_GT(ratio, 1.3);
  EXPECT_LE(ratio, 2.05);
  EXPECT_GT(s["staleness_mean"].get<double>(), 0.0);
  // Every sample of the epoch ended up in exactly one completed lease.
  auto shard0 = read_json(run + "/shard-0/summary.json");
  EXPECT_DOUBLE_EQ(shard0["epoch"].get<double>(), 1.0);
  // Each shard wrote a staleness histogram per window of updates.
  EXPECT_NE(slurp(run + "/shard-1/metrics.jsonl").find("\"staleness_hist\""), std::string::npos);
  // The final checkpoint is readable by `limbo eval`.
  auto ev = limbo::testing::run_limbo({"eval", "--checkpoint", run + "/checkpoint.pt", "--set", "data.test_limit=2000"});
  EXPECT_EQ(ev.exit_code, 0) << ev.output;
}

// comm.compression = bf16 and ps.pull_compression = bf16: every push and
// every training pull carries 2 bytes a value (counted by the shard), and
// the job learns as well as the float32 one on the same data.
TEST(PsJob, SixteenBitPushesAndPullsHalveTheBytesAndStillLearn) {
  std::map<std::string, json> shard, summary;
  for (const std::string c : {"none", "bf16"}) {
    TempDir d;
    const std::string run = d.file("run");
    auto r = limbo::testing::run_limbo(cat({"launch", "--mode", "async", "--servers", "1", "--workers", "2",
                                            "--protocol", "softsync", "--run-dir", run, "--"},
                                           cat(mlp_args(1), {"--set", "comm.compression=" + c, "--set",
                                                             "ps.pull_compression=" + c, "--set", "optim.lr=0.02"})));
    ASSERT_EQ(r.exit_code, 0) << c << ": " << r.output;
    shard[c] = read_json(run + "/shard-0/summary.json");
    summary[c] = read_json(run + "/summary.json");
  }
  const int64_t numel = shard["none"]["numel"].get<int64_t>();
  for (const std::string c : {"none", "bf16"}) {
    const int64_t width = c == "none" ? 4 : 2;
    const auto& s = shard[c];
    const int64_t pushes = s["gradients_accepted"].get<int64_t>() + s["gradients_dropped"].get<int64_t>();
    ASSERT_GT(pushes, 100) << s.dump();
    EXPECT_EQ(s["push_payload_bytes"].get<int64_t>(), pushes * numel * width) << c;
    // Pulls: one per step and learner, plus the final float32 one.
    const int64_t pulled = s["weights_payload_bytes"].get<int64_t>();
    EXPECT_EQ(pulled % numel, 0) << c;
    EXPECT_LT(pulled, (pushes + 20) * numel * width + 8 * numel) << c;
    EXPECT_GE(pulled, pushes * numel * width) << c;
  }
  EXPECT_GT(summary["bf16"]["test_accuracy"].get<double>(), 0.65);
  // Asynchronous runs differ from run to run (arrival order): in 3 runs of
  // this test one bf16 run ended 2.3 points above its float32 run; a
  // rounding bug costs tens of points.
  EXPECT_NEAR(summary["bf16"]["test_accuracy"].get<double>(), summary["none"]["test_accuracy"].get<double>(), 0.04);
}

// Learners send heartbeats from a thread of their own: a step longer than
// ps.heartbeat_timeout (here 2.5 s against 1 s) is slow, not dead, and no
// learner is dropped.
TEST(PsJob, ALearnerWhoseStepsOutlastTheHeartbeatTimeoutIsNotDropped) {
  TempDir d;
  const std::string run = d.file("run");
  auto r = limbo::testing::run_limbo(cat({"launch", "--mode", "async", "--servers", "1", "--workers", "2",
                                          "--protocol", "softsync", "--run-dir", run, "--"},
                                         cat(mlp_args(1), {"--set", "data.train_limit=256", "--set",
                                                           "train.slow_step_ms=2500"})));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  auto shard = read_json(run + "/shard-0/summary.json");
  EXPECT_EQ(shard["learners_dropped"], 0) << shard.dump();
  EXPECT_EQ(r.output.find("dropped after"), std::string::npos) << r.output;
  EXPECT_EQ(shard["gradients_accepted"].get<int64_t>(), 4) << shard.dump();  // 256 samples / 64
}

TEST(PsJob, KillingALearnerDoesNotHangHardsync) {
  TempDir d;
  const std::string run = d.file("run");
  auto args = cat({"--set", "ps.protocol=hardsync"}, mlp_args(1));
  pid_t server = spawn_limbo(cat({"ps-server", "--dir", run + "/shard-0"}, args), d.file("server.log"));
  ASSERT_TRUE(wait_for_text(run + "/shard-0/endpoint", "tcp://", 60)) << slurp(d.file("server.log"));
  std::string endpoint = slurp(run + "/shard-0/endpoint");
  endpoint.erase(endpoint.find_last_not_of("\n ") + 1);
  std::vector<pid_t> learners;
  for (int i = 0; i < 3; ++i) {
    auto a = cat({"worker", "--servers", endpoint, "--learner-id", std::to_string(i), "--run-dir", run}, args);
    if (i == 1) a = cat(a, {"--set", "train.pause_at_step=30"});
    learners.push_back(spawn_limbo(a, d.file("learner" + std::to_string(i) + ".log")));
  }
  ASSERT_TRUE(wait_for_text(d.file("learner1.log"), "paused at step 30", 60)) << slurp(d.file("learner1.log"));
  ASSERT_EQ(::kill(learners[1], SIGKILL), 0);
  wait_child(learners[1], d.file("learner1.log"));
  for (int i : {0, 2}) {
    auto r = wait_child(learners[i], d.file("learner" + std::to_string(i) + ".log"));
    EXPECT_EQ(r.exit_code, 0) << r.output;
  }
  ::kill(server, SIGTERM);
  auto sr = wait_child(server, d.file("server.log"));
  EXPECT_EQ(sr.exit_code, 0) << sr.output;
  EXPECT_NE(sr.output.find("learner 1 dropped"), std::string::npos) << sr.output;
  auto s = read_json(run + "/shard-0/summary.json");
  EXPECT_EQ(s["staleness_max"], 0);  // hardsync
  EXPECT_DOUBLE_EQ(s["epoch"].get<double>(), 1.0);  // the dead learner's batch was handed out again
  auto fin = read_json(run + "/final.json");
  EXPECT_GT(fin["test_accuracy"].get<double>(), 0.6);
}

// The finisher waits for the final weights until no learner is registered.
// A peer that died between batches is registered until the shard drops it;
// meanwhile the finisher, which has said goodbye, must neither heartbeat
// as a learner nor register again (found by bench/chaos.py: the shard
// answered its heartbeat with unknown_learner, it registered again and
// waited for itself for ever).
TEST(PsJob, TheFinisherWaitsOutAPeerThatDiedBetweenBatches) {
  TempDir d;
  const std::string run = d.file("run");
  auto args = cat(mlp_args(1), {"--set", "data.train_limit=1024"});
  limbo::testing::KillOnExit children;
  pid_t server = spawn_limbo(cat({"ps-server", "--dir", run + "/shard-0"}, args), d.file("server.log"));
  children.pids.push_back(server);
  ASSERT_TRUE(wait_for_text(run + "/shard-0/endpoint", "tcp://", 60)) << slurp(d.file("server.log"));
  std::string endpoint = slurp(run + "/shard-0/endpoint");
  endpoint.erase(endpoint.find_last_not_of("\n ") + 1);
  auto learner = [&](int i, std::vector<std::string> extra) {
    children.pids.push_back(0);
    return children.pids.back() = spawn_limbo(cat(cat({"worker", "--servers", endpoint, "--learner-id", std::to_string(i), "--run-dir", run},
                               args), extra),
                       d.file("learner" + std::to_string(i) + ".log"));
  };
  pid_t sleeper = learner(1, {"--set", "train.pause_at_step=2"});
  ASSERT_TRUE(wait_for_text(d.file("learner1.log"), "paused at step 2", 60)) << slurp(d.file("learner1.log"));
  pid_t finisher = learner(0, {});
  // The finisher has trained every other batch and now waits for the final
  // weights; the paused learner still heartbeats. Let the finisher wait a
  // few of its heartbeat intervals (0.25 s), then kill the sleeper.
  ASSERT_TRUE(wait_for_text(d.file("learner0.log"), "left after", 60)) << slurp(d.file("learner0.log"));
  std::this_thread::sleep_for(std::chrono::milliseconds(800));
  ASSERT_EQ(::kill(sleeper, SIGKILL), 0);
  wait_child(sleeper, d.file("learner1.log"));
  auto r = wait_child(finisher, d.file("learner0.log"), 30);
  EXPECT_FALSE(r.timed_out) << "the finisher never got the final weights:\n" << r.output;
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_EQ(r.output.find("registering again"), std::string::npos) << r.output;
  ::kill(server, SIGTERM);
  auto sr = wait_child(server, d.file("server.log"), 30);
  EXPECT_EQ(sr.exit_code, 0) << sr.output;
  EXPECT_NE(sr.output.find("learner 1 dropped"), std::string::npos) << sr.output;
  EXPECT_GT(read_json(run + "/final.json")["test_accuracy"].get<double>(), 0.3);
}

// Ctrl-C at `limbo launch --mode async`: learners leave, shards checkpoint,
// the job ends with 130 and resumes from there. SIGUSR1 (Slurm's warning
// ahead of preemption) does the same and ends with 75, "requeue".
TEST(PsJob, CtrlCOrSlurmsWarningStopsTheJobAfterTheShardsCheckpoint) {
  for (auto [sig, code] : {std::pair{SIGINT, 130}, std::pair{SIGUSR1, 75}}) {
    SCOPED_TRACE("signal " + std::to_string(sig));
    TempDir d;
    const std::string run = d.file("run");
    auto job = cat({"launch", "--mode", "async", "--servers", "1", "--workers", "2", "--protocol", "softsync",
                    "--run-dir", run, "--"}, mlp_args(20));
    limbo::testing::KillOnExit children;
    pid_t launcher = spawn_limbo(job, d.file("launch.log"));
    children.pids.push_back(launcher);
    ASSERT_TRUE(wait_for_text(d.file("launch.log"), "joined (lambda = 2", 60)) << slurp(d.file("launch.log"));
    std::this_thread::sleep_for(std::chrono::milliseconds(500));
    ASSERT_EQ(::kill(launcher, sig), 0);
    auto r = wait_child(launcher, d.file("launch.log"), 60);
    ASSERT_FALSE(r.timed_out) << r.output;
    EXPECT_EQ(r.exit_code, code) << r.output;
    EXPECT_NE(r.output.find(sig == SIGUSR1 ? "stopped by SIGUSR1" : "stopped by signal 2"), std::string::npos)
        << r.output;
    EXPECT_TRUE(limbo::file_exists(run + "/shard-0/checkpoint.bin")) << r.output;
    EXPECT_TRUE(limbo::file_exists(run + "/summary.json")) << r.output;
  }
}

pid_t shard_pid(const std::string& dir) {
  std::string cmd = "pgrep -f -- '--dir " + dir + "( |$)'";
  FILE* p = ::popen(cmd.c_str(), "r");
  char buf[64] = {0};
  pid_t pid = -1;
  if (p && std::fgets(buf, sizeof buf, p)) pid = static_cast<pid_t>(std::atol(buf));
  if (p) ::pclose(p);
  return pid;
}

TEST(PsJob, AShardKilledAndRestartedFromItsCheckpointLetsTrainingComplete) {
  TempDir d;
  const std::string run = d.file("run");
  pid_t launcher = spawn_limbo(cat({"launch", "--mode", "async", "--servers", "2", "--workers", "2", "--protocol",
                                    "softsync", "--run-dir", run, "--"},
                                   cat(mlp_args(2), {"--set", "ps.checkpoint_every=50", "--set", "ps.part_mb=0.01"})),
                               d.file("launch.log"));
  ASSERT_TRUE(wait_for_text(run + "/shard-1/summary.json", "\"clock\"", 60)) << slurp(d.file("launch.log"));
  pid_t victim = shard_pid(run + "/shard-1");
  ASSERT_GT(victim, 0);
  ASSERT_EQ(::kill(victim, SIGKILL), 0);
  auto r = wait_child(launcher, d.file("launch.log"));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("shard 1 failed (killed by signal 9)"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("resumed from its checkpoint"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("registering again"), std::string::npos) << r.output;
  auto s = read_json(run + "/summary.json");
  EXPECT_EQ(s["shards"][1]["restarts"], 1);
  EXPECT_GT(s["test_accuracy"].get<double>(), 0.6) << s.dump();
}

// With train.max_nonfinite_steps = 0 (never stop), a diverging run's
// gradients are refused one by one and the job still ends.
TEST(PsJob, ADivergingRunRejectsNonFiniteGradientsAndStillEnds) {
  TempDir d;
  const std::string run = d.file("run");
  auto r = limbo::testing::run_limbo(cat({"launch", "--mode", "async", "--servers", "1", "--workers", "2",
                                          "--protocol", "softsync", "--softsync-n", "2", "--run-dir", run, "--"},
                                         cat(mlp_args(1), {"--set", "optim.lr=50", "--set", "ps.staleness=constant",
                                                           "--set", "data.train_limit=6000", "--set",
                                                           "train.max_nonfinite_steps=0"})));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  auto s = read_json(run + "/summary.json");
  EXPECT_GT(s["gradients_rejected"].get<int64_t>(), 0) << s.dump();
  EXPECT_TRUE(s.contains("test_accuracy"));
  auto shard0 = read_json(run + "/shard-0/summary.json");
  EXPECT_GT(shard0["rejected_by_reason"]["non_finite"].get<int64_t>(), 0);
  EXPECT_DOUBLE_EQ(shard0["epoch"].get<double>(), 1.0);
}

// By default, learners whose gradients the shards refused as not finite
// 10 times in a row stop as diverged: the job ends with exit code 2 and says
// why.
TEST(PsJob, ADivergingRunStopsAfterTenNonFiniteGradientsInARow) {
  TempDir d;
  const std::string run = d.file("run");
  auto r = limbo::testing::run_limbo(cat({"launch", "--mode", "async", "--servers", "1", "--workers", "2",
                                          "--protocol", "softsync", "--softsync-n", "2", "--run-dir", run, "--"},
                                         cat(mlp_args(1), {"--set", "optim.lr=50", "--set", "ps.staleness=constant",
                                                           "--set", "data.train_limit=6000"})));
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find("10 gradients in a row"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("diverged"), std::string::npos) << r.output;
}

TEST(PsJob, AJobWithCurveKeysTrainsAndRefusesALearnerWithoutThem) {
  TempDir d;
  auto kg = limbo::testing::run_limbo({"keygen", "--out", d.file("job.keys")});
  ASSERT_EQ(kg.exit_code, 0) << kg.output;
  EXPECT_NE(slurp(d.file("job.keys")).find("public "), std::string::npos);
  const std::string run = d.file("run");
  auto keyed = cat(mlp_args(1), {"--set", "data.train_limit=6000"});
  pid_t server = spawn_limbo(cat({"ps-server", "--dir", run + "/shard-0", "--keys", d.file("job.keys")}, keyed),
                             d.file("server.log"));
  ASSERT_TRUE(wait_for_text(run + "/shard-0/endpoint", "tcp://", 60)) << slurp(d.file("server.log"));
  std::string endpoint = slurp(run + "/shard-0/endpoint");
  endpoint.erase(endpoint.find_last_not_of("\n ") + 1);
  // Without keys: ZeroMQ's CURVE handshake fails; the learner hears nothing and gives up.
  auto plain = limbo::testing::run_limbo(
      cat(cat({"worker", "--servers", endpoint}, keyed), {"--set", "ps.request_timeout=2"}));
  EXPECT_EQ(plain.exit_code, 3) << plain.output;
  EXPECT_NE(plain.output.find("did not answer"), std::string::npos) << plain.output;
  // With the job's keys: trains to the end.
  auto ok = limbo::testing::run_limbo(
      cat({"worker", "--servers", endpoint, "--keys", d.file("job.keys"), "--run-dir", run}, keyed));
  EXPECT_EQ(ok.exit_code, 0) << ok.output;
  EXPECT_NE(ok.output.find("test accuracy"), std::string::npos) << ok.output;
  ::kill(server, SIGTERM);
  auto sr = wait_child(server, d.file("server.log"));
  EXPECT_EQ(sr.exit_code, 0) << sr.output;
  auto s = read_json(run + "/shard-0/summary.json");
  EXPECT_GE(s["curve_peers_accepted"].get<int64_t>(), 1);
}

TEST(PsJob, AnInterruptedJobResumesFromItsShardCheckpoints) {
  TempDir d;
  const std::string run = d.file("run");
  auto args = cat({"launch", "--mode", "async", "--servers", "2", "--workers", "2", "--protocol", "softsync",
                   "--run-dir", run, "--"},
                  cat(mlp_args(2), {"--set", "ps.log_every=20"}));
  pid_t launcher = spawn_limbo(args, d.file("first.log"));
  ASSERT_TRUE(wait_for_text(run + "/shard-0/metrics.jsonl", "\"ps_updates\"", 60)) << slurp(d.file("first.log"));
  ASSERT_EQ(::kill(launcher, SIGINT), 0);
  auto first = wait_child(launcher, d.file("first.log"));
  EXPECT_EQ(first.exit_code, 130) << first.output;
  auto stopped = read_json(run + "/shard-0/summary.json");
  const double epoch_at_stop = stopped["epoch"].get<double>();
  ASSERT_LT(epoch_at_stop, 2.0);
  const int64_t clock_at_stop = stopped["clock"].get<int64_t>();
  auto resumed = limbo::testing::run_limbo(cat({"launch", "--mode", "async", "--resume", "--servers", "2",
                                                "--workers", "2", "--protocol", "softsync", "--run-dir", run, "--"},
                                               mlp_args(2)));
  ASSERT_EQ(resumed.exit_code, 0) << resumed.output;
  EXPECT_NE(resumed.output.find("resumed from its checkpoint at clock " + std::to_string(clock_at_stop)),
            std::string::npos) << resumed.output;
  auto s = read_json(run + "/shard-0/summary.json");
  EXPECT_DOUBLE_EQ(s["epoch"].get<double>(), 2.0);  // the data continued where it stopped
  EXPECT_GT(s["clock"].get<int64_t>(), clock_at_stop);
  EXPECT_GT(read_json(run + "/summary.json")["test_accuracy"].get<double>(), 0.65);
}

// AdamW on the parameter server: each shard keeps the moments of its slice
// (in its checkpoint too), learners clip their own gradients, and the job
// learns; stale gradients are still counted and divided (softsync, 3 learners).
TEST(PsJob, AdamWOnTheShardsLearnsAndCheckpointsItsMoments) {
  TempDir d;
  const std::string run = d.file("run");
  auto r = limbo::testing::run_limbo(cat({"launch", "--mode", "async", "--servers", "2", "--workers", "3",
                                          "--protocol", "softsync", "--softsync-n", "1", "--run-dir", run, "--"},
                                         cat(mlp_args(1), {"--set", "optim.algorithm=adamw", "--set", "optim.lr=0.002",
                                                           "--set", "optim.clip_grad_norm=1.0", "--set",
                                                           "train.log_every=10"})));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  auto s = read_json(run + "/summary.json");
  EXPECT_GT(s["test_accuracy"].get<double>(), 0.6) << s.dump();
  EXPECT_GT(s["staleness_mean"].get<double>(), 0.0) << s.dump();
  for (int k = 0; k < 2; ++k) {
    const std::string ckpt = slurp(run + "/shard-" + std::to_string(k) + "/checkpoint.bin");
    EXPECT_NE(ckpt.find("\"exp_avg_sq\""), std::string::npos) << "shard " << k;
    EXPECT_NE(ckpt.find("\"algorithm\":\"adamw\""), std::string::npos) << "shard " << k;
  }
  EXPECT_NE(slurp(run + "/learners/0.jsonl").find("\"grad_norm\""), std::string::npos);
}

TEST(PsJob, AMismatchedModelIsRefusedOnBothSides) {
  TempDir d;
  const std::string run = d.file("run");
  pid_t server = spawn_limbo(cat({"ps-server", "--dir", run + "/shard-0"}, mlp_args(1)), d.file("server.log"));
  ASSERT_TRUE(wait_for_text(run + "/shard-0/endpoint", "tcp://", 60)) << slurp(d.file("server.log"));
  std::string endpoint = slurp(run + "/shard-0/endpoint");
  endpoint.erase(endpoint.find_last_not_of("\n ") + 1);
  auto r = limbo::testing::run_limbo(
      cat(cat({"worker", "--servers", endpoint}, mlp_args(1)), {"--set", "model.width=128"}));
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find("refused this learner: model mismatch"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("fc1.weight[128,784]"), std::string::npos) << r.output;
  ::kill(server, SIGTERM);
  auto sr = wait_child(server, d.file("server.log"));
  EXPECT_NE(sr.output.find("refused learner"), std::string::npos) << sr.output;
}

}  // namespace
