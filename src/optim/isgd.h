// ISGD (Wang et al., "Accelerating Deep Neural Network Training with
// Inconsistent Stochastic Gradient Descent"): statistical process control over
// batch losses, and the conservative subproblem for under-trained batches.
//
// Control: a FIFO window of the last n_b batch losses (n_b = batches per
// epoch by default). limit = mean + k * std (population std, in double). A
// batch is checked only once the window was full before its loss arrived, so
// the first epoch is plain SGD. Its loss is pushed, then compared with the
// limit; above it, the batch is under-trained.
//
// Subproblem for an under-trained batch d with fixed limit and anchor w0:
//   phi(w) = 1/2 (psi_w(d) - limit)^2 + eps / (2 n_w) * ||w - w0||^2
//   grad phi = (psi - limit) * grad psi + (eps / n_w) * (w - w0)
// solved by at most `stop` steps w <- w - zeta * grad phi on the same batch,
// stopping as soon as psi <= limit.
#pragma once

#include <torch/torch.h>

#include <cmath>
#include <deque>
#include <limits>
#include <string>

namespace limbo::optim {

enum class IsgdAnchor { BeforeUpdate, AfterUpdate };
enum class IsgdMomentum { Untouched, Shared };

struct IsgdOptions {
  double k = 3.0;              // control limit in standard deviations (inf = never)
  int64_t window = 0;          // n_b; 0 = batches per epoch
  double epsilon = 0.1;        // weight of the conservative term
  int64_t stop = 5;            // cap on extra iterations per batch
  double zeta = 0.0;           // subproblem step size; 0 = the current learning rate
  IsgdAnchor anchor = IsgdAnchor::BeforeUpdate;
  IsgdMomentum momentum = IsgdMomentum::Untouched;
};

// Running mean / std of the last n values: O(1) per push; the sums are
// recomputed from the window every n pushes so rounding cannot drift.
class ControlWindow {
 public:
  explicit ControlWindow(int64_t n);
  void push(double v);
  bool full() const { return static_cast<int64_t>(values_.size()) == n_; }
  int64_t capacity() const { return n_; }
  double mean() const;
  double stddev() const;  // population standard deviation
  double limit(double k) const { return std::isinf(k) ? k : mean() + k * stddev(); }
  const std::deque<double>& values() const { return values_; }

 private:
  int64_t n_;
  std::deque<double> values_;
  double sum_ = 0, sumsq_ = 0;
  int64_t since_recompute_ = 0;
};

// Decides, batch by batch, which batches are under-trained, and keeps the
// per-epoch statistics that the trainer logs.
class IsgdController {
 public:
  IsgdController(IsgdOptions opt, int64_t batches_per_epoch);
  struct Decision {
    bool triggered = false;
    double limit = std::numeric_limits<double>::infinity();
  };
  // Pushes the (global) loss of the current batch and decides.
  Decision observe(double loss);
  void record_extra(int64_t iterations) { epoch_extra_ += iterations; total_extra_ += iterations; }

  struct EpochStats {
    int64_t triggered = 0, extra_iterations = 0;
    double limit = NAN, mean = NAN, std = NAN;
  };
  // Returns and resets the statistics since the last call.
  EpochStats end_epoch();
  int64_t total_triggered() const { return total_triggered_; }
  int64_t total_extra() const { return total_extra_; }
  const IsgdOptions& options() const { return opt_; }
  const ControlWindow& window() const { return window_; }

  // Window and counters as a tensor (for checkpoints), and back. Without an
  // explicit isgd.window, a state holding more losses than the window grows it
  // (a member that synced from a job of another world size); call
  // set_batches_per_epoch afterwards.
  torch::Tensor state() const;
  void load_state(const torch::Tensor& t);
  // The global batch changed (elastic training): without an explicit
  // isgd.window, the window becomes one epoch of the new global batches,
  // keeping the newest losses.
  void set_batches_per_epoch(int64_t n);

 private:
  IsgdOptions opt_;
  ControlWindow window_;
  int64_t epoch_triggered_ = 0, epoch_extra_ = 0;
  int64_t total_triggered_ = 0, total_extra_ = 0;
};

// One plain subproblem step on flat tensors, in place:
// w <- w - zeta * ((psi - limit) * grad + (eps / n_w) * (w - anchor)).
void isgd_plain_step(torch::Tensor& w, const torch::Tensor& grad, double psi, double limit,
                     const torch::Tensor& anchor, double eps, double zeta);

// The gradient of phi (for the shared-momentum variant), into `out`.
void isgd_phi_grad(torch::Tensor& out, const torch::Tensor& w, const torch::Tensor& grad,
                   double psi, double limit, const torch::Tensor& anchor, double eps);

IsgdAnchor parse_anchor(const std::string& s);
IsgdMomentum parse_isgd_momentum(const std::string& s);

}  // namespace limbo::optim
