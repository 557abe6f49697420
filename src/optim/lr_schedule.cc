#include "optim/lr_schedule.h"

#include <cmath>
#include <sstream>

#include "common/error.h"

namespace limbo::optim {

LrSchedule::LrSchedule(LrScheduleOptions opt) : opt_(std::move(opt)) {
  const auto& k = opt_.kind;
  if (k != "constant" && k != "step" && k != "multistep" && k != "cosine" && k != "inv")
    throw InvalidInput("unknown learning-rate schedule '" + k +
                       "'; allowed: constant, step, multistep, cosine, inv");
  if (!(opt_.base_lr > 0)) throw InvalidInput("base learning rate must be > 0");
  if (k == "step" && !(opt_.step_epochs > 0))
    throw InvalidInput("step schedule needs step_epochs > 0");
  if (k == "multistep" && opt_.milestones.empty())
    throw InvalidInput("multistep schedule needs at least one milestone");
  if (k == "cosine" && !(opt_.cosine_epochs > 0))
    throw InvalidInput("cosine schedule needs a positive horizon (epochs)");
}

double LrSchedule::lr(double epoch, int64_t iteration) const {
  const auto& o = opt_;
  double lr = o.base_lr;
  if (o.kind == "step") {
    lr *= std::pow(o.gamma, std::floor(epoch / o.step_epochs));
  } else if (o.kind == "multistep") {
    int passed = 0;
    for (double m : o.milestones) passed += epoch >= m ? 1 : 0;
    lr *= std::pow(o.gamma, passed);
  } else if (o.kind == "cosine") {
    double t = std::min(epoch, o.cosine_epochs) / o.cosine_epochs;
    lr = o.min_lr + (o.base_lr - o.min_lr) * 0.5 * (1.0 + std::cos(M_PI * t));
  } else if (o.kind == "inv") {
    lr *= std::pow(1.0 + o.inv_gamma * static_cast<double>(iteration), -o.inv_power);
  }
  if (o.warmup_epochs > 0 && epoch < o.warmup_epochs) {
    double f = o.warmup_start_factor + (1.0 - o.warmup_start_factor) * (epoch / o.warmup_epochs);
    lr *= f;
  }
  return lr;
}

std::vector<double> parse_milestones(const std::string& text, const std::string& key) {
  std::vector<double> out;
  std::stringstream ss(text);
  std::string item;
  while (std::getline(ss, item, ',')) {
    if (item.empty()) continue;
    size_t pos = 0;
    double v = -1;
    try { v = std::stod(item, &pos); } catch (...) { pos = 0; }
    if (pos != item.size() || v < 0)
      throw InvalidInput("config key '" + key + "': '" + item +
                         "' is not a non-negative number (expected e.g. \"30,60,90\")");
    if (!out.empty() && v <= out.back())
      throw InvalidInput("config key '" + key + "': milestones must be strictly ascending, got '" +
                         text + "'");
    out.push_back(v);
  }
  return out;
}

}  // namespace limbo::optim
