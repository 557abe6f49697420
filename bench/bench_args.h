// Command-line flags of the C++ benchmarks: every flag takes one value,
// `--help` prints the usage. A flag that is unknown, has no value, or whose
// value is not a number where one is needed prints the usage to stderr and
// ends the program with exit code 2, before any benchmark runs.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace limbo::bench {

class BenchArgs {
 public:
  // `usage` is the line after "usage: <program> "; `flags` are the known ones.
  BenchArgs(int argc, char** argv, std::string usage, const std::vector<std::string>& flags);
  std::string text(const std::string& flag, const std::string& fallback) const;
  double number(const std::string& flag, double fallback) const;
  int64_t integer(const std::string& flag, int64_t fallback) const;
  // A comma-separated list of numbers.
  std::vector<double> numbers(const std::string& flag, const std::vector<double>& fallback) const;

 private:
  [[noreturn]] void fail(const std::string& why) const;
  std::string program_, usage_;
  std::map<std::string, std::string> values_;
};

}  // namespace limbo::bench
