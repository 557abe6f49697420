#include "optim/batch_policy.h"

#include <algorithm>
#include <cmath>

#include "common/error.h"

namespace limbo::optim {

BatchSizePolicy::BatchSizePolicy(BatchPolicyOptions opt) : opt_(opt) {
  if (opt_.reference_batch < 0) throw InvalidInput("elastic.reference_batch must be >= 0");
  if (opt_.ramp_iterations < 0) throw InvalidInput("elastic.ramp_iterations must be >= 0");
  reference_ = opt_.reference_batch;
}

double BatchSizePolicy::target(int64_t global_batch) const {
  return static_cast<double>(global_batch) / static_cast<double>(reference_);
}

double BatchSizePolicy::scaled(double kappa) const {
  return opt_.rule == ScalingRule::Sqrt ? std::sqrt(kappa) : kappa;
}

double BatchSizePolicy::ramp_value(int64_t iteration) const {
  if (opt_.ramp_iterations == 0) return to_;
  double f = std::min(1.0, static_cast<double>(iteration - ramp_start_) / opt_.ramp_iterations);
  return from_ + (to_ - from_) * f;
}

BatchSizePolicy::Step BatchSizePolicy::step(int64_t iteration, int64_t global_batch) {
  if (global_batch <= 0) throw InvalidInput("global batch must be positive");
  Step s;
  if (last_batch_ == 0) {  // first step (or first after a fresh start)
    if (reference_ == 0) reference_ = global_batch;
    last_batch_ = global_batch;
    from_ = to_ = current_ = target(global_batch);
    ramp_start_ = iteration;
  } else if (global_batch != last_batch_) {
    s.changed = true;
    const bool grows = global_batch > last_batch_;
    const double before = current_;
    last_batch_ = global_batch;
    switch (opt_.kind) {
      case BatchPolicyKind::None:
        break;  // keep the multiplier
      case BatchPolicyKind::Linear:
        from_ = to_ = current_ = target(global_batch);
        break;
      case BatchPolicyKind::Dynamic:
        from_ = current_;
        to_ = target(global_batch);
        ramp_start_ = iteration;
        // A shrink never raises the rate: to a lower target it drops at once
        // (or ramps down with ramp_down); a target still above the current
        // multiplier (a shrink during an unfinished ramp up) is approached
        // gradually from where the multiplier is.
        if (!grows && !opt_.ramp_down && to_ < current_) from_ = to_;
        break;
    }
    if (opt_.kind != BatchPolicyKind::Dynamic) current_ = to_;
    else current_ = ramp_value(iteration);
    switch (opt_.momentum) {
      case MomentumOnChange::Keep: break;
      case MomentumOnChange::Reset: s.momentum_factor = 0.0; break;
      case MomentumOnChange::Rescale: s.momentum_factor = scaled(before) / scaled(current_); break;
    }
  }
  if (opt_.kind == BatchPolicyKind::Dynamic) current_ = ramp_value(iteration);
  s.kappa = current_;
  s.multiplier = scaled(current_);
  return s;
}

torch::Tensor BatchSizePolicy::state() const {
  return torch::tensor({static_cast<double>(reference_), static_cast<double>(last_batch_), from_,
                        to_, current_, static_cast<double>(ramp_start_)},
                       torch::kFloat64);
}

void BatchSizePolicy::load_state(const torch::Tensor& t) {
  auto c = t.contiguous().to(torch::kFloat64);
  if (c.numel() != 6) throw InvalidInput("checkpoint: batch-size policy state has the wrong size");
  const double* p = c.data_ptr<double>();
  reference_ = static_cast<int64_t>(p[0]);
  last_batch_ = static_cast<int64_t>(p[1]);
  from_ = p[2];
  to_ = p[3];
  current_ = p[4];
  ramp_start_ = static_cast<int64_t>(p[5]);
}

BatchPolicyKind parse_batch_policy(const std::string& s) {
  if (s == "none") return BatchPolicyKind::None;
  if (s == "linear") return BatchPolicyKind::Linear;
  if (s == "dynamic") return BatchPolicyKind::Dynamic;
  throw InvalidInput("elastic.batch_policy must be none, linear or dynamic, got '" + s + "'");
}

ScalingRule parse_scaling_rule(const std::string& s, const std::string& algorithm) {
  if (s == "linear") return ScalingRule::Linear;
  if (s == "sqrt") return ScalingRule::Sqrt;
  if (s == "auto") return algorithm == "adam" || algorithm == "adamw" ? ScalingRule::Sqrt : ScalingRule::Linear;
  throw InvalidInput("elastic.scaling must be auto, linear or sqrt, got '" + s + "'");
}

MomentumOnChange parse_momentum_on_change(const std::string& s) {
  if (s == "keep") return MomentumOnChange::Keep;
  if (s == "reset") return MomentumOnChange::Reset;
  if (s == "rescale") return MomentumOnChange::Rescale;
  throw InvalidInput("elastic.momentum must be keep, reset or rescale, got '" + s + "'");
}

}  // namespace limbo::optim
