// A GoogleTest helper shared by the reader tests.
#pragma once

#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "common/error.h"

namespace limbo::testing {

// Expects `f` to throw InvalidInput whose message contains every needle.
template <typename F>
void expect_invalid(F&& f, const std::vector<std::string>& needles) {
  try {
    f();
    FAIL() << "expected InvalidInput";
  } catch (const InvalidInput& e) {
    std::string msg = e.what();
    for (const auto& n : needles) EXPECT_NE(msg.find(n), std::string::npos) << msg;
  }
}

}  // namespace limbo::testing
