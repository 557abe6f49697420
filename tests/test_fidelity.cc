// Simulator fidelity against a real job. Runs alone (RUN_SERIAL): it
// compares the staleness that real processes produce with the simulator's,
// which other tests running at the same time would distort.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <map>
#include <string>
#include <vector>

#include "common/files.h"
#include "test_util.h"

namespace {

using json = nlohmann::json;
using limbo::testing::TempDir;

json read_json(const std::string& path) { return json::parse(limbo::read_file(path)); }

std::vector<std::string> cat(std::vector<std::string> a, const std::vector<std::string>& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

// The simulator, calibrated with the real learners' measured compute and
// wait times, reproduces a real 2-learner job's staleness distribution and
// accuracy. (With more learners than this machine's 2 cores can run at once,
// OS scheduling bunches steps and the real distribution spreads out beyond
// what the simulator's compute-time models produce; see experiments/README.md.)
TEST(Fidelity, SimulatorAgreesWithARealJob) {
  TempDir d;
  const std::string run = d.file("real");
  const std::vector<std::string> common = {"--set", "model.name=mlp", "--set", "data.batch_size=32",
                                           "--set", "data.train_limit=12000", "--set", "data.test_limit=2000",
                                           "--set", "train.epochs=1", "--set", "optim.lr=0.03",
                                           "--set", "train.progress=false"};
  auto r = limbo::testing::run_limbo(cat({"launch", "--mode", "async", "--servers", "1", "--workers", "2",
                                          "--protocol", "softsync", "--softsync-n", "2", "--run-dir", run, "--"},
                                         common));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  auto real = read_json(run + "/summary.json");
  double compute = 0, wait = 0;
  for (const auto& l : real["learners"]) {
    compute += l["compute_seconds_per_step"].get<double>() / real["learners"].size();
    wait += l["wait_seconds_per_step"].get<double>() / real["learners"].size();
  }
  ASSERT_GT(compute, 0);
  auto s = limbo::testing::run_limbo(cat(
      {"sim", "--run-dir", d.file("sim"), "--set", "sim.learners=2", "--set", "ps.softsync_n=2", "--set",
       "sim.compute=normal", "--set", "sim.compute_cv=0.5", "--set", "sim.compute_mean=" + std::to_string(compute),
       "--set", "sim.net_delay=" + std::to_string(wait / 2)},
      common));
  ASSERT_EQ(s.exit_code, 0) << s.output;
  auto sim = read_json(d.file("sim/summary.json"));
  const double tr = real["staleness_mean"], ts = sim["staleness_mean"];
  EXPECT_NEAR(ts, tr, 0.3) << "real " << real["staleness_hist"] << " sim " << sim["staleness_hist"];
  // Total variation distance between the two staleness distributions.
  auto dist = [](const json& h) {
    std::map<int, double> p;
    double n = 0;
    for (auto& [t, c] : h.items()) n += c.get<double>();
    for (auto& [t, c] : h.items()) p[std::stoi(t)] = c.get<double>() / n;
    return p;
  };
  auto pr = dist(real["staleness_hist"]), ps = dist(sim["staleness_hist"]);
  double tv = 0;
  for (int t = 0; t <= 64; ++t) tv += std::abs((pr.count(t) ? pr[t] : 0) - (ps.count(t) ? ps[t] : 0)) / 2;
  EXPECT_LT(tv, 0.2) << "real " << real["staleness_hist"] << " sim " << sim["staleness_hist"];
  // One epoch of 12,000 samples: a single run's accuracy varies by about
  // +-3.5 points (0.746-0.816 real over 8 runs here), so two independent runs
  // differ by up to ~0.07; a simulator that trained wrongly would be far off.
  EXPECT_NEAR(sim["test_accuracy"].get<double>(), real["test_accuracy"].get<double>(), 0.08);
}

}  // namespace
