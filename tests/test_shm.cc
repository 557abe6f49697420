// The shared-memory group (comm/shm_group.h): the same bits as the Gloo
// path, sums in member order, abort, a member that dies, segment names that
// never outlive formation and stale ones removed. Members are threads of
// this process, each with its own mapping and its own store connection; the
// process tests of elastic jobs (test_elastic, test_launch) run on it too,
// since every single-host group is a shared-memory group.
#include <gtest/gtest.h>

#include <dirent.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <torch/torch.h>

#include <functional>
#include <thread>

#include "comm/collective.h"
#include "comm/hier_group.h"
#include "comm/shm_group.h"
#include "comm/store.h"
#include "common/error.h"
#include "common/timing.h"
#include "member_threads.h"
#include "test_util.h"

using namespace limbo;

namespace {

using MemberFn = std::function<void(int rank, comm::Collective& shm, comm::Collective* gloo)>;

// Runs fn on `world` threads, each with a shared-memory group (and a Gloo
// group of the same members when `with_gloo`).
void with_members(int world, bool with_gloo, const std::string& prefix, const MemberFn& fn) {
  limbo::testing::expect_no_member_errors(limbo::testing::on_member_threads(world, [&](int r, comm::GroupOptions go) {
    go.prefix = prefix + "/shm";
    auto shm = comm::make_shm_group(go, r, world);
    if (!shm) throw Error("no shared-memory group");
    EXPECT_STREQ(shm->transport(), "shared-memory");
    std::unique_ptr<comm::Collective> gloo;
    if (with_gloo) {
      go.prefix = prefix + "/gloo";
      gloo = comm::make_gloo_group(go, r, world);
    }
    fn(r, *shm, gloo.get());
  }));
}

// A member's values (a generator of its own: members are threads).
torch::Tensor member_values(int rank, int64_t n, torch::ScalarType type) {
  auto gen = at::detail::createCPUGenerator(100 + rank);
  auto t = torch::randn({n}, gen) * 3;
  if (type == torch::kInt64) return (t * 1000).to(torch::kInt64);
  return t.to(type);
}

std::vector<std::string> segment_names_of(pid_t pid) {
  std::vector<std::string> out;
  const std::string prefix = "limbo-shm-" + std::to_string(pid) + "-";
  if (DIR* d = ::opendir("/dev/shm")) {
    while (dirent* e = ::readdir(d))
      if (std::string(e->d_name).rfind(prefix, 0) == 0) out.push_back(e->d_name);
    ::closedir(d);
  }
  return out;
}

// Whether this machine has POSIX shared memory (a chroot may lack /dev/shm:
// groups then fall back to Gloo, and these tests have nothing to test).
bool shm_usable() {
  const std::string probe = "/limbo-shm-probe-" + std::to_string(::getpid());
  const int fd = ::shm_open(probe.c_str(), O_CREAT | O_RDWR, 0600);
  if (fd < 0) return false;
  ::close(fd);
  ::shm_unlink(probe.c_str());
  return true;
}

#define NEED_SHM() \
  if (!shm_usable()) GTEST_SKIP() << "no POSIX shared memory here (/dev/shm)";

}  // namespace

// For two members every result is bitwise the Gloo path's: sums (float32,
// float64, in pieces larger than a slot too), 16-bit sums, maxima and a
// broadcast.
TEST(Shm, TwoMembersGetTheGlooPathsBitsForEveryCollective) {
  NEED_SHM();
  const int world = 2;
  with_members(world, true, "bits", [&](int r, comm::Collective& shm, comm::Collective* gloo) {
    for (int64_t n : {int64_t{1}, int64_t{1000}, int64_t{3} << 20}) {  // 3M floats: two slots' worth
      SCOPED_TRACE(n);
      auto a = member_values(r, n, torch::kFloat32), b = a.clone();
      shm.allreduce_sum(a);
      gloo->allreduce_sum(b);
      EXPECT_TRUE(torch::equal(a, b));
      auto sum_ref = member_values(0, n, torch::kFloat32) + member_values(1, n, torch::kFloat32);
      EXPECT_TRUE(torch::equal(a, sum_ref));
    }
    for (auto type : {torch::kBFloat16, torch::kHalf}) {
      auto a = member_values(r, 4099, type), b = a.clone();
      shm.allreduce_sum_16(a);
      gloo->allreduce_sum_16(b);
      EXPECT_TRUE(torch::equal(a, b)) << type;
    }
    auto d = member_values(r, 7, torch::kFloat64), e = d.clone();
    shm.allreduce_sum(d);
    gloo->allreduce_sum(e);
    EXPECT_TRUE(torch::equal(d, e));
    auto m = member_values(r, 513, torch::kInt64), n = m.clone();
    shm.allreduce_max(m);
    gloo->allreduce_max(n);
    EXPECT_TRUE(torch::equal(m, n));
    auto w = member_values(r, 100003, torch::kFloat32), v = w.clone();
    shm.broadcast(w, 1);
    gloo->broadcast(v, 1);
    EXPECT_TRUE(torch::equal(w, v));
    EXPECT_TRUE(torch::equal(w, member_values(1, 100003, torch::kFloat32)));
  });
}

// With more members the sum runs in member order, ((a0 + a1) + a2) + a3,
// on every member alike, whichever member reduces which elements.
// Reduce-scatter and all-gather (sharded optimizer state): each member's
// shard of the reduce-scatter holds the all-reduce's bits, on both
// transports, for 2 and 3 members, uneven and empty shards, and tensors of
// several slots; the all-gather puts every member's shard everywhere.
TEST(Shm, ReduceScatterKeepsTheAllReducesBitsAndAllGatherAssembles) {
  NEED_SHM();
  for (int world : {2, 3}) {
    SCOPED_TRACE(world);
    with_members(world, true, "rs" + std::to_string(world), [&](int r, comm::Collective& shm, comm::Collective* gloo) {
      for (int64_t n : {int64_t{1000}, int64_t{5} << 20}) {  // 5M floats: several slots' worth
        SCOPED_TRACE(n);
        std::vector<std::vector<int64_t>> layouts = {{0}, {0}};
        for (int k = 1; k <= world; ++k) layouts[0].push_back(n * k / world);  // even
        for (int k = 1; k < world; ++k) layouts[1].push_back(k == 1 ? 0 : n / 3);  // an empty first shard
        layouts[1].push_back(n);
        for (const auto& bounds : layouts)
          for (comm::Collective* g : {&shm, gloo}) {
            auto ref = member_values(r, n, torch::kFloat32), x = ref.clone();
            g->allreduce_sum(ref);
            g->reduce_scatter_sum(x, bounds);
            const int64_t lo = bounds[r], hi = bounds[r + 1];
            EXPECT_TRUE(torch::equal(x.narrow(0, lo, hi - lo), ref.narrow(0, lo, hi - lo))) << g->transport();
            // All-gather: everyone's shard of the sum, others' places garbage.
            auto y = torch::full({n}, 7.0f);
            y.narrow(0, lo, hi - lo).copy_(ref.narrow(0, lo, hi - lo));
            g->all_gather(y, bounds);
            EXPECT_TRUE(torch::equal(y, ref)) << g->transport();
          }
      }
      auto bad = torch::zeros({10});
      EXPECT_THROW(shm.all_gather(bad, {0, 5}), Error);
    });
  }
}

TEST(Shm, SumsRunInMemberOrderOnEveryMember) {
  NEED_SHM();
  const int world = 4;
  const int64_t n = 10007;
  auto want = member_values(0, n, torch::kFloat32);
  for (int r = 1; r < world; ++r) want = want + member_values(r, n, torch::kFloat32);
  with_members(world, false, "order", [&](int r, comm::Collective& shm, comm::Collective*) {
    auto a = member_values(r, n, torch::kFloat32);
    shm.allreduce_sum(a);
    EXPECT_TRUE(torch::equal(a, want)) << "member " << r;
  });
}

// abort() from another thread (the heartbeat thread) ends a collective
// blocked waiting for a member that does not come, at once; the segment's
// flag fails that member's next collective too.
TEST(Shm, AbortEndsABlockedCollectiveOnEveryMember) {
  NEED_SHM();
  with_members(2, false, "abort", [&](int r, comm::Collective& shm, comm::Collective*) {
    if (r == 0) {
      std::thread heartbeat([&] {
        std::this_thread::sleep_for(std::chrono::milliseconds(200));
        shm.abort();
      });
      auto t = torch::ones({1000});
      const auto t0 = Clock::now();
      EXPECT_THROW(shm.allreduce_sum(t), PeerFailure);
      EXPECT_LT(seconds_since(t0), 1.5);
      heartbeat.join();
    } else {
      std::this_thread::sleep_for(std::chrono::milliseconds(600));  // a stopped member
      auto t = torch::ones({1000});
      EXPECT_THROW(shm.allreduce_sum(t), PeerFailure);
    }
  });
}

// A member whose process is gone fails the others' collective within a
// fraction of a second (its pid is checked while they wait): a child
// process joins the group and exits without taking part.
TEST(Shm, AMemberWhoseProcessIsGoneFailsTheOthersAtOnce) {
  NEED_SHM();
  comm::StoreServer store("127.0.0.1", 0);
  comm::GroupOptions go;
  go.store_port = store.port();
  go.timeout = std::chrono::milliseconds(20000);
  go.prefix = "gone";
  const pid_t child = ::fork();
  if (child == 0) {
    // Joins (formation only: store client and mapping, no torch), then dies.
    try {
      auto g = comm::make_shm_group(go, 1, 2);
      ::_exit(g ? 0 : 3);
    } catch (...) {
      ::_exit(4);
    }
  }
  ASSERT_GT(child, 0);
  auto g = comm::make_shm_group(go, 0, 2);
  ASSERT_TRUE(g);
  int status = 0;
  ASSERT_EQ(::waitpid(child, &status, 0), child);
  EXPECT_EQ(WEXITSTATUS(status), 0);
  auto t = torch::ones({64});
  const auto t0 = Clock::now();
  try {
    g->allreduce_sum(t);
    ADD_FAILURE() << "the collective went through without its other member";
  } catch (const PeerFailure& e) {
    EXPECT_NE(std::string(e.what()).find("is gone"), std::string::npos) << e.what();
  }
  EXPECT_LT(seconds_since(t0), 1.0);
}

// Found by a sharded-state SIGKILL test under load: a member waiting in a
// barrier that the other completed, and that was then descheduled while the
// other finished, committed its step and died, woke to find its peer gone
// and failed the collective that had completed. Member 0 is stopped while it
// waits; member 1 completes the barrier and exits; member 0, continued,
// must see its broadcast done.
TEST(Shm, ABarrierThatCompletedIsNotFailedByAMemberGoneRightAfter) {
  NEED_SHM();
  comm::StoreServer store("127.0.0.1", 0);
  comm::GroupOptions go;
  go.store_port = store.port();
  go.timeout = std::chrono::milliseconds(20000);
  go.prefix = "completed";
  auto t = torch::ones({64});  // made before fork: the members run no torch operation
  int entering[2], proceed[2];
  ASSERT_EQ(::pipe(entering), 0);
  ASSERT_EQ(::pipe(proceed), 0);
  const pid_t a = ::fork();
  if (a == 0) {
    try {
      auto g = comm::make_shm_group(go, 0, 2);
      char c = 'x';
      if (!g || ::write(entering[1], &c, 1) != 1) ::_exit(3);
      g->broadcast(t, 0);
      ::_exit(0);
    } catch (const PeerFailure&) {
      ::_exit(1);
    } catch (...) {
      ::_exit(2);
    }
  }
  ASSERT_GT(a, 0);
  const pid_t b = ::fork();
  if (b == 0) {
    try {
      auto g = comm::make_shm_group(go, 1, 2);
      char c;
      if (!g || ::read(proceed[0], &c, 1) != 1) ::_exit(3);
      g->broadcast(t, 0);
      ::_exit(0);
    } catch (...) {
      ::_exit(4);
    }
  }
  ASSERT_GT(b, 0);
  char c;
  ASSERT_EQ(::read(entering[0], &c, 1), 1);
  std::this_thread::sleep_for(std::chrono::milliseconds(300));  // member 0 waits in the barrier
  ASSERT_EQ(::kill(a, SIGSTOP), 0);
  c = 'y';
  ASSERT_EQ(::write(proceed[1], &c, 1), 1);
  int status = 0;
  ASSERT_EQ(::waitpid(b, &status, 0), b);  // member 1 completed the barrier and is gone
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << status;
  ASSERT_EQ(::kill(a, SIGCONT), 0);
  ASSERT_EQ(::waitpid(a, &status, 0), a);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0)
      << "member 0's completed broadcast failed (exit " << WEXITSTATUS(status) << ")";
  for (int fd : {entering[0], entering[1], proceed[0], proceed[1]}) ::close(fd);
}

// A segment's name is removed as soon as every member has it mapped; names
// left by creators that are gone are removed by remove_stale_segments(),
// those of running processes stay.
TEST(Shm, NoSegmentNameOutlivesFormationAndStaleOnesAreRemoved) {
  NEED_SHM();
  with_members(3, false, "names", [&](int r, comm::Collective& shm, comm::Collective*) {
    auto t = torch::ones({10});
    shm.allreduce_sum(t);
    EXPECT_EQ(t[0].item<float>(), 3.0f);
  });
  EXPECT_TRUE(segment_names_of(::getpid()).empty());
  const pid_t dead = ::fork();
  if (dead == 0) ::_exit(0);
  ::waitpid(dead, nullptr, 0);
  const std::string stale = "/" + comm::segment_prefix(dead) + "test";
  const std::string live = "/" + comm::segment_prefix(::getpid()) + "test";
  // Found: a launcher in another pid namespace that shares /dev/shm (a
  // container beside this one) sees no process with this pid and removed
  // the name of a segment still forming. Names from another pid namespace
  // are not this launcher's to judge.
  const std::string foreign = "/limbo-shm-" + std::to_string(dead) + "-ns1-test";
  for (const auto& n : {stale, live, foreign}) {
    const int fd = ::shm_open(n.c_str(), O_CREAT | O_RDWR, 0600);
    ASSERT_GE(fd, 0);
    ::close(fd);
  }
  EXPECT_GE(comm::remove_stale_segments(), 1);
  const auto left = segment_names_of(dead);
  EXPECT_EQ(left, std::vector<std::string>{foreign.substr(1)});
  EXPECT_EQ(segment_names_of(::getpid()).size(), 1u);
  ::shm_unlink(live.c_str());
  ::shm_unlink(foreign.c_str());
}

// Members in different pid namespaces (containers that share the network,
// mounts and IPC) cannot see each other's pids, so a live peer would look
// gone: they are different hosts to the group (Gloo between them).
TEST(Shm, AProcessInAnotherPidNamespaceIsAnotherHost) {
  if (::geteuid() != 0) GTEST_SKIP() << "needs root (unshare)";
  const auto other = limbo::testing::in_new_pid_namespace([] { return comm::host_identity(); });
  ASSERT_TRUE(other.has_value()) << "no pid namespace could be made";
  EXPECT_NE(*other, comm::host_identity());
}

// make_group(): members that share this host form a shared-memory group;
// with shared_memory off they form a Gloo group.
TEST(Shm, MakeGroupPicksSharedMemoryOnOneHost) {
  NEED_SHM();
  comm::StoreServer store("127.0.0.1", 0);
  for (bool shared : {true, false}) {
    std::vector<std::thread> threads;
    std::vector<std::string> kinds(2);
    for (int r = 0; r < 2; ++r)
      threads.emplace_back([&, r] {
        comm::GroupOptions go;
        go.store_port = store.port();
        go.prefix = shared ? "pick-shm" : "pick-gloo";
        go.shared_memory = shared;
        auto g = comm::make_group(go, r, 2);
        auto t = torch::full({5}, static_cast<float>(r + 1));
        g->allreduce_sum(t);
        kinds[r] = g->transport() + std::string(t[0].item<float>() == 3.0f ? "" : " (wrong sum)");
      });
    for (auto& t : threads) t.join();
    for (const auto& k : kinds) EXPECT_EQ(k, shared ? "shared-memory" : "gloo");
  }
}

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  at::set_num_threads(1);
  return RUN_ALL_TESTS();
}
