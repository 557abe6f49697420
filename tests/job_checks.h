// Checks on the run directory of a data-parallel job, shared by the
// process tests (every sample used once per epoch, identical final weights).
#pragma once

#include <gtest/gtest.h>

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
