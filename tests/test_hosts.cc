// Losing a host, every way a host is lost, across "hosts" that are network
// namespaces joined by a bridge (tests/netns.h): all its processes killed,
// frozen, cut off by the network, or only its launcher killed. And the job
// secret that guards the rendezvous store, against rogue clients while a
// job trains. Needs root and iproute2 (CI runs as root); skipped otherwise.
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>
#include <signal.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <regex>
#include <set>
#include <thread>

#include "comm/store.h"
#include "common/error.h"
#include "common/files.h"
#include "job_checks.h"
#include "etcd_cluster.h"
#include "netns.h"
#include "test_util.h"

using limbo::testing::ProcessResult;
using limbo::testing::slurp;
using limbo::testing::TempDir;
using limbo::testing::VirtualHosts;
using namespace std::chrono_literals;

namespace {

// The records of a run directory's metrics.jsonl.
std::vector<nlohmann::json> records(const std::string& dir) {
  std::vector<nlohmann::json> out;
  std::istringstream in(slurp(dir + "/metrics.jsonl"));
  for (std::string line; std::getline(in, line);) out.push_back(nlohmann::json::parse(line));
  return out;
}

// The steps of the "train" records, in file order.
std::vector<int64_t> train_steps(const std::string& dir) {
  std::vector<int64_t> out;
  for (const auto& r : records(dir))
    if (r.value("kind", "") == "train") out.push_back(r["step"].get<int64_t>());
  return out;
}

double wall_now() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

bool have_fmnist() { return limbo::file_exists("/usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz"); }

// One job over virtual hosts: a launcher per host, one run directory (the
// hosts share this machine's disk).
struct HostJob {
  VirtualHosts& hosts;
  int epochs;
  int train_limit = 3000;
  std::vector<std::string> launcher_extra;
  std::map<int, std::vector<std::string>> host_extra;  // more launcher arguments for one host
  std::map<int, std::string> host_run;  // a run directory of one host's own (default: the shared one)
  std::vector<std::string> train_extra;  // more training arguments (every host)
  TempDir d;
  std::string run = d.file("run");
  int port = 29500 + ::getpid() % 400;
  std::map<int, pid_t> launchers;
  std::map<int, double> exited_at;
  std::map<int, ProcessResult> results;

  std::string etcd;  // etcd://... when the job meets through etcd
  std::string rdzv() const { return etcd.empty() ? hosts.ip(0) + ":" + std::to_string(port) : etcd; }
  std::string log(int h) const { return d.file("host" + std::to_string(h) + ".log"); }

  std::string run_of(int h) const { return host_run.count(h) ? host_run.at(h) : run; }
  std::vector<std::string> train_args(int h = 0) const {
    std::vector<std::string> a = {
        "--run-dir", run_of(h), "--set", "model.name=mlp", "--set", "model.width=64",
        "--set", "data.train_limit=" + std::to_string(train_limit), "--set", "data.test_limit=300",
        "--set", "data.batch_size=16", "--set", "train.epochs=" + std::to_string(epochs),
        "--set", "train.threads=1", "--set", "train.progress=false", "--set", "train.sample_log=true",
        "--set", "train.slow_step_ms=20", "--set", "elastic.collective_timeout=30"};
    a.insert(a.end(), train_extra.begin(), train_extra.end());
    return a;
  }
  void launch(int h, int nproc, int min) {
    std::vector<std::string> a = {LIMBO_BINARY, "launch", "--nproc", std::to_string(nproc), "--min-workers",
                                  std::to_string(min), "--rdzv", rdzv()};
    a.insert(a.end(), launcher_extra.begin(), launcher_extra.end());
    a.insert(a.end(), host_extra[h].begin(), host_extra[h].end());
    a.push_back("--");
    auto t = train_args(h);
    a.insert(a.end(), t.begin(), t.end());
    launchers[h] = limbo::testing::spawn_process(hosts.in(h, a), log(h));
    if (h == 0) ASSERT_TRUE(limbo::testing::wait_for_text(log(0), "store at", 30)) << slurp(log(0));
  }
  // Host A (hosting, 2 workers) and host B (1 worker), training together
  // for a second; false (with a test failure) when they never did.
  bool start_two_hosts() {
    launch(0, 2, 1);
    launch(1, 1, 1);
    if (!training(3)) {
      ADD_FAILURE() << "three workers never trained together" << all_logs();
      return false;
    }
    std::this_thread::sleep_for(1s);
    return true;
  }
  // Waits until a round holds `members` workers and training has begun.
  // (Any ids: a worker lost while rounds are replaced in quick succession
  // is restarted under a new id.)
  bool training(int members) {
    const std::regex round("workers \\[[0-9]+(,[0-9]+){" + std::to_string(members - 1) + "}\\]");
    const auto end = std::chrono::steady_clock::now() + 60s;
    while (!std::regex_search(slurp(log(0)), round))
      if (std::chrono::steady_clock::now() > end) return false;
      else std::this_thread::sleep_for(50ms);
    return limbo::testing::wait_for_text(run + "/metrics.jsonl", "\"kind\":\"train\"", 60);
  }
  // Waits for every launcher still running except the `frozen` ones (all
  // at most `timeout_s`), recording when each exited; then kills the rest.
  void wait_all(double timeout_s = 120, const std::set<int>& frozen = {}) {
    const auto end = std::chrono::steady_clock::now() + std::chrono::duration<double>(timeout_s);
    while (results.size() + frozen.size() < launchers.size() && std::chrono::steady_clock::now() < end) {
      for (auto& [h, pid] : launchers) {
        if (results.count(h) || frozen.count(h)) continue;
        int status = 0;
        if (::waitpid(pid, &status, WNOHANG) == pid) {
          ProcessResult r;
          if (WIFEXITED(status)) r.exit_code = WEXITSTATUS(status);
          if (WIFSIGNALED(status)) r.signal = WTERMSIG(status);
          r.output = slurp(log(h));
          results[h] = r;
          exited_at[h] = wall_now();
        }
      }
      std::this_thread::sleep_for(20ms);
    }
    for (auto& [h, pid] : launchers)
      if (!results.count(h)) {
        ::kill(pid, SIGKILL);
        results[h] = limbo::testing::wait_child(pid, log(h));
        results[h].timed_out = !frozen.count(h);
      }
  }
  // The processes of host h other than its launcher (its workers).
  std::vector<pid_t> workers(int h) const {
    std::vector<pid_t> out;
    for (pid_t p : hosts.pids(h))
      if (p != launchers.at(h)) out.push_back(p);
    return out;
  }
  // The one worker of host h (-1, with a test failure, unless there is one).
  pid_t only_worker(int h) const {
    auto w = workers(h);
    EXPECT_EQ(w.size(), 1u) << "host " << h << " runs " << w.size() << " workers";
    return w.size() == 1 ? w[0] : -1;
  }
  // Seconds from `t0` until the survivors' group re-formed after it (the
  // first membership record written after t0), or -1.
  double reformed_after(double t0) const {
    std::istringstream in(slurp(run + "/metrics.jsonl"));
    for (std::string line; std::getline(in, line);) {
      auto r = nlohmann::json::parse(line);
      if (r.value("kind", "") == "membership" && r.value("reason", "") != "start" && r["time"].get<double>() > t0)
        return r["time"].get<double>() - t0;
    }
    return -1;
  }
  std::string all_logs() const {
    std::string s;
    for (const auto& [h, pid] : launchers) s += "\n--- host " + std::to_string(h) + " ---\n" + slurp(log(h));
    return s;
  }
};

class LostHost : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!have_fmnist()) GTEST_SKIP() << "dataset-fashion-mnist is not installed";
    hosts_ = std::make_unique<VirtualHosts>(2);
    if (!hosts_->ok()) GTEST_SKIP() << hosts_->why();
  }
  std::unique_ptr<VirtualHosts> hosts_;
};

// Found: with B's launcher and worker SIGKILLed, the coordinator wrote a
// round that still held B's worker (its heartbeat had not yet run out),
// replaced it 0.4 s later, and the survivors waited for the replaced round
// to form until the formation timeout (10 s then; 30 s here).
TEST_F(LostHost, AKilledHostIsReplacedAtOnceNotAfterAFormationTimeout) {
  HostJob job{*hosts_, 6};
  ASSERT_TRUE(job.start_two_hosts());
  const double t0 = wall_now();
  hosts_->signal_host(1, SIGKILL);
  job.wait_all();
  ASSERT_EQ(job.results[0].exit_code, 0) << job.all_logs();
  const double reformed = job.reformed_after(t0);
  EXPECT_GT(reformed, 0) << job.all_logs();
  EXPECT_LT(reformed, 3.0) << "the survivors re-formed " << reformed << " s after the host was killed";
  limbo::testing::expect_exactly_once(job.run, 6, 3000);
}

// Found: B's worker SIGSTOPped, the job completed on A (exit 0), and B's
// launcher logged "training completed", then a store error, and exited 3.
TEST_F(LostHost, ANonHostingLauncherOfACompletedJobExitsZero) {
  HostJob job{*hosts_, 5};
  ASSERT_TRUE(job.start_two_hosts());
  const pid_t b_worker = job.only_worker(1);
  ASSERT_GT(b_worker, 0);
  ::kill(b_worker, SIGSTOP);
  job.wait_all();
  EXPECT_EQ(job.results[0].exit_code, 0) << job.all_logs();
  EXPECT_EQ(job.results[1].exit_code, 0) << job.all_logs();
  EXPECT_LT(job.exited_at[1] - job.exited_at[0], 5.0) << job.all_logs();
  limbo::testing::expect_exactly_once(job.run, 5, 3000);
}

// Found: after a partition, B's launcher was still running 30 s after the
// job had completed on A.
TEST_F(LostHost, ALauncherCutOffFromItsJobStopsItsWorkersAndExitsWithItsOwnCode) {
  HostJob job{*hosts_, 5};
  job.launcher_extra = {"--rdzv-timeout", "4"};
  ASSERT_TRUE(job.start_two_hosts());
  const double t0 = wall_now();
  ASSERT_TRUE(hosts_->cut(1));
  job.wait_all();
  EXPECT_EQ(job.results[0].exit_code, 0) << job.all_logs();
  EXPECT_EQ(job.results[1].exit_code, 5) << job.all_logs();  // lost the job
  EXPECT_NE(job.results[1].output.find("lost the job"), std::string::npos) << job.results[1].output;
  EXPECT_NE(job.results[1].output.find(job.rdzv()), std::string::npos) << job.results[1].output;
  EXPECT_LT(job.exited_at[1] - t0, 4.0 + 1.5) << "within --rdzv-timeout";
  EXPECT_TRUE(job.workers(1).empty()) << "B's worker outlived its launcher";
  const double reformed = job.reformed_after(t0);
  EXPECT_GT(reformed, 0);
  EXPECT_LT(reformed, 3.0);
  limbo::testing::expect_exactly_once(job.run, 5, 3000);
}

// Only B's launcher dies: its worker is told (SIGTERM from the kernel) and
// leaves the job cleanly; the others go on without it.
TEST_F(LostHost, OnlyTheLauncherDiesItsWorkerLeavesCleanly) {
  HostJob job{*hosts_, 5};
  ASSERT_TRUE(job.start_two_hosts());
  const pid_t b_worker = job.only_worker(1);
  ASSERT_GT(b_worker, 0);
  const double t0 = wall_now();
  ::kill(job.launchers[1], SIGKILL);
  job.wait_all();
  EXPECT_EQ(job.results[0].exit_code, 0) << job.all_logs();
  EXPECT_EQ(job.results[1].signal, SIGKILL);
  EXPECT_NE(::kill(b_worker, 0), 0) << "B's worker still runs without its launcher";
  EXPECT_NE(job.results[0].output.find("left 3"), std::string::npos) << job.results[0].output;
  const double reformed = job.reformed_after(t0);
  EXPECT_GT(reformed, 0);
  EXPECT_LT(reformed, 3.0);
  limbo::testing::expect_exactly_once(job.run, 5, 3000);
}

// A worker killed on another host (its launcher alive) is started again by
// its launcher and rejoins the job that went on without it.
TEST_F(LostHost, AWorkerKilledOnAnotherHostIsRestartedAndRejoins) {
  HostJob job{*hosts_, 6};
  ASSERT_TRUE(job.start_two_hosts());
  const pid_t b_worker = job.only_worker(1);
  ASSERT_GT(b_worker, 0);
  ::kill(b_worker, SIGKILL);
  job.wait_all();
  EXPECT_EQ(job.results[0].exit_code, 0) << job.all_logs();
  EXPECT_EQ(job.results[1].exit_code, 0) << job.all_logs();
  EXPECT_NE(job.results[1].output.find("restarting them to rejoin the job"), std::string::npos)
      << job.results[1].output;
  EXPECT_NE(job.results[0].output.find("(joined 4)"), std::string::npos) << job.results[0].output;
  limbo::testing::expect_exactly_once(job.run, 6, 3000);
}

// Host B's launcher neither hosts the store nor runs rank 0, and its run
// directory is its own: its status page still shows the whole job (rank
// 0 publishes its records in the store), and `limbo
// status` run on host A reads it across the network.
TEST_F(LostHost, EveryLaunchersPageShowsTheWholeJob) {
  HostJob job{*hosts_, 5};
  job.host_extra[1] = {"--status", hosts_->ip(1) + ":0"};
  job.host_run[1] = job.d.file("run-b");
  ASSERT_TRUE(job.start_two_hosts());
  std::this_thread::sleep_for(1500ms);
  std::smatch m;
  const std::string text = slurp(job.log(1));
  ASSERT_TRUE(std::regex_search(text, m, std::regex("status page at http://([0-9.]+:[0-9]+)/"))) << text;
  const std::string out = job.d.file("status.out");
  const pid_t p = limbo::testing::spawn_process(hosts_->in(0, {LIMBO_BINARY, "status", m[1].str()}), out);
  const auto r = limbo::testing::wait_child(p, out, 30);
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("3 members"), std::string::npos) << r.output;
  std::smatch step;
  ASSERT_TRUE(std::regex_search(r.output, step, std::regex("step ([0-9]+)"))) << r.output;
  EXPECT_GT(std::stoll(step[1]), 0) << r.output;
  EXPECT_NE(r.output.find("loss 0."), std::string::npos) << r.output;
  // Host B's worker keeps the run's records in B's own run directory too.
  EXPECT_FALSE(train_steps(job.host_run[1]).empty()) << "host B's run directory has no metrics";
  job.wait_all();
  EXPECT_EQ(job.results[0].exit_code, 0) << job.all_logs();
  EXPECT_EQ(job.results[1].exit_code, 0) << job.all_logs();
}

// Eight hosts, one worker each, at least four needed. Three are lost one
// after another, each a different way: killed, frozen, cut off.
TEST(EightHosts, ThreeHostsLostThreeWaysTheJobCompletesOnTheRest) {
  if (!have_fmnist()) GTEST_SKIP() << "dataset-fashion-mnist is not installed";
  VirtualHosts hosts(8);
  if (!hosts.ok()) GTEST_SKIP() << hosts.why();
  // LIMBO_EIGHT_HOSTS_EPOCHS=30 runs the longer version (README).
  const char* env = std::getenv("LIMBO_EIGHT_HOSTS_EPOCHS");
  const int epochs = env ? std::max(5, std::atoi(env)) : 5;
  HostJob job{hosts, epochs};
  job.train_limit = 4000;
  // Sixteen processes share two cores here: a longer heartbeat timeout
  // keeps scheduling delays from counting as losses.
  // The hosting launcher waits longer for the first round (eight launchers
  // start slowly on two cores); the others count a lost job after 6 s.
  job.launcher_extra = {"--heartbeat-timeout", "1"};
  job.host_extra[0] = {"--rdzv-timeout", "60"};
  for (int h = 1; h < 8; ++h) job.host_extra[h] = {"--rdzv-timeout", "6"};
  job.launch(0, 1, 4);
  for (int h = 1; h < 8; ++h) job.launch(h, 1, 4);
  ASSERT_TRUE(job.training(8)) << job.all_logs();
  std::this_thread::sleep_for(1s);
  hosts.signal_host(7, SIGKILL);
  std::this_thread::sleep_for(2s);
  hosts.signal_host(6, SIGSTOP);
  std::this_thread::sleep_for(2s);
  ASSERT_TRUE(hosts.cut(5));
  job.wait_all(120, {6});
  for (int h : {0, 1, 2, 3, 4}) EXPECT_EQ(job.results[h].exit_code, 0) << "host " << h << job.all_logs();
  EXPECT_EQ(job.results[5].exit_code, 5) << job.results[5].output;
  EXPECT_EQ(job.results[7].signal, SIGKILL);
  auto s = nlohmann::json::parse(slurp(job.run + "/summary.json"));
  EXPECT_EQ(s["workers"].get<int64_t>(), 5);
  limbo::testing::expect_exactly_once(job.run, epochs, 4000);
}

// A job guarded by a secret trains on while clients without it, with a
// wrong one, with garbage, and a worker started without it are refused.
TEST(JobSecret, RogueClientsAreRefusedAndLoggedWhileTheJobTrains) {
  if (!have_fmnist()) GTEST_SKIP() << "dataset-fashion-mnist is not installed";
  TempDir d;
  const std::string token = d.file("job.token"), log = d.file("launch.log"), run = d.file("run");
  std::ofstream(token) << "s3cret-of-this-job-0123456789abcdef\n";
  ::chmod(token.c_str(), 0600);
  pid_t launcher = limbo::testing::spawn_limbo(
      {"launch", "--nproc", "2", "--min-workers", "2", "--token-file", token, "--run-dir", run, "--",
       "--set", "model.name=mlp", "--set", "model.width=64", "--set", "data.train_limit=3000",
       "--set", "data.test_limit=300", "--set", "data.batch_size=16", "--set", "train.epochs=4",
       "--set", "train.threads=1", "--set", "train.progress=false", "--set", "train.slow_step_ms=10",
       "--set", "train.sample_log=true"},
      log);
  limbo::testing::KillOnExit guard{{launcher}};
  ASSERT_TRUE(limbo::testing::wait_for_text(run + "/metrics.jsonl", "\"kind\":\"train\"", 60)) << slurp(log);
  std::smatch m;
  const std::string text = slurp(log);
  ASSERT_TRUE(std::regex_search(text, m, std::regex("store at 127.0.0.1:([0-9]+)"))) << text;
  const int port = std::stoi(m[1]);
  EXPECT_THROW(limbo::comm::StoreClient("127.0.0.1", port, 2s), limbo::InvalidInput);
  EXPECT_THROW(limbo::comm::StoreClient("127.0.0.1", port, 2s, "a wrong secret of 32 bytes......"),
               limbo::InvalidInput);
  int raw = limbo::testing::connect_loopback(port);
  const std::string junk = "\x10\x00\x00\x00\x01garbage-garbage";
  ::send(raw, junk.data(), junk.size(), MSG_NOSIGNAL);
  ::close(raw);
  auto rogue = limbo::testing::run_limbo({"train", "--elastic", "--dist-rdzv", "127.0.0.1:" + m[1].str(),
                                          "--run-dir", d.file("rogue"), "--set", "model.name=mlp"});
  EXPECT_EQ(rogue.exit_code, 2) << rogue.output;
  EXPECT_NE(rogue.output.find("needs the job's secret"), std::string::npos) << rogue.output;
  // The parameter-server launcher has no store to guard: the flag is refused.
  auto ps = limbo::testing::run_limbo({"launch", "--mode", "async", "--token-file", token, "--run-dir",
                                       d.file("ps")});
  EXPECT_EQ(ps.exit_code, 2) << ps.output;
  EXPECT_NE(ps.output.find("--keys"), std::string::npos) << ps.output;
  auto r = limbo::testing::wait_child(launcher, log, 180);
  guard.pids.clear();
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("refused a connection"), std::string::npos) << r.output;
  auto s = nlohmann::json::parse(slurp(run + "/summary.json"));
  EXPECT_EQ(s["workers"].get<int64_t>(), 2);
  EXPECT_EQ(s["membership_changes"].get<int64_t>(), 0) << "a rogue client changed the membership";
  limbo::testing::expect_identical_finals(run, 2);
}

// ---- No single point of failure: the job meets through a 3-member etcd
// cluster whose members run on the job's own three hosts. ----

class EtcdJob : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!have_fmnist()) GTEST_SKIP() << "dataset-fashion-mnist is not installed";
    hosts_ = std::make_unique<VirtualHosts>(3);
    if (!hosts_->ok()) GTEST_SKIP() << hosts_->why();
    std::vector<limbo::testing::EtcdMemberSpec> members;
    for (int h = 0; h < 3; ++h)
      members.push_back({hosts_->ip(h), [this, h](const std::vector<std::string>& argv) { return hosts_->in(h, argv); }});
    // etcd's election settings for fast failover (docs/elastic.md): with
    // its defaults, losing the host of etcd's leader adds 1-3 s of etcd
    // election before anyone can write.
    etcd_ = std::make_unique<limbo::testing::EtcdCluster>(
        dir_.path(), members, std::vector<std::string>{"--heartbeat-interval", "50", "--election-timeout", "500"});
    if (!etcd_->ok()) GTEST_SKIP() << etcd_->why();
  }
  // Three hosts, one worker each, at least two needed; host 0 starts the
  // job (and so coordinates it first). False when they never trained together.
  bool start(HostJob& job) {
    job.etcd = "etcd://" + etcd_->endpoints() + "/job-" + std::to_string(::getpid());
    job.launch(0, 1, 2);
    job.launch(1, 1, 2);
    job.launch(2, 1, 2);
    if (!job.training(3)) {
      ADD_FAILURE() << "three workers never trained together" << job.all_logs();
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
  for (const auto& r : records(job.run))
    if (r.value("kind", "") == "membership") EXPECT_EQ(r["record_copies"].get<int>(), 1) << r.dump();
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

}  // namespace
