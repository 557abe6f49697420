// Learning-rate schedules.
//
// A schedule maps training progress to a learning rate. Progress is given both
// as fractional epochs (samples seen / dataset size) and as the iteration
// count: epoch-based rules (step, multistep, cosine, warm-up) stay correct when
// the batch size changes during training (elastic runs), and Caffe's `inv`
// rule is defined per iteration.
//
//   constant   lr = base
//   step       lr = base * gamma ^ floor(epoch / step_epochs)
//   multistep  lr = base * gamma ^ (number of milestones <= epoch)
//   cosine     lr = min + (base - min) * (1 + cos(pi * min(epoch, T) / T)) / 2
//   inv        lr = base * (1 + inv_gamma * iter) ^ (-inv_power)
// Linear warm-up (any kind): over the first warmup_epochs the rate rises
// linearly from warmup_start_factor * lr(...) to lr(...).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace limbo::optim {

struct LrScheduleOptions {
  std::string kind = "constant";  // constant | step | multistep | cosine | inv
  double base_lr = 0.01;
  double gamma = 0.1;
  double step_epochs = 1.0;
  std::vector<double> milestones;  // epochs, ascending
  double cosine_epochs = 1.0;      // T
  double min_lr = 0.0;
  double inv_gamma = 1e-4;
  double inv_power = 0.75;
  double warmup_epochs = 0.0;
  double warmup_start_factor = 0.1;
};

class LrSchedule {
 public:
  explicit LrSchedule(LrScheduleOptions opt);  // throws InvalidInput
  double lr(double epoch, int64_t iteration) const;
  const LrScheduleOptions& options() const { return opt_; }

 private:
  LrScheduleOptions opt_;
};

// Parses "30,60,90" (ascending, non-negative); throws InvalidInput naming `key`.
std::vector<double> parse_milestones(const std::string& text, const std::string& key);

}  // namespace limbo::optim
