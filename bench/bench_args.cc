#include "bench_args.h"

#include <cstdio>
#include <cstdlib>
#include <sstream>

namespace limbo::bench {

BenchArgs::BenchArgs(int argc, char** argv, std::string usage, const std::vector<std::string>& flags)
    : program_(argc > 0 ? argv[0] : "benchmark"), usage_(std::move(usage)) {
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--help" || a == "-h") {
      std::printf("usage: %s %s\n", program_.c_str(), usage_.c_str());
      std::exit(0);
    }
    bool known = false;
    for (const auto& f : flags) known = known || f == a;
    if (!known) fail("unknown argument '" + a + "'");
    if (i + 1 >= argc) fail(a + " needs a value");
    values_[a] = argv[++i];
  }
}

void BenchArgs::fail(const std::string& why) const {
  std::fprintf(stderr, "%s: %s\nusage: %s %s\n", program_.c_str(), why.c_str(), program_.c_str(), usage_.c_str());
  std::exit(2);
}

std::string BenchArgs::text(const std::string& flag, const std::string& fallback) const {
  auto it = values_.find(flag);
  return it == values_.end() ? fallback : it->second;
}

double BenchArgs::number(const std::string& flag, double fallback) const {
  auto it = values_.find(flag);
  if (it == values_.end()) return fallback;
  try {
    size_t used = 0;
    const double v = std::stod(it->second, &used);
    if (used == it->second.size()) return v;
  } catch (const std::exception&) {
  }
  fail(flag + " takes a number, got '" + it->second + "'");
}

int64_t BenchArgs::integer(const std::string& flag, int64_t fallback) const {
  const double v = number(flag, static_cast<double>(fallback));
  if (v != static_cast<double>(static_cast<int64_t>(v))) fail(flag + " takes a whole number, got '" + text(flag, "") + "'");
  return static_cast<int64_t>(v);
}

std::vector<double> BenchArgs::numbers(const std::string& flag, const std::vector<double>& fallback) const {
  auto it = values_.find(flag);
  if (it == values_.end()) return fallback;
  std::vector<double> out;
  std::stringstream ss(it->second);
  for (std::string item; std::getline(ss, item, ',');) {
    try {
      size_t used = 0;
      out.push_back(std::stod(item, &used));
      if (used != item.size()) throw std::invalid_argument(item);
    } catch (const std::exception&) {
      fail(flag + " takes numbers separated by commas, got '" + it->second + "'");
    }
  }
  if (out.empty()) fail(flag + " is empty");
  return out;
}

}  // namespace limbo::bench
