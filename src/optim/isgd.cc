#include "optim/isgd.h"

#include <algorithm>

#include "common/error.h"

namespace limbo::optim {

ControlWindow::ControlWindow(int64_t n) : n_(n) {
  if (n_ < 2) throw InvalidInput("ISGD control window needs at least 2 batches, got " +
                                 std::to_string(n_));
}

void ControlWindow::push(double v) {
  values_.push_back(v);
  sum_ += v;
  sumsq_ += v * v;
  if (static_cast<int64_t>(values_.size()) > n_) {
    double old = values_.front();
    values_.pop_front();
    sum_ -= old;
    sumsq_ -= old * old;
  }
  if (++since_recompute_ >= n_) {  // amortised O(1): one pass per n pushes
    since_recompute_ = 0;
    sum_ = sumsq_ = 0;
    for (double x : values_) sum_ += x, sumsq_ += x * x;
  }
}

double ControlWindow::mean() const {
  return values_.empty() ? NAN : sum_ / static_cast<double>(values_.size());
}

double ControlWindow::stddev() const {
  if (values_.empty()) return NAN;
  double m = mean();
  double var = sumsq_ / static_cast<double>(values_.size()) - m * m;
  return std::sqrt(std::max(var, 0.0));
}

IsgdController::IsgdController(IsgdOptions opt, int64_t batches_per_epoch)
    : opt_(opt), window_(opt.window > 0 ? opt.window : batches_per_epoch) {
  if (!(opt_.k >= 0)) throw InvalidInput("isgd.k must be >= 0");
  if (opt_.stop < 1) throw InvalidInput("isgd.stop must be >= 1");
  if (opt_.epsilon < 0 || opt_.zeta < 0) throw InvalidInput("isgd.epsilon and isgd.zeta must be >= 0");
}

IsgdController::Decision IsgdController::observe(double loss) {
  const bool checking = window_.full();  // full before this loss: past the first epoch
  window_.push(loss);
  Decision d;
  if (!checking) return d;
  d.limit = window_.limit(opt_.k);
  d.triggered = loss > d.limit;
  if (d.triggered) ++epoch_triggered_, ++total_triggered_;
  return d;
}

IsgdController::EpochStats IsgdController::end_epoch() {
  EpochStats s;
  s.triggered = epoch_triggered_;
  s.extra_iterations = epoch_extra_;
  s.mean = window_.mean();
  s.std = window_.stddev();
  s.limit = window_.full() ? window_.limit(opt_.k) : NAN;
  epoch_triggered_ = epoch_extra_ = 0;
  return s;
}

torch::Tensor IsgdController::state() const {
  // [total_triggered, total_extra, epoch_triggered, epoch_extra, values...]
  std::vector<double> v = {static_cast<double>(total_triggered_), static_cast<double>(total_extra_),
                           static_cast<double>(epoch_triggered_), static_cast<double>(epoch_extra_)};
  v.insert(v.end(), window_.values().begin(), window_.values().end());
  return torch::tensor(v, torch::kFloat64);
}

void IsgdController::load_state(const torch::Tensor& t) {
  auto c = t.contiguous().to(torch::kFloat64);
  const double* p = c.data_ptr<double>();
  int64_t n = c.numel();
  if (n < 4 || (n - 4 > window_.capacity() && opt_.window > 0))
    throw InvalidInput("checkpoint: ISGD state does not fit a window of " +
                       std::to_string(window_.capacity()) + " batches");
  total_triggered_ = static_cast<int64_t>(p[0]);
  total_extra_ = static_cast<int64_t>(p[1]);
  epoch_triggered_ = static_cast<int64_t>(p[2]);
  epoch_extra_ = static_cast<int64_t>(p[3]);
  window_ = ControlWindow(std::max(window_.capacity(), n - 4));
  for (int64_t i = 4; i < n; ++i) window_.push(p[i]);
}

void IsgdController::set_batches_per_epoch(int64_t n) {
  if (opt_.window > 0) return;
  n = std::max<int64_t>(n, 2);
  if (n == window_.capacity()) return;
  ControlWindow w(n);
  const auto& v = window_.values();
  const int64_t keep = std::min<int64_t>(n, static_cast<int64_t>(v.size()));
  for (auto it = v.end() - keep; it != v.end(); ++it) w.push(*it);
  window_ = std::move(w);
}

void isgd_phi_grad(torch::Tensor& out, const torch::Tensor& w, const torch::Tensor& grad,
                   double psi, double limit, const torch::Tensor& anchor, double eps) {
  const double nw = static_cast<double>(w.numel());
  torch::NoGradGuard g;
  torch::mul_out(out, grad, psi - limit);
  out.add_(w, eps / nw).sub_(anchor, eps / nw);
}

void isgd_plain_step(torch::Tensor& w, const torch::Tensor& grad, double psi, double limit,
                     const torch::Tensor& anchor, double eps, double zeta) {
  const double nw = static_cast<double>(w.numel());
  torch::NoGradGuard g;
  // w - zeta*(eps/nw)*(w - anchor) - zeta*(psi-limit)*grad, without temporaries.
  const double a = zeta * eps / nw;
  w.mul_(1.0 - a).add_(anchor, a).add_(grad, -zeta * (psi - limit));
}

IsgdAnchor parse_anchor(const std::string& s) {
  if (s == "before") return IsgdAnchor::BeforeUpdate;
  if (s == "after") return IsgdAnchor::AfterUpdate;
  throw InvalidInput("isgd.anchor must be 'before' or 'after', got '" + s + "'");
}

IsgdMomentum parse_isgd_momentum(const std::string& s) {
  if (s == "untouched") return IsgdMomentum::Untouched;
  if (s == "shared") return IsgdMomentum::Shared;
  throw InvalidInput("isgd.momentum must be 'untouched' or 'shared', got '" + s + "'");
}

}  // namespace limbo::optim
