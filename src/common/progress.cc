#include "common/progress.h"

#include <unistd.h>

#include <cstdio>

namespace limbo {

Progress::Progress(std::string label, long total, std::FILE* out,
                   std::chrono::milliseconds log_interval)
    : label_(std::move(label)),
      total_(total),
      out_(out),
      tty_(::isatty(::fileno(out)) != 0),
      interval_(log_interval),
      start_(std::chrono::steady_clock::now()),
      last_(start_) {}

void Progress::update(long done, const std::string& text) {
  auto now = std::chrono::steady_clock::now();
  // A terminal redraws ~10x/s; a log gets one line per interval.
  auto gap = tty_ ? std::chrono::milliseconds(100) : interval_;
  if (drawn_ && now - last_ < gap) return;
  last_ = now;
  drawn_ = true;
  double secs = std::chrono::duration<double>(now - start_).count();
  double rate = secs > 0 ? done / secs : 0.0;
  if (tty_) {
    const int width = 28;
    int filled = total_ > 0 ? static_cast<int>(width * done / total_) : 0;
    std::string bar(filled, '#');
    bar.resize(width, '.');
    double eta = (total_ > 0 && rate > 0) ? (total_ - done) / rate : 0;
    std::fprintf(out_, "\r%s [%s] %ld/%ld %.1f it/s eta %.0fs %s\x1b[K",
                 label_.c_str(), bar.c_str(), done, total_, rate, eta, text.c_str());
  } else {
    std::fprintf(out_, "%s %ld/%ld (%.1f it/s) %s\n", label_.c_str(), done,
                 total_, rate, text.c_str());
  }
  std::fflush(out_);
}

void Progress::finish(const std::string& text) {
  if (tty_ && drawn_) std::fputc('\n', out_);
  std::fprintf(out_, "%s done: %s\n", label_.c_str(), text.c_str());
  std::fflush(out_);
}

}  // namespace limbo
