// Two hosts of two workers each, in network namespaces (tests/netns.h):
// the hierarchical all-reduce (comm/hier_group.h) trains to the same bits
// as one flat Gloo group, and when a worker is killed or frozen on either
// host the others re-form at once and finish. Needs root and iproute2;
// skipped otherwise.
#include <gtest/gtest.h>
#include <signal.h>

#include <filesystem>
#include <map>
#include <regex>
#include <set>
#include <thread>

#include "host_job.h"
#include "job_checks.h"
#include "netns.h"
#include "test_util.h"

using limbo::testing::HostJob;
using limbo::testing::slurp;
using limbo::testing::VirtualHosts;
using namespace std::chrono_literals;

namespace {

class TwoByTwo : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!limbo::testing::have_fmnist()) GTEST_SKIP() << "dataset-fashion-mnist is not installed";
    hosts_ = std::make_unique<VirtualHosts>(2);
    if (!hosts_->ok()) GTEST_SKIP() << hosts_->why();
  }
  std::unique_ptr<VirtualHosts> hosts_;
};

// Host A's launcher and its two workers first (they take the first ids, so
// ranks 0 and 1), then host B's; the job starts with all four.
bool start(HostJob& job, int min_workers) {
  job.launch(0, 2, min_workers);
  std::this_thread::sleep_for(3s);
  job.launch(1, 2, min_workers);
  if (!job.training(4)) {
    ADD_FAILURE() << "four workers never trained together" << job.all_logs();
    return false;
  }
  return true;
}

// The ranks host h's workers reported for their rounds of `world` workers.
std::set<int> ranks_on(const HostJob& job, int h, int world) {
  std::set<int> out;
  const std::string log = slurp(job.log(h));
  const std::regex line(std::to_string(world) + " workers, rank ([0-9]+)");
  for (std::sregex_iterator it(log.begin(), log.end(), line), end; it != end; ++it) out.insert(std::stoi((*it)[1]));
  return out;
}

std::string one_final(const std::string& run) {
  for (const auto& e : std::filesystem::directory_iterator(run))
    if (e.path().filename().string().rfind("final-", 0) == 0) return slurp(e.path());
  return "";
}

}  // namespace

// The same job, hierarchical and flat: every member of each ends with the
// same weights, and the two jobs end with the same bits (with hosts holding
// ranks 0, 1 and 2, 3, both sum ((x0 + x1) + (x2 + x3))). Each worker logs
// which transport its round used.
TEST_F(TwoByTwo, HierarchicalAndFlatJobsEndWithTheSameBits) {
  std::map<bool, std::string> finals;
  for (bool hierarchical : {true, false}) {
    HostJob job{*hosts_, 2};
    job.train_limit = 2000;
    job.train_extra = {"--set", std::string("comm.hierarchical=") + (hierarchical ? "true" : "false")};
    ASSERT_TRUE(start(job, 4));
    job.wait_all();
    for (int h : {0, 1}) ASSERT_EQ(job.results[h].exit_code, 0) << job.all_logs();
    EXPECT_EQ(ranks_on(job, 0, 4), (std::set<int>{0, 1})) << job.all_logs();
    EXPECT_EQ(ranks_on(job, 1, 4), (std::set<int>{2, 3})) << job.all_logs();
    const std::string transport = hierarchical ? "hierarchical" : "gloo";
    for (int h : {0, 1})
      EXPECT_NE(slurp(job.log(h)).find("4 workers, rank " + std::to_string(2 * h) + ", " + transport), std::string::npos)
          << job.all_logs();
    limbo::testing::expect_identical_finals(job.run, 4);
    limbo::testing::expect_exactly_once(job.run, 2, 2000);
    finals[hierarchical] = one_final(job.run);
  }
  ASSERT_FALSE(finals[true].empty());
  EXPECT_EQ(finals[true], finals[false]);
}

// A worker SIGKILLed on host B, then one SIGSTOPped on host A: each time
// the others re-form at once, first as a hierarchical group of 2 + 1, then
// as a flat group of one worker per host, and the job finishes with every
// sample used once per epoch. (A launcher whose other worker goes on does
// not start a lost one again.)
TEST_F(TwoByTwo, AWorkerKilledOrFrozenOnEitherHostTheOthersReformAtOnce) {
  HostJob job{*hosts_, 8};
  ASSERT_TRUE(start(job, 2));
  std::this_thread::sleep_for(1s);

  auto b = job.workers(1);
  ASSERT_EQ(b.size(), 2u) << job.all_logs();
  double t0 = limbo::testing::wall_now();
  ::kill(b[0], SIGKILL);
  for (int i = 0; i < 200 && job.reformed_after(t0) < 0; ++i) std::this_thread::sleep_for(50ms);
  const double killed = job.reformed_after(t0);
  EXPECT_GT(killed, 0) << job.all_logs();
  EXPECT_LT(killed, 5) << "re-formed only after a timeout";
  std::this_thread::sleep_for(1s);

  auto a = job.workers(0);
  ASSERT_EQ(a.size(), 2u) << job.all_logs();
  t0 = limbo::testing::wall_now();
  ::kill(a[1], SIGSTOP);
  for (int i = 0; i < 200 && job.reformed_after(t0) < 0; ++i) std::this_thread::sleep_for(50ms);
  const double frozen = job.reformed_after(t0);
  EXPECT_GT(frozen, 0) << job.all_logs();
  EXPECT_LT(frozen, 5) << "re-formed only after a timeout";
  ::kill(a[1], SIGKILL);
  ::kill(a[1], SIGCONT);

  job.wait_all();
  for (int h : {0, 1}) EXPECT_EQ(job.results[h].exit_code, 0) << job.all_logs();
  const std::string logs = job.all_logs();
  EXPECT_NE(logs.find("4 workers, rank 0, hierarchical"), std::string::npos) << logs;
  EXPECT_NE(logs.find("3 workers, rank 0, hierarchical"), std::string::npos) << logs;
  EXPECT_NE(logs.find("2 workers, rank 0, gloo"), std::string::npos) << logs;
  limbo::testing::expect_exactly_once(job.run, 8, 3000);
  std::cout << "re-formed " << killed << " s after the kill, " << frozen << " s after the stop\n";
}
