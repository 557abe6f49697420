// One elastic job over virtual hosts (tests/netns.h), for the process
// tests of losing a host (test_hosts.cc) and of the etcd rendezvous
// (test_etcd_job.cc): a launcher per host, run directories, logs, and
// readers of the records the job leaves.
#pragma once

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <map>
#include <regex>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "common/files.h"
#include "netns.h"
#include "test_util.h"

namespace limbo::testing {

using namespace std::chrono_literals;


// The records of a run directory's metrics.jsonl.
inline std::vector<nlohmann::json> records(const std::string& dir) {
  std::vector<nlohmann::json> out;
  std::istringstream in(slurp(dir + "/metrics.jsonl"));
  for (std::string line; std::getline(in, line);) out.push_back(nlohmann::json::parse(line));
  return out;
}

// The steps of the "train" records, in file order.
inline std::vector<int64_t> train_steps(const std::string& dir) {
  std::vector<int64_t> out;
  for (const auto& r : records(dir))
    if (r.value("kind", "") == "train") out.push_back(r["step"].get<int64_t>());
  return out;
}

inline double wall_now() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

inline bool have_fmnist() { return limbo::file_exists("/usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz"); }

// One job over virtual hosts: a launcher per host, one run directory (the
// hosts share this machine's disk).
struct HostJob {
  HostJob(VirtualHosts& h, int e) : hosts(h), epochs(e) {}
  VirtualHosts& hosts;
  int epochs;
  int train_limit = 3000;
  std::vector<std::string> launcher_extra;
  std::map<int, std::vector<std::string>> host_extra;  // more launcher arguments for one host
  std::map<int, std::string> host_run;  // a run directory of one host's own (default: the shared one)
  std::vector<std::string> train_extra;  // more training arguments (every host)
  std::map<int, std::vector<std::string>> host_train_extra;  // more training arguments of one host's workers
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
    if (host_train_extra.count(h)) a.insert(a.end(), host_train_extra.at(h).begin(), host_train_extra.at(h).end());
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
    if (h == 0) {
      // 60 s: once, under load, host 0's launcher had logged nothing after 30 s.
      ASSERT_TRUE(limbo::testing::wait_for_text(log(0), "store at", 60)) << slurp(log(0));
    }
  }
  // Waits (120 s at most) until host h's first `workers` workers have
  // registered with the job: each logs "training ..." once it has its id.
  // A host launched after that takes later ids, so later ranks (ranks
  // follow ids); a fixed pause did not ensure it on a loaded machine, where
  // a worker took 11 s to start (found in a suite run).
  bool registered(int h, int workers = 1) {
    const auto end = std::chrono::steady_clock::now() + 120s;
    for (;;) {
      const std::string text = slurp(log(h));
      int n = 0;
      for (size_t at = text.find("] training "); at != std::string::npos; at = text.find("] training ", at + 1)) ++n;
      if (n >= workers) return true;
      if (std::chrono::steady_clock::now() > end) {
        ADD_FAILURE() << "host " << h << ": " << n << " of " << workers << " workers registered" << all_logs();
        return false;
      }
      std::this_thread::sleep_for(50ms);
    }
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
  // Waits until a group of `members` workers has formed (its rank 0 logged
  // "N workers, rank 0") and training has begun. The coordinator deciding a
  // round is not enough: on a loaded machine rounds announced in quick
  // succession replace each other before any forms, and a fault injected
  // then hits a smaller group than the test means to (found in CI).
  bool training(int members) {
    const std::string formed = std::to_string(members) + " workers, rank 0,";
    const auto end = std::chrono::steady_clock::now() + 60s;
    while (all_logs().find(formed) == std::string::npos) {
      if (std::chrono::steady_clock::now() > end) return false;
      std::this_thread::sleep_for(50ms);
    }
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


}  // namespace limbo::testing
