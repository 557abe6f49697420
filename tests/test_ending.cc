// How an elastic job ends (docs/elastic.md, "How a job ends"): the member
// that writes the run directory can die at any point of the ending, and a
// survivor writes the final checkpoint and summary, or the job does not
// exit 0. Real processes: the writer SIGKILLs itself at a named point
// (train.testing_writer_dies_at), so each point is hit every run.
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <chrono>
#include <csignal>
#include <filesystem>
#include <thread>
#include <string>
#include <vector>

#include "common/files.h"
#include "etcd_cluster.h"
#include "job_checks.h"
#include "test_util.h"

using limbo::file_exists;
using limbo::testing::run_limbo;
using limbo::testing::slurp;
using limbo::testing::TempDir;

namespace {

bool have_fmnist() { return file_exists("/usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz"); }

std::vector<std::string> job(const std::string& run, std::vector<std::string> extra = {}) {
  std::vector<std::string> a = {"launch", "--nproc", "3", "--min-workers", "1", "--",
                                "--run-dir", run, "--set", "model.name=mlp", "--set", "model.width=64",
                                "--set", "data.train_limit=1200", "--set", "data.test_limit=300",
                                "--set", "data.batch_size=8", "--set", "train.epochs=1",
                                "--set", "train.threads=1", "--set", "train.progress=false",
                                "--set", "train.sample_log=true", "--set", "elastic.collective_timeout=5"};
  for (const auto& e : extra) a.insert(a.end(), {"--set", e});
  return a;
}

// Found: once training completed the coordinator stopped watching beats,
// and it skipped members that had left (every member leaves before its
// final evaluation, checkpoint and summary): a writer frozen there
// (SIGSTOP, a host that lost power) was never marked silent, the others
// waited out --finish-timeout and the job exited 4 with neither file. Now
// the coordinator watches the members that left: a frozen writer is marked
// silent within a heartbeat timeout, the next member writes both files,
// the frozen one is killed (it can never write beside it), and the job
// exits 0 long before the finish timeout, at each point of the ending.
TEST(Ending, AWriterFrozenInTheEndingIsReplaced) {
  if (!have_fmnist()) GTEST_SKIP() << "dataset-fashion-mnist is not installed";
  for (const char* point : {"done", "eval", "checkpoint"}) {
    SCOPED_TRACE(point);
    TempDir d;
    const std::string run = d.file("run"), log = d.file("log");
    auto a = job(run, {std::string("train.testing_writer_dies_at=") + point, "train.testing_die_by_freezing=true"});
    a.insert(a.begin() + 5, {"--finish-timeout", "120"});
    const auto t0 = std::chrono::steady_clock::now();
    auto r = limbo::testing::wait_child(limbo::testing::spawn_limbo(a, log), log, 200);
    const double took = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    ASSERT_FALSE(r.timed_out) << r.output;
    EXPECT_NE(r.output.find(std::string("the writer freezes at '") + point + "'"), std::string::npos) << r.output;
    EXPECT_EQ(r.exit_code, 0) << r.output;
    EXPECT_NE(r.output.find("this member writes them"), std::string::npos) << r.output;
    EXPECT_NE(r.output.find("stopped beating in the job's ending (frozen); killing it"), std::string::npos)
        << r.output;
    EXPECT_LT(took, 100.0) << r.output;  // not the finish timeout (120 s)
    ASSERT_TRUE(file_exists(run + "/summary.json")) << r.output;
    ASSERT_TRUE(file_exists(run + "/checkpoint.pt")) << r.output;
    EXPECT_EQ(nlohmann::json::parse(slurp(run + "/summary.json"))["samples"].get<int64_t>(), 1200);
  }
}

// Found: Slurm's warning (SIGUSR1) while the job ended was forwarded as
// SIGTERM with a 5 s grace, so a writer still in its final evaluation or
// checkpoint was killed, the launcher exited 1 and the requeue script did
// not requeue: the result was lost. Now the ending goes on through the
// warning: the writer, 8 s from its final checkpoint when the warning
// comes, writes it and the summary, and the launcher exits 0.
TEST(Ending, SlurmsWarningDuringTheEndingLetsTheEndingFinish) {
  if (!have_fmnist()) GTEST_SKIP() << "dataset-fashion-mnist is not installed";
  TempDir d;
  const std::string run = d.file("run"), log = d.file("log");
  auto a = job(run, {"train.testing_writer_dies_at=\"slow\""});
  a[2] = "2";  // --nproc 2
  const pid_t launcher = limbo::testing::spawn_limbo(a, log);
  ASSERT_TRUE(limbo::testing::wait_for_text(log, "takes 8 s before its final checkpoint", 120)) << slurp(log);
  ASSERT_EQ(::kill(launcher, SIGUSR1), 0);
  auto r = limbo::testing::wait_child(launcher, log, 120);
  ASSERT_FALSE(r.timed_out) << r.output;
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("goes on through Slurm's warning"), std::string::npos) << r.output;
  ASSERT_TRUE(file_exists(run + "/summary.json")) << r.output;
  ASSERT_TRUE(file_exists(run + "/checkpoint.pt")) << r.output;
  EXPECT_EQ(nlohmann::json::parse(slurp(run + "/summary.json"))["samples"].get<int64_t>(), 1200);
}

// The review: a warning in the ending took back every kill, so a writer
// hung there (a hung mount, here one that ignores SIGTERM) held the job
// until --finish-timeout (600 s), longer than Slurm's warning gives: Slurm
// killed the launcher, with no exit 75 and no requeue. Now the ending may go
// on for --warning-grace after the warning; then the workers still running
// are killed and the launcher exits 75.
TEST(Ending, AWritersHangAfterSlurmsWarningEndsWithARequeueInTime) {
  if (!have_fmnist()) GTEST_SKIP() << "dataset-fashion-mnist is not installed";
  TempDir d;
  const std::string run = d.file("run"), log = d.file("log");
  auto a = job(run, {"train.testing_writer_dies_at=\"hang\""});
  a[2] = "2";  // --nproc 2
  a.insert(a.begin() + 5, {"--warning-grace", "3"});
  const pid_t launcher = limbo::testing::spawn_limbo(a, log);
  ASSERT_TRUE(limbo::testing::wait_for_text(log, "the writer hangs before its final checkpoint", 120)) << slurp(log);
  const auto t0 = std::chrono::steady_clock::now();
  ASSERT_EQ(::kill(launcher, SIGUSR1), 0);
  auto r = limbo::testing::wait_child(launcher, log, 60);
  const double took = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  ASSERT_FALSE(r.timed_out) << r.output;
  EXPECT_EQ(r.exit_code, 75) << r.output;
  EXPECT_NE(r.output.find("went on for --warning-grace (3 s) after Slurm's warning"), std::string::npos) << r.output;
  EXPECT_LT(took, 30.0) << r.output;
}

// Found (CI): the warning came after the workers had written elastic/done
// but before the launcher's next look at the store; it stopped the job
// instead, killed the writer in its final checkpoint 5 s later and exited
// 75. Here the warning comes while the last step is over and the
// completion not yet published: the ending must still go on, and exit 0.
TEST(Ending, SlurmsWarningAsTrainingCompletesLetsTheEndingFinish) {
  if (!have_fmnist()) GTEST_SKIP() << "dataset-fashion-mnist is not installed";
  TempDir d;
  const std::string run = d.file("run"), log = d.file("log");
  auto a = job(run, {"train.testing_writer_dies_at=\"slow_done\""});
  a[2] = "2";  // --nproc 2
  const pid_t launcher = limbo::testing::spawn_limbo(a, log);
  ASSERT_TRUE(limbo::testing::wait_for_text(log, "this member publishes it in 3 s", 120)) << slurp(log);
  ASSERT_EQ(::kill(launcher, SIGUSR1), 0);
  auto r = limbo::testing::wait_child(launcher, log, 120);
  ASSERT_FALSE(r.timed_out) << r.output;
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("training completed as Slurm's warning came"), std::string::npos) << r.output;
  ASSERT_TRUE(file_exists(run + "/summary.json")) << r.output;
  ASSERT_TRUE(file_exists(run + "/checkpoint.pt")) << r.output;
  EXPECT_EQ(nlohmann::json::parse(slurp(run + "/summary.json"))["samples"].get<int64_t>(), 1200);
}

// Found: 3 workers, rank 0 (the writer) SIGKILLed at the last step or as
// training completed: the survivors printed the test accuracy, the
// launcher exited 0, and the run directory had neither summary.json nor
// checkpoint.pt. At every point of the ending the survivors now write both.
TEST(Ending, TheWriterDyingAnywhereInTheEndingLosesNeitherCheckpointNorSummary) {
  if (!have_fmnist()) GTEST_SKIP() << "dataset-fashion-mnist is not installed";
  for (const char* point : {"last_step", "done", "eval", "checkpoint", "summary"}) {
    SCOPED_TRACE(point);
    TempDir d;
    const std::string run = d.file("run");
    auto r = run_limbo(job(run, {std::string("train.testing_writer_dies_at=") + point}));
    EXPECT_NE(r.output.find(std::string("the writer dies at '") + point + "'"), std::string::npos) << r.output;
    ASSERT_EQ(r.exit_code, 0) << r.output;
    ASSERT_TRUE(file_exists(run + "/summary.json")) << r.output;
    ASSERT_TRUE(file_exists(run + "/checkpoint.pt")) << r.output;
    auto s = nlohmann::json::parse(slurp(run + "/summary.json"));
    EXPECT_DOUBLE_EQ(s["epochs"].get<double>(), 1.0) << s.dump();
    EXPECT_EQ(s["samples"].get<int64_t>(), 1200) << s.dump();
    EXPECT_GT(s["test_accuracy"].get<double>(), 0.3) << s.dump();
    // The checkpoint is the final one, and loads.
    auto ev = run_limbo({"eval", "--checkpoint", run + "/checkpoint.pt"});
    ASSERT_EQ(ev.exit_code, 0) << ev.output;
    auto e = nlohmann::json::parse(ev.output.substr(ev.output.find('{')));
    EXPECT_NEAR(e["test_accuracy"].get<double>(), s["test_accuracy"].get<double>(), 1e-9) << ev.output;
    limbo::testing::expect_exactly_once({run}, 1, 1200);
    if (std::string(point) != "last_step") {  // otherwise the writer never saw the end
      EXPECT_NE(r.output.find("this member writes them"), std::string::npos) << r.output;
    }
  }
}

// The fourth review: the tests of the ending ran with the sample log, which
// gathers the whole state on every member, so a member taking over a
// sharded job's final files always held all of it. Without the log a
// survivor holds its own shard: the job still exits 0 with both files, the
// checkpoint keeps the weights and the update count without the state and
// says so, and a resume of it starts the optimizer afresh at update 0 (not
// at update N with zero moments, which would switch Adam's bias correction
// off).
TEST(Ending, AShardedWritersLossInTheEndingLeavesACheckpointThatResumes) {
  if (!have_fmnist()) GTEST_SKIP() << "dataset-fashion-mnist is not installed";
  const std::vector<std::string> sharded = {"train.sample_log=false", "optim.shard_state=true",
                                            "optim.algorithm=\"adamw\"", "optim.lr=0.002"};
  for (const char* point : {"done", "checkpoint"}) {
    SCOPED_TRACE(point);
    TempDir d;
    const std::string run = d.file("run");
    auto extra = sharded;
    extra.push_back(std::string("train.testing_writer_dies_at=") + point);
    auto r = run_limbo(job(run, extra));
    ASSERT_EQ(r.exit_code, 0) << r.output;
    EXPECT_NE(r.output.find("this member writes them"), std::string::npos) << r.output;
    EXPECT_NE(r.output.find("holds only its shard of the optimizer state"), std::string::npos) << r.output;
    ASSERT_TRUE(file_exists(run + "/summary.json")) << r.output;
    ASSERT_TRUE(file_exists(run + "/checkpoint.pt")) << r.output;
    auto s = nlohmann::json::parse(slurp(run + "/summary.json"));
    EXPECT_EQ(s["samples"].get<int64_t>(), 1200) << s.dump();
    EXPECT_GT(s["test_accuracy"].get<double>(), 0.3) << s.dump();
    // A second epoch from it, on one process.
    std::vector<std::string> resume = {"train", "--run-dir", run, "--resume"};
    for (const auto& kv : {"model.name=mlp", "model.width=64", "data.train_limit=1200", "data.test_limit=300",
                           "data.batch_size=8", "train.epochs=2", "train.threads=1", "train.progress=false",
                           "optim.algorithm=\"adamw\"", "optim.lr=0.002"})
      resume.insert(resume.end(), {"--set", kv});
    auto again = run_limbo(resume);
    ASSERT_EQ(again.exit_code, 0) << again.output;
    EXPECT_NE(again.output.find("holds no optimizer state"), std::string::npos) << again.output;
    EXPECT_NE(again.output.find("starts afresh at update 0"), std::string::npos) << again.output;
    auto s2 = nlohmann::json::parse(slurp(run + "/summary.json"));
    EXPECT_EQ(s2["resumed_from_step"].get<int64_t>(), s["steps"].get<int64_t>()) << s2.dump();
    EXPECT_GT(s2["test_accuracy"].get<double>(), 0.3) << s2.dump();
  }
}

// With one worker there is no survivor: the job must not report success
// without its result.
TEST(Ending, AJobWhoseOnlyWriterDiesInTheEndingDoesNotExitZero) {
  if (!have_fmnist()) GTEST_SKIP() << "dataset-fashion-mnist is not installed";
  for (const char* point : {"eval", "summary"}) {
    SCOPED_TRACE(point);
    TempDir d;
    const std::string run = d.file("run");
    auto a = job(run, {std::string("train.testing_writer_dies_at=") + point});
    a[2] = "1";  // --nproc 1
    auto r = run_limbo(a);
    EXPECT_NE(r.exit_code, 0) << r.output;
    EXPECT_NE(r.output.find("no final checkpoint and summary"), std::string::npos) << r.output;
  }
}

// S3: a member that has left but whose final checkpoint never returns (a
// hung mount) held the launcher for ever. --finish-timeout bounds the
// ending; the job then fails with the timeout's exit code.
TEST(Ending, AnEndingStuckPastTheFinishTimeoutFailsTheJob) {
  if (!have_fmnist()) GTEST_SKIP() << "dataset-fashion-mnist is not installed";
  TempDir d;
  const std::string run = d.file("run");
  auto a = job(run, {"train.testing_writer_dies_at=hang"});
  a[2] = "1";
  a.insert(a.begin() + 5, {"--finish-timeout", "3"});
  auto t0 = std::chrono::steady_clock::now();
  auto r = run_limbo(a);
  const double took = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_EQ(r.exit_code, 4) << r.output;
  EXPECT_NE(r.output.find("--finish-timeout"), std::string::npos) << r.output;
  EXPECT_LT(took, 120) << r.output;
}

// The same gap in the parameter server's ending: the finisher (the learner
// that takes the final weights and writes final.json and checkpoint.pt)
// dies first. Another process takes the final weights from the shards.
TEST(Ending, AParameterServerFinisherThatDiesIsReplaced) {
  if (!have_fmnist()) GTEST_SKIP() << "dataset-fashion-mnist is not installed";
  TempDir d;
  const std::string run = d.file("run");
  auto r = run_limbo({"launch", "--mode", "async", "--servers", "2", "--workers", "2", "--protocol", "softsync",
                      "--run-dir", run, "--", "--set", "model.name=mlp", "--set", "model.width=64",
                      "--set", "data.train_limit=1200", "--set", "data.test_limit=300", "--set", "data.batch_size=8",
                      "--set", "train.epochs=1", "--set", "train.threads=1", "--set", "train.progress=false",
                      "--set", "ps.request_timeout=30", "--set", "train.testing_writer_dies_at=eval"});
  EXPECT_NE(r.output.find("testing: the finisher dies"), std::string::npos) << r.output;
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("a new process takes them from the shards"), std::string::npos) << r.output;
  ASSERT_TRUE(file_exists(run + "/final.json")) << r.output;
  ASSERT_TRUE(file_exists(run + "/checkpoint.pt")) << r.output;
  auto s = nlohmann::json::parse(slurp(run + "/summary.json"));
  EXPECT_GT(s["test_accuracy"].get<double>(), 0.3) << s.dump();
  auto ev = run_limbo({"eval", "--checkpoint", run + "/checkpoint.pt"});
  ASSERT_EQ(ev.exit_code, 0) << ev.output;
  auto e = nlohmann::json::parse(ev.output.substr(ev.output.find('{')));
  EXPECT_NEAR(e["test_accuracy"].get<double>(), s["test_accuracy"].get<double>(), 1e-9) << ev.output;
}

// Found by a review: the launcher killed any worker whose id or `left` it
// could not read one second after completion, so a one-second etcd blip
// right after training completed killed the writer in its final evaluation
// (a large test split and model make it take seconds here), and the job had no
// summary. A store that does not answer now decides nothing.
TEST(Ending, AStoreHiccupRightAfterCompletionKillsNoFinishingWorker) {
  if (!have_fmnist()) GTEST_SKIP() << "dataset-fashion-mnist is not installed";
  TempDir d;
  limbo::testing::EtcdCluster etcd(d.path(), 1);
  if (!etcd.ok()) GTEST_SKIP() << etcd.why();
  const std::string run = d.file("run"), log = d.file("launch.log");
  pid_t launcher = limbo::testing::spawn_limbo(
      {"launch", "--nproc", "2", "--min-workers", "1", "--rdzv", "etcd://" + etcd.endpoints() + "/hiccup", "--",
       "--run-dir", run, "--set", "model.name=mlp", "--set", "model.width=2048", "--set", "data.train_limit=640",
       "--set", "data.test_limit=10000",
       "--set", "data.batch_size=32", "--set", "train.epochs=1", "--set", "train.threads=1",
       "--set", "train.progress=false", "--set", "train.eval_every_epochs=0"},
      log);
  ASSERT_TRUE(limbo::testing::wait_for_text(log, "training completed", 120)) << slurp(log);
  etcd.signal(0, SIGSTOP);
  std::this_thread::sleep_for(std::chrono::milliseconds(1500));
  etcd.signal(0, SIGCONT);
  auto r = limbo::testing::wait_child(launcher, log, 120);
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_EQ(r.output.find("killing it"), std::string::npos) << r.output;
  EXPECT_TRUE(file_exists(run + "/summary.json")) << r.output;
  EXPECT_TRUE(file_exists(run + "/checkpoint.pt")) << r.output;
}

}  // namespace
