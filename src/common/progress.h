// Progress reporting for long work. On a terminal it redraws one status line
// (a bar with rate and ETA); otherwise it prints plain log lines at most every
// `log_interval`, so logs stay readable in files and CI.
#pragma once

#include <chrono>
#include <cstdio>
#include <string>

namespace limbo {

class Progress {
 public:
  // total = number of units (0 = unknown). `out` is usually stderr.
  Progress(std::string label, long total, std::FILE* out,
           std::chrono::milliseconds log_interval = std::chrono::seconds(10));
  // Reports that `done` units are complete; `text` is appended (e.g. loss).
  void update(long done, const std::string& text);
  // Ends the bar line (terminal) and prints a final line.
  void finish(const std::string& text);
  bool is_terminal() const { return tty_; }

 private:
  std::string label_;
  long total_;
  std::FILE* out_;
  bool tty_;
  std::chrono::milliseconds interval_;
  std::chrono::steady_clock::time_point start_, last_;
  bool drawn_ = false;
};

}  // namespace limbo
