// No single point of failure, as process tests: the job meets through a
// 3-member etcd cluster whose members run on the job's own three hosts
// (network namespaces, tests/netns.h). The host that started the job is
// killed, the etcd leader is killed, etcd is out of reach for seconds, and
// the run's records outlive rank 0's host. Needs root; skipped otherwise.
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>
#include <signal.h>

#include <cmath>
#include <filesystem>
#include <set>
#include <thread>

#include "common/files.h"
#include "etcd_cluster.h"
#include "host_job.h"
#include "job_checks.h"
#include "netns.h"
#include "test_util.h"

using limbo::testing::have_fmnist;
using limbo::testing::HostJob;
using limbo::testing::records;
using limbo::testing::slurp;
using limbo::testing::TempDir;
using limbo::testing::train_steps;
using limbo::testing::VirtualHosts;
using limbo::testing::wall_now;
using namespace std::chrono_literals;

namespace {

// ---- No single point of failure: the job meets through a 3-member etcd
// cluster whose members run on the job's own three hosts. ----

class EtcdJob : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!have_fmnist()) GTEST_SKIP() << "dataset-fashion-mnist is not installed";
    hosts_ = std::make_unique<VirtualHosts>(host_count());
    if (!hosts_->ok()) GTEST_SKIP() << hosts_->why();
    std::vector<limbo::testing::EtcdMemberSpec> members;
    for (int h = 0; h < 3; ++h)  // (the first three hosts)
      members.push_back({hosts_->ip(h), [this, h](const std::vector<std::string>& argv) { return hosts_->in(h, argv); }});
    // etcd's election settings for fast failover (docs/elastic.md): with
    // its defaults, losing the host of etcd's leader adds 1-3 s of etcd
    // election before anyone can write.
    etcd_ = std::make_unique<limbo::testing::EtcdCluster>(
        dir_.path(), members, std::vector<std::string>{"--heartbeat-interval", "50", "--election-timeout", "500"});
    if (!etcd_->ok()) GTEST_SKIP() << etcd_->why();
  }
  // The job's hosts (an etcd member runs on each of the first three).
  virtual int host_count() const { return 3; }
  // Every host, one worker each, at least two needed; host 0 starts the
  // job (and so coordinates it first). False when they never trained together.
  bool start(HostJob& job) {
    job.etcd = "etcd://" + etcd_->endpoints() + "/job-" + std::to_string(::getpid());
    for (int h = 0; h < host_count(); ++h) job.launch(h, 1, 2);
    if (!job.training(host_count())) {
      ADD_FAILURE() << host_count() << " workers never trained together" << job.all_logs();
      return false;
    }
    std::this_thread::sleep_for(1s);
    return true;
  }
  TempDir dir_;
  std::unique_ptr<VirtualHosts> hosts_;
  std::unique_ptr<limbo::testing::EtcdCluster> etcd_;
};

// The host that started the job, which coordinates it and runs rank 0 and
// an etcd member, is killed: another launcher takes over, the survivors
// re-form within 2 s, and rank 0 moves to another host's worker.
TEST_F(EtcdJob, TheHostThatStartedTheJobIsKilledTheOthersTrainOn) {
  HostJob job{*hosts_, 6};
  ASSERT_TRUE(start(job));
  const double t0 = wall_now();
  hosts_->signal_host(0, SIGKILL);
  job.wait_all(120, {});
  EXPECT_EQ(job.results[0].signal, SIGKILL);
  EXPECT_EQ(job.results[1].exit_code, 0) << job.all_logs();
  EXPECT_EQ(job.results[2].exit_code, 0) << job.all_logs();
  const std::string others = job.results[1].output + job.results[2].output;
  EXPECT_NE(others.find("coordinates the job now"), std::string::npos) << others;
  const double reformed = job.reformed_after(t0);
  std::printf("re-formed %.3f s after the starting host was killed\n", reformed);
  if (std::getenv("LIMBO_TEST_LOGS"))  // the whole story, for a measurement's breakdown
    std::printf("%s\n--- metrics ---\n%s", job.all_logs().c_str(), slurp(job.run + "/metrics.jsonl").c_str());
  EXPECT_GT(reformed, 0) << job.all_logs();
  // The 2 s target is measured and reported (README); this bound catches a
  // failover that waits on a timeout (7 s and 30 s before their fixes).
  EXPECT_LT(reformed, 5.0) << "the survivors re-formed " << reformed << " s after the starting host was killed"
                           << job.all_logs() << "\n--- metrics ---\n" << slurp(job.run + "/metrics.jsonl");
  limbo::testing::expect_exactly_once(job.run, 6, 3000);
  // The hosts share one run directory: one member writes it (one record
  // per step), rank 0 before the loss and after it.
  const auto steps = train_steps(job.run);
  EXPECT_EQ(std::set<int64_t>(steps.begin(), steps.end()).size(), steps.size()) << "a step recorded twice";
  for (const auto& r : records(job.run)) {
    if (r.value("kind", "") == "membership") {
      EXPECT_EQ(r["record_copies"].get<int>(), 1) << r.dump();
    }
  }
}

// Found: in the job's ending no launcher watched the members that had
// left, so a writer whose whole host froze after training completed (its
// launcher, and here the coordinator, frozen with it) was never marked
// silent: the others waited out --finish-timeout and the job lost its
// final files. Now another launcher takes the coordination over in the
// ending too, marks the frozen writer silent, and the next member writes
// the final checkpoint and summary; the other hosts exit 0.
TEST_F(EtcdJob, TheWritersHostFrozenInTheEndingAnotherMemberWritesTheFiles) {
  HostJob job{*hosts_, 2};
  job.launcher_extra = {"--finish-timeout", "120"};
  job.train_extra = {"--set", "train.testing_writer_dies_at=done", "--set", "train.testing_die_by_freezing=true",
                     "--set", "train.testing_die_with_host=true"};
  ASSERT_TRUE(start(job));
  int frozen = -1;
  const auto until = std::chrono::steady_clock::now() + 120s;
  while (frozen < 0 && std::chrono::steady_clock::now() < until) {
    for (int h = 0; h < 3; ++h)
      if (slurp(job.log(h)).find("the writer freezes at 'done' with its host") != std::string::npos) frozen = h;
    std::this_thread::sleep_for(50ms);
  }
  ASSERT_GE(frozen, 0) << job.all_logs();
  job.wait_all(100, {frozen});
  hosts_->signal_host(frozen, SIGKILL);
  const std::string logs = job.all_logs();
  for (int h = 0; h < 3; ++h) {
    if (h == frozen) continue;
    EXPECT_EQ(job.results[h].exit_code, 0) << "host " << h << logs;
  }
  EXPECT_NE(logs.find("this member writes them"), std::string::npos) << logs;
  ASSERT_TRUE(limbo::file_exists(job.run + "/summary.json")) << logs;
  ASSERT_TRUE(limbo::file_exists(job.run + "/checkpoint.pt")) << logs;
  EXPECT_EQ(nlohmann::json::parse(slurp(job.run + "/summary.json"))["samples"].get<int64_t>(), 2 * 3000);
}

// Every host keeps the run's records in its own run directory (hosts 1
// and 2 here; host 0 the default one). The starting host, which runs rank
// 0, is killed: each survivor's directory holds the whole run (metrics
// from the first step to the last, the newest checkpoint, the summary),
// `limbo status` reads the job through it, and `limbo plot` draws it.
TEST_F(EtcdJob, EachHostKeepsTheRunsRecordsAndTheyOutliveRankZerosHost) {
  HostJob job{*hosts_, 8};
  for (int h : {1, 2}) job.host_run[h] = job.d.file("run-" + std::to_string(h));
  for (int h = 0; h < 3; ++h) job.host_extra[h] = {"--status", hosts_->ip(h) + ":0"};
  job.train_extra = {"--set", "train.log_every=5"};
  ASSERT_TRUE(start(job));
  EXPECT_TRUE(limbo::testing::wait_for_text(job.run + "/metrics.jsonl", "\"record_copies\":3", 10))
      << slurp(job.run + "/metrics.jsonl");
  const double t0 = wall_now();
  hosts_->signal_host(0, SIGKILL);
  const std::string b = job.run_of(1), c = job.run_of(2);
  ASSERT_TRUE(limbo::testing::wait_for_text(b + "/metrics.jsonl", "\"record_copies\":2", 30)) << job.all_logs();
  std::this_thread::sleep_for(1s);  // the pages read the new round's record
  {
    const std::string out = job.d.file("status.out");
    const pid_t p = limbo::testing::spawn_process(hosts_->in(2, {LIMBO_BINARY, "status", b}), out);
    const auto r = limbo::testing::wait_child(p, out, 30);
    EXPECT_EQ(r.exit_code, 0) << r.output << slurp(b + "/status.url");
    EXPECT_NE(r.output.find("2 members"), std::string::npos) << r.output;
  }
  job.wait_all();
  EXPECT_EQ(job.results[0].signal, SIGKILL);
  EXPECT_EQ(job.results[1].exit_code, 0) << job.all_logs();
  EXPECT_EQ(job.results[2].exit_code, 0) << job.all_logs();
  int64_t last = -1;
  for (const std::string& dir : {b, c}) {
    SCOPED_TRACE(dir);
    const auto s = nlohmann::json::parse(slurp(dir + "/summary.json"));
    if (last < 0) last = s["steps"].get<int64_t>();
    EXPECT_EQ(s["steps"].get<int64_t>(), last);
    EXPECT_DOUBLE_EQ(s["epochs"].get<double>(), 8.0);
    // The whole run, from its first step to its last, with no gap.
    const auto steps = train_steps(dir);
    ASSERT_FALSE(steps.empty());
    EXPECT_LE(steps.front(), 5);
    EXPECT_EQ(steps.back(), last);
    for (size_t i = 1; i < steps.size(); ++i) {
      EXPECT_GT(steps[i], steps[i - 1]) << "step " << steps[i] << " recorded twice or out of order";
      EXPECT_LE(steps[i] - steps[i - 1], 5) << "steps " << steps[i - 1] << " to " << steps[i] << " not recorded";
    }
    std::set<int64_t> evals;
    bool moved = false;
    for (const auto& r : records(dir)) {
      if (r.value("kind", "") == "eval") evals.insert(std::llround(r["epoch"].get<double>()));
      if (r.value("kind", "") == "membership" && r["time"].get<double>() > t0) moved = true;
    }
    EXPECT_EQ(evals.size(), 8u) << "an epoch's evaluation is missing";
    EXPECT_TRUE(moved) << "the re-formed round is not recorded";
    const std::string plot_out = job.d.file("plot.out");
    const auto plot = limbo::testing::wait_child(
        limbo::testing::spawn_process({LIMBO_BINARY, "plot", dir}, plot_out), plot_out, 60);
    EXPECT_EQ(plot.exit_code, 0) << plot.output;
    EXPECT_TRUE(limbo::file_exists(dir + "/curves.png"));
    // The checkpoint there is the final one: resumed, the run has nothing left to train.
    auto args = job.train_args(dir == b ? 1 : 2);
    args.insert(args.begin(), {LIMBO_BINARY, "train"});
    args.push_back("--resume");
    const std::string resume_out = job.d.file("resume.out");
    const auto resumed = limbo::testing::wait_child(limbo::testing::spawn_process(args, resume_out), resume_out, 60);
    EXPECT_EQ(resumed.exit_code, 0) << resumed.output;
    EXPECT_EQ(nlohmann::json::parse(slurp(dir + "/summary.json"))["resumed_from_step"].get<int64_t>(), last);
  }
  limbo::testing::expect_exactly_once({job.run, b, c}, 8, 3000);
}

// Rank 0's host is lost, then every other host (etcd with them): the job
// is gone everywhere. `limbo launch --resume` on one surviving disk's run
// directory (host 2's, which never ran rank 0) continues the job from its
// newest checkpoint, alone, and completes it.
TEST_F(EtcdJob, LostEverywhereTheJobResumesFromAnyHostsRunDirectory) {
  HostJob job{*hosts_, 8};
  for (int h : {1, 2}) job.host_run[h] = job.d.file("run-" + std::to_string(h));
  job.train_extra = {"--set", "train.log_every=5", "--set", "train.checkpoint_every_steps=10"};
  ASSERT_TRUE(start(job));
  hosts_->signal_host(0, SIGKILL);
  const std::string c = job.run_of(2);
  ASSERT_TRUE(limbo::testing::wait_for_text(c + "/metrics.jsonl", "\"record_copies\":2", 30)) << job.all_logs();
  std::this_thread::sleep_for(1s);
  hosts_->signal_host(1, SIGKILL);
  hosts_->signal_host(2, SIGKILL);
  job.wait_all(30, {});
  const auto before = train_steps(c);
  ASSERT_FALSE(before.empty());
  ASSERT_FALSE(limbo::file_exists(c + "/summary.json")) << "the job completed before it was lost";
  std::vector<std::string> a = {LIMBO_BINARY, "launch", "--nproc", "1", "--min-workers", "1", "--rdzv",
                                hosts_->ip(2) + ":" + std::to_string(job.port), "--resume", "--"};
  const auto t = job.train_args(2);
  a.insert(a.end(), t.begin(), t.end());
  const std::string out = job.d.file("resumed.log");
  const auto r = limbo::testing::wait_child(limbo::testing::spawn_process(hosts_->in(2, a), out), out, 180);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const auto s = nlohmann::json::parse(slurp(c + "/summary.json"));
  EXPECT_DOUBLE_EQ(s["epochs"].get<double>(), 8.0);
  // At most the steps since the last checkpoint (every 10) are trained again.
  EXPECT_GE(s["resumed_from_step"].get<int64_t>(), before.back() - 10) << r.output;
  const auto steps = train_steps(c);
  EXPECT_EQ(steps.back(), s["steps"].get<int64_t>());
  const std::string plot_out = job.d.file("plot.out");
  const auto plot = limbo::testing::wait_child(
      limbo::testing::spawn_process({LIMBO_BINARY, "plot", c}, plot_out), plot_out, 60);
  EXPECT_EQ(plot.exit_code, 0) << plot.output;
}

// The etcd leader is killed mid-training: the cluster elects another and
// the job completes.
TEST_F(EtcdJob, TheEtcdLeaderKilledMidTrainingTheJobCompletes) {
  HostJob job{*hosts_, 6};
  ASSERT_TRUE(start(job));
  const int leader = etcd_->leader();
  ASSERT_GE(leader, 0);
  etcd_->kill(leader);
  job.wait_all();
  for (int h = 0; h < 3; ++h) EXPECT_EQ(job.results[h].exit_code, 0) << "host " << h << job.all_logs();
  limbo::testing::expect_exactly_once(job.run, 6, 3000);
}

// etcd is out of reach for three seconds (every member stopped): training
// goes on meanwhile, no member is dropped for it, and the job completes.
TEST_F(EtcdJob, EtcdUnavailableForSecondsTrainingGoesOn) {
  HostJob job{*hosts_, 7};
  ASSERT_TRUE(start(job));
  auto samples_logged = [&] {
    uintmax_t n = 0;
    for (const auto& f : std::filesystem::directory_iterator(job.run))
      if (f.path().filename().string().rfind("samples-", 0) == 0) n += std::filesystem::file_size(f.path());
    return n;
  };
  for (int i = 0; i < 3; ++i) etcd_->signal(i, SIGSTOP);
  std::this_thread::sleep_for(300ms);
  const auto before = samples_logged();
  std::this_thread::sleep_for(2700ms);
  const auto after = samples_logged();
  for (int i = 0; i < 3; ++i) etcd_->signal(i, SIGCONT);
  EXPECT_GT(after, before) << "no step was taken while etcd was out of reach";
  job.wait_all();
  for (int h = 0; h < 3; ++h) EXPECT_EQ(job.results[h].exit_code, 0) << "host " << h << job.all_logs();
  auto s = nlohmann::json::parse(slurp(job.run + "/summary.json"));
  EXPECT_EQ(s["workers"].get<int64_t>(), 3) << job.all_logs();
  limbo::testing::expect_exactly_once(job.run, 7, 3000);
}


// S1 and the stopped-member requirement: the etcd member that every
// client tries first (the first endpoint) is stopped, not killed, for 3 s
// mid-training: it keeps its connections open and answers nothing. Clients
// pass over it within their call's time, no member is dropped, and the job
// completes.
TEST_F(EtcdJob, TheFirstEtcdEndpointStoppedNoMemberIsDropped) {
  HostJob job{*hosts_, 6};
  ASSERT_TRUE(start(job));
  etcd_->signal(0, SIGSTOP);
  std::this_thread::sleep_for(3s);
  etcd_->signal(0, SIGCONT);
  job.wait_all();
  for (int h = 0; h < 3; ++h) EXPECT_EQ(job.results[h].exit_code, 0) << "host " << h << job.all_logs();
  auto s = nlohmann::json::parse(slurp(job.run + "/summary.json"));
  EXPECT_EQ(s["workers"].get<int64_t>(), 3) << job.all_logs();
  // Only the third host's join at the start (when a step committed before
  // it) changed the membership.
  EXPECT_LE(s["membership_changes"].get<int64_t>(), 1) << job.all_logs();
  const std::string logs = job.all_logs();
  EXPECT_EQ(logs.find("(lost"), std::string::npos) << logs;
  EXPECT_EQ(logs.find("went silent"), std::string::npos) << logs;
  limbo::testing::expect_exactly_once(job.run, 6, 3000);
}

// S2: the coordinating launcher deleted the job's keys on completion, so a
// launcher that missed the completion (cut off from etcd, or started late
// with the same name) started its workers into a fresh job and trained from
// scratch. The completion is kept: such a launcher is told, and trains
// nothing.
TEST_F(EtcdJob, ALauncherThatMissedTheCompletionDoesNotTrainTheJobAgain) {
  HostJob job{*hosts_, 2};
  ASSERT_TRUE(start(job));
  job.wait_all();
  for (int h = 0; h < 3; ++h) ASSERT_EQ(job.results[h].exit_code, 0) << "host " << h << job.all_logs();
  TempDir again;
  auto t = job.train_args(1);
  t[1] = again.file("run");
  std::vector<std::string> a = {LIMBO_BINARY, "launch", "--nproc", "1", "--min-workers", "1", "--rdzv", job.rdzv(), "--"};
  a.insert(a.end(), t.begin(), t.end());
  const std::string log = again.file("launch.log");
  auto r = limbo::testing::wait_child(limbo::testing::spawn_process(hosts_->in(1, a), log), log, 120);
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find("has already completed"), std::string::npos) << r.output;
  EXPECT_FALSE(limbo::file_exists(again.file("run/metrics.jsonl"))) << "trained again";
}

// Finding 9 of the fourth review: after a take-over a relay asked for the
// new coordinator's address only every third interval, while the new
// coordinator checked members it had not heard from after one heartbeat
// timeout, so relays that found it late were evicted (a needless
// re-formation or two per take-over). Eight hosts of one worker each
// (eight workers, eight launchers and three etcd members on this machine's
// cores: a loaded cluster); host 0 coordinates, runs rank 0 and the etcd
// member that every client tries first, and is killed whole. The take-over
// must cost exactly one re-formation, which loses host 0's worker alone:
// no live host is evicted, and the seven others finish the job.
class EightHostEtcdJob : public EtcdJob {
 protected:
  int host_count() const override { return 8; }
};

TEST_F(EightHostEtcdJob, ATakeOverEvictsNoLiveHost) {
  HostJob job{*hosts_, 8};
  job.train_limit = 4000;
  ASSERT_TRUE(start(job));
  const double t0 = wall_now();
  hosts_->signal_host(0, SIGKILL);
  job.wait_all(240, {});
  EXPECT_EQ(job.results[0].signal, SIGKILL);
  const std::string logs = job.all_logs();
  for (int h = 1; h < 8; ++h) EXPECT_EQ(job.results[h].exit_code, 0) << "host " << h << logs;
  EXPECT_NE(logs.find("coordinates the job now"), std::string::npos) << logs;
  int after = 0;
  for (const auto& r : records(job.run)) {
    if (r.value("kind", "") != "membership" || r["time"].get<double>() <= t0) continue;
    ++after;
    EXPECT_EQ(r["world"].get<int>(), 7) << "a live host was evicted: " << r.dump() << logs;
  }
  EXPECT_EQ(after, 1) << "the take-over re-formed the group " << after << " times" << logs;
  auto s = nlohmann::json::parse(slurp(job.run + "/summary.json"));
  EXPECT_EQ(s["workers"].get<int64_t>(), 7) << logs;
  limbo::testing::expect_exactly_once(job.run, 8, 4000);
}

}  // namespace
