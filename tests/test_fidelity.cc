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

// Total variation distance between two staleness histograms.
double total_variation(const json& a, const json& b) {
  auto dist = [](const json& h) {
    std::map<int, double> p;
    double n = 0;
    for (auto& [t, c] : h.items()) n += c.get<double>();
    for (auto& [t, c] : h.items()) p[std::stoi(t)] = c.get<double>() / n;
    return p;
  };
  auto pa = dist(a), pb = dist(b);
  double tv = 0;
  for (int t = 0; t <= 64; ++t) tv += std::abs((pa.count(t) ? pa[t] : 0) - (pb.count(t) ? pb[t] : 0)) / 2;
  return tv;
}

// One real 2-learner job, and the simulator calibrated from it. Returns ""
// when they agree, else what differs.
std::string real_job_against_its_simulation(const TempDir& d, int attempt) {
  const std::string run = d.file("real" + std::to_string(attempt)), sim_dir = d.file("sim" + std::to_string(attempt));
  const std::vector<std::string> common = {"--set", "model.name=mlp", "--set", "model.width=1024", "--set", "data.batch_size=32",
                                           "--set", "data.train_limit=12000", "--set", "data.test_limit=2000",
                                           "--set", "train.epochs=1", "--set", "optim.lr=0.03",
                                           "--set", "train.progress=false"};
  auto r = limbo::testing::run_limbo(cat({"launch", "--mode", "async", "--servers", "1", "--workers", "2",
                                          "--protocol", "softsync", "--softsync-n", "2", "--run-dir", run, "--"},
                                         common));
  if (r.exit_code != 0) return "the real job failed: " + r.output;
  auto real = read_json(run + "/summary.json");
  double compute = 0, wait = 0, compute_cv = 0, wait_cv = 0;
  for (const auto& l : real["learners"]) {
    const double k = static_cast<double>(real["learners"].size());
    compute += l["compute_seconds_per_step"].get<double>() / k;
    wait += l["wait_seconds_per_step"].get<double>() / k;
    compute_cv += l["compute_cv"].get<double>() / k;
    wait_cv += l["wait_cv"].get<double>() / k;
  }
  if (compute <= 0) return "the real learners report no compute time";
  // The simulated compute time carries the whole measured variability of a
  // real step (compute and wait, taken as independent); the network delay
  // is the mean wait.
  const double cv = std::hypot(compute_cv * compute, wait_cv * wait) / compute;
  auto s = limbo::testing::run_limbo(cat(
      {"sim", "--run-dir", sim_dir, "--set", "sim.learners=2", "--set", "ps.softsync_n=2", "--set",
       "sim.compute=normal", "--set", "sim.compute_cv=" + std::to_string(cv), "--set",
       "sim.compute_mean=" + std::to_string(compute), "--set", "sim.net_delay=" + std::to_string(wait / 2)},
      common));
  if (s.exit_code != 0) return "the simulation failed: " + s.output;
  auto sim = read_json(sim_dir + "/summary.json");
  const double tr = real["staleness_mean"], ts = sim["staleness_mean"];
  const double tv = total_variation(real["staleness_hist"], sim["staleness_hist"]);
  const double ar = real["test_accuracy"], as = sim["test_accuracy"];
  // One epoch of 12,000 samples: a single run's accuracy varies by about
  // +-3.5 points (0.746-0.816 real over 8 runs here), so two independent runs
  // differ by up to ~0.07; a simulator that trained wrongly would be far off.
  // Staleness: with the MLP at width 1024 (a step of some 4 ms; at the
  // default width a step took 1 ms and its measured variability, cv 1.2-2.5,
  // was mostly the machine's) the means agree within 0.03 and the total
  // variation between the real and the simulated histograms measured
  // 0.21-0.27 over 7 real runs; a wrong protocol model (hardsync's all-0,
  // or free-running learners) is 0.7 or more away.
  if (std::abs(ts - tr) <= 0.3 && tv < 0.35 && std::abs(as - ar) <= 0.08) return "";
  return "attempt " + std::to_string(attempt) + ": staleness mean real " + std::to_string(tr) + " sim " +
         std::to_string(ts) + " (bound 0.3), total variation " + std::to_string(tv) + " (bound 0.35), accuracy real " +
         std::to_string(ar) + " sim " + std::to_string(as) + " (bound 0.08); real " + real["staleness_hist"].dump() +
         " sim " + sim["staleness_hist"].dump() + "; simulated compute cv " + std::to_string(cv);
}

// The simulator, calibrated with the real learners' measured compute and
// wait times (means and variability), reproduces a real 2-learner job's
// staleness distribution and accuracy. (With more runnable processes than
// this machine's 2 cores, OS scheduling bunches steps and the real
// distribution spreads out beyond what the simulator's compute-time models
// produce; see experiments/README.md.) Another process taking a core during
// the real job does the same, so a disagreeing attempt is repeated with a
// fresh real job, up to 3 attempts; every attempt's figures are reported.
TEST(Fidelity, SimulatorAgreesWithARealJob) {
  TempDir d;
  std::string report;
  for (int attempt = 1; attempt <= 3; ++attempt) {
    std::string why = real_job_against_its_simulation(d, attempt);
    if (why.empty()) return;
    report += why + "\n";
  }
  FAIL() << report;
}

}  // namespace
