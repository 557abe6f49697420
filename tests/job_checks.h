// Checks on the run directory of a data-parallel job, shared by the
// process tests (every sample used once per epoch, identical final weights).
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <filesystem>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include "test_util.h"

namespace limbo::testing {

// Every sample id appears exactly once in every epoch of the committed
// steps. Members log each step they commit; a step committed by several
// members must carry the same samples everywhere.
// `dirs`: the run directories the members wrote to (one per host, or one).
inline void expect_exactly_once(const std::vector<std::string>& dirs, int epochs, int n) {
  std::map<int64_t, std::string> steps;  // step -> "epoch ids..."
  for (const auto& dir : dirs) {
    for (const auto& f : std::filesystem::directory_iterator(dir)) {
      if (f.path().filename().string().rfind("samples-", 0) != 0) continue;
      // A member killed while it wrote (a whole node lost) leaves its last
      // line cut short: only whole lines count (the members that committed
      // the step with it logged it whole).
      std::string text = slurp(f.path());
      text.erase(text.find_last_of('\n') == std::string::npos ? 0 : text.find_last_of('\n') + 1);
      std::istringstream in(text);
      for (std::string line; std::getline(in, line);) {
        auto sp = line.find(' ');
        int64_t step = std::stoll(line.substr(0, sp));
        auto [it, fresh] = steps.emplace(step, line.substr(sp + 1));
        if (!fresh) {
          EXPECT_EQ(it->second, line.substr(sp + 1)) << "step " << step << " differs";
        }
      }
    }
  }
  std::map<std::pair<int, int>, int> count;
  for (const auto& [step, rest] : steps) {
    std::istringstream ls(rest);
    int e, id;
    ls >> e;
    while (ls >> id) count[{e, id}]++;
  }
  EXPECT_EQ(static_cast<int>(count.size()), epochs * n);
  int dup = 0;
  for (const auto& [k, c] : count) dup += c != 1;
  EXPECT_EQ(dup, 0) << "samples used more than once";
  EXPECT_EQ(steps.rbegin()->first, static_cast<int64_t>(steps.size())) << "a step is missing";
  // DiLoCo's members also log what their inner steps really trained for
  // each outer step they committed (trained-PID.txt): together, exactly
  // the step's committed samples (a sample trained twice, or dealt and
  // never trained, shows here, where the plan's log cannot show it).
  std::map<int64_t, std::vector<int64_t>> trained;
  bool any = false;
  for (const auto& dir : dirs)
    for (const auto& f : std::filesystem::directory_iterator(dir)) {
      if (f.path().filename().string().rfind("trained-", 0) != 0) continue;
      any = true;
      std::string text = slurp(f.path());
      text.erase(text.find_last_of('\n') == std::string::npos ? 0 : text.find_last_of('\n') + 1);
      std::istringstream in(text);
      for (std::string line; std::getline(in, line);) {
        std::istringstream ls(line);
        int64_t step, epoch, id;
        ls >> step >> epoch;
        auto& ids = trained[step];
        while (ls >> id) ids.push_back(id);
      }
    }
  if (!any) return;
  for (const auto& [step, rest] : steps) {
    std::istringstream ls(rest);
    int64_t e, id;
    ls >> e;
    std::vector<int64_t> committed;
    while (ls >> id) committed.push_back(id);
    std::sort(committed.begin(), committed.end());
    auto got = trained[step];
    std::sort(got.begin(), got.end());
    EXPECT_EQ(got, committed) << "step " << step << ": the samples its members trained are not the ones it committed";
  }
}

inline void expect_exactly_once(const std::string& dir, int epochs, int n) {
  expect_exactly_once(std::vector<std::string>{dir}, epochs, n);
}

// The final-weight fingerprints of every member that finished agree.
inline void expect_identical_finals(const std::string& dir, size_t members) {
  std::vector<std::string> finals;
  for (const auto& e : std::filesystem::directory_iterator(dir))
    if (e.path().filename().string().rfind("final-", 0) == 0) finals.push_back(slurp(e.path()));
  ASSERT_EQ(finals.size(), members);
  for (const auto& f : finals) EXPECT_EQ(f, finals[0]);
}

}  // namespace limbo::testing
