// The launchers' process supervisor (common/process.h) with real children:
// reaping, roles, stopping with a grace period, recorded signals, and no
// child left behind.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <chrono>
#include <thread>

#include "common/process.h"

using limbo::Supervisor;
using namespace std::chrono_literals;

namespace {

std::optional<Supervisor::Exit> wait_exit(Supervisor& sup, std::chrono::milliseconds limit) {
  auto end = std::chrono::steady_clock::now() + limit;
  while (std::chrono::steady_clock::now() < end) {
    if (auto e = sup.poll()) return e;
    std::this_thread::sleep_for(10ms);
  }
  return std::nullopt;
}

bool alive(pid_t pid) { return ::kill(pid, 0) == 0 || errno != ESRCH; }

TEST(Supervisor, ReapsChildrenWithTheirRoleIndexAndStatus) {
  Supervisor sup;
  pid_t a = sup.start("/bin/sh", {"-c", "exit 3"}, "worker", 7);
  pid_t b = sup.start("/bin/sleep", {"30"}, "shard", 0);
  EXPECT_EQ(sup.count(), 2u);
  EXPECT_EQ(sup.count("worker"), 1u);
  auto e = wait_exit(sup, 5s);
  ASSERT_TRUE(e.has_value());
  EXPECT_EQ(e->pid, a);
  EXPECT_EQ(e->role, "worker");
  EXPECT_EQ(e->index, 7);
  EXPECT_EQ(e->code(), 3);
  EXPECT_FALSE(e->stopped_by_us);
  EXPECT_TRUE(sup.running(b));
  EXPECT_FALSE(sup.poll(b).has_value());  // still running
  sup.signal(b, SIGKILL);
  e = wait_exit(sup, 5s);
  ASSERT_TRUE(e.has_value());
  EXPECT_EQ(e->code(), 128 + SIGKILL);
  EXPECT_EQ(sup.count(), 0u);
}

TEST(Supervisor, StopGivesAGracePeriodThenKills) {
  Supervisor sup;
  sup.start("/bin/sleep", {"30"}, "worker", 0);                               // leaves on SIGTERM
  sup.start("/bin/sh", {"-c", "trap '' TERM; exec sleep 30"}, "worker", 1);  // ignores it
  pid_t other = sup.start("/bin/sleep", {"30"}, "shard", 0);
  std::this_thread::sleep_for(200ms);  // let the shell install its trap
  auto t0 = std::chrono::steady_clock::now();
  auto exits = sup.stop(SIGTERM, 500ms, "worker");
  const double took = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  ASSERT_EQ(exits.size(), 2u);
  for (const auto& e : exits) {
    EXPECT_TRUE(e.stopped_by_us);
    EXPECT_EQ(e.code(), 128 + (e.index == 0 ? SIGTERM : SIGKILL)) << "worker " << e.index;
  }
  EXPECT_GE(took, 0.45);  // the stubborn one had its grace period
  EXPECT_TRUE(sup.running(other));  // another role is left alone
}

TEST(Supervisor, RecordsTheLaunchersSignalsOnce) {
  Supervisor sup;
  EXPECT_EQ(sup.take_signal(), 0);
  ::raise(SIGTERM);  // recorded, not fatal
  EXPECT_EQ(sup.take_signal(), SIGTERM);
  EXPECT_EQ(sup.take_signal(), 0);
  ::raise(SIGINT);
  EXPECT_EQ(sup.take_signal(), SIGINT);
  EXPECT_EQ(sup.first_signal(), SIGTERM);
}

// Found: the latch kept one signal, so Slurm's warning (SIGUSR1) followed
// by SIGTERM within one look of the launcher (20 ms) was taken as SIGTERM
// alone: exit 143, not 75 (requeue). Both are taken, in the order they came.
TEST(Supervisor, TwoSignalsBetweenTwoLooksAreBothTakenInOrder) {
  Supervisor sup;
  while (sup.take_signal() != 0) {
  }
  ::raise(SIGUSR1);
  ::raise(SIGTERM);
  ::raise(SIGUSR1);  // again before it was taken: once
  EXPECT_EQ(sup.take_signal(), SIGUSR1);
  EXPECT_EQ(sup.take_signal(), SIGTERM);
  EXPECT_EQ(sup.take_signal(), 0);
  ::raise(SIGTERM);
  ::raise(SIGINT);
  EXPECT_EQ(sup.take_signal(), SIGTERM);
  EXPECT_EQ(sup.take_signal(), SIGINT);
  EXPECT_EQ(sup.take_signal(), 0);
}

TEST(Supervisor, LeavesNoChildBehind) {
  pid_t pid = 0;
  {
    Supervisor sup;
    pid = sup.start("/bin/sleep", {"30"}, "worker", 0);
    EXPECT_TRUE(alive(pid));
  }
  EXPECT_FALSE(alive(pid));  // killed and reaped by the destructor
}

}  // namespace

// The CPU quota of a group and the groups above it, from a tree laid out as
// the cgroup v1 cpu controller and the v2 hierarchy lay theirs out.
TEST(UsableCores, TheQuotaIsTheSmallestOfTheGroupAndItsAncestors) {
  char tmpl[] = "/tmp/limbo-cgroup-XXXXXX";
  ASSERT_NE(::mkdtemp(tmpl), nullptr);
  const std::string root = tmpl;
  auto group = [&](const std::string& path, const std::string& file, const std::string& text,
                   const std::string& file2 = "", const std::string& text2 = "") {
    ASSERT_EQ(std::system(("mkdir -p " + root + path).c_str()), 0);
    FILE* f = std::fopen((root + path + "/cgroup.procs").c_str(), "w");
    std::fclose(f);
    f = std::fopen((root + path + "/" + file).c_str(), "w");
    std::fputs(text.c_str(), f);
    std::fclose(f);
    if (file2.empty()) return;
    f = std::fopen((root + path + "/" + file2).c_str(), "w");
    std::fputs(text2.c_str(), f);
    std::fclose(f);
  };
  // v1: the root unlimited, /a at 1.5 cores, /a/b at half a core, /a/c unlimited.
  group("/v1", "cpu.cfs_quota_us", "-1\n", "cpu.cfs_period_us", "100000\n");
  group("/v1/a", "cpu.cfs_quota_us", "150000\n", "cpu.cfs_period_us", "100000\n");
  group("/v1/a/b", "cpu.cfs_quota_us", "5000\n", "cpu.cfs_period_us", "10000\n");
  group("/v1/a/c", "cpu.cfs_quota_us", "-1\n", "cpu.cfs_period_us", "100000\n");
  EXPECT_DOUBLE_EQ(limbo::cgroup_cpu_quota("/a/b", root + "/v1", false), 0.5);
  EXPECT_DOUBLE_EQ(limbo::cgroup_cpu_quota("/a/c", root + "/v1", false), 1.5);
  EXPECT_DOUBLE_EQ(limbo::cgroup_cpu_quota("/a", root + "/v1", false), 1.5);
  EXPECT_DOUBLE_EQ(limbo::cgroup_cpu_quota("/", root + "/v1", false), 0.0);
  // v2: cpu.max, "max" for none.
  group("/v2", "cpu.max", "max 100000\n");
  group("/v2/job", "cpu.max", "max 100000\n");
  group("/v2/job/member", "cpu.max", "25000 100000\n");
  EXPECT_DOUBLE_EQ(limbo::cgroup_cpu_quota("/job/member", root + "/v2", true), 0.25);
  EXPECT_DOUBLE_EQ(limbo::cgroup_cpu_quota("/job", root + "/v2", true), 0.0);
  // No such mount: no quota.
  EXPECT_DOUBLE_EQ(limbo::cgroup_cpu_quota("/a/b", root + "/none", false), 0.0);
  // A container's mount is its own group while /proc/self/cgroup names the
  // host's path for it: the mount's quota.
  group("/container", "cpu.cfs_quota_us", "200000\n", "cpu.cfs_period_us", "100000\n");
  EXPECT_DOUBLE_EQ(limbo::cgroup_cpu_quota("/docker/0123abcd", root + "/container", false), 2.0);
  ASSERT_EQ(std::system(("rm -rf " + root).c_str()), 0);
}

// This process's usable cores: at least one, at most the machine's.
TEST(UsableCores, AtLeastOneAndAtMostTheMachinesCores) {
  const int n = limbo::usable_cores();
  EXPECT_GE(n, 1);
  EXPECT_LE(n, static_cast<int>(std::max(1u, std::thread::hardware_concurrency())));
}
