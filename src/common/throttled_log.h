// A warning that a flood of events must not turn into a flood of lines.
#pragma once

#include <chrono>
#include <string>

namespace limbo {

// Warns at most once a second for one kind of event, saying how many lines
// it left out since the last one (a flood must not flood the log). Not
// thread-safe: one per thread or per owner.
class ThrottledLog {
 public:
  explicit ThrottledLog(std::string prefix = "") : prefix_(std::move(prefix)) {}
  void warn(const std::string& what);

 private:
  std::string prefix_;
  std::chrono::steady_clock::time_point last_{};
  size_t skipped_ = 0;
};

}  // namespace limbo
