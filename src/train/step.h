// The training step, written once for every mode.
//
// TrainStep is what the trainer, the parameter-server learner, both
// simulators, ISGD's extra iterations and evaluation call to turn a batch
// into a loss and a gradient: zero the flat gradient, forward, loss,
// backward. A new model kind or loss is added here and nowhere else.
//
// Losses (`model.loss`):
//   cross_entropy  outputs [B, C, ...] against int64 labels [B, ...]
//                  (PyTorch's convention; per-token classification works);
//                  accuracy is the share of label elements predicted right.
//   mse            outputs against float targets of the same shape.
//   module         the model's forward(x, y) returns the scalar loss itself;
//                  accuracy comes from its predict(x) when it has one.
//
// MetricsWindow is the running mean loss and throughput between two metrics
// lines. Both run on the training thread only.
#pragma once

#include <functional>
#include <string>

#include <nlohmann/json.hpp>

#include <optional>

#include "common/timing.h"
#include "data/loader.h"
#include "data/registry.h"
#include "models/net.h"
#include "optim/batch_policy.h"
#include "optim/flat_params.h"
#include "optim/lr_schedule.h"
#include "optim/optimizer.h"

namespace limbo::train {

enum class LossKind { CrossEntropy, Mse, Module };
LossKind parse_loss(const std::string& name);  // throws InvalidInput
const char* loss_name(LossKind k);

struct EvalResult {
  double loss = 0;      // mean test loss (per sample for the module loss, per element otherwise)
  double accuracy = 0;  // share of labels predicted right (NaN where there is none)
  int64_t samples = 0;
  bool tokens = false;  // token-stream data: the perplexity exp(loss) is reported
};

// The evaluation's fields of records, final.json and summaries: test_loss,
// test_accuracy (null where there is none) and, for token data,
// test_perplexity = exp(test_loss).
nlohmann::json eval_fields(const EvalResult& r);

class TrainStep {
 public:
  // `net` and `flat` (its flat parameters) must outlive the step.
  TrainStep(models::Net& net, optim::FlatParams& flat, LossKind loss, bool channels_last);

  // Checks that the model's outputs fit the data's targets, with one forward
  // of two test samples in eval mode: output shape against target shape and,
  // for labels, every label of both splits inside [0, C). Throws InvalidInput
  // naming the file, sample and values. Call before anything is written.
  void check_data(const data::DatasetSplits& d, const data::Normalization& norm);

  // Zeroes the flat gradient, runs forward, loss and backward on the batch
  // (its x made channels-last first where configured): afterwards
  // flat.grad() holds the batch's mean gradient. Returns the mean loss.
  // before_backward (may be empty) is called between forward and backward
  // with the batch's loss: a data-parallel rule starts reducing gradient
  // buckets there while backward still runs (elastic.overlap).
  //
  // With micro-batches (train.accumulate = K > 1) the batch is cut into K
  // parts (sizes differing by at most one), each forward and backward in
  // turn with its loss weighted by its share of the batch, so the gradients
  // add up to the whole batch's mean gradient while only one part's
  // activations are alive. before_backward comes before the last part's
  // backward, with the whole batch's loss: only that backward reduces
  // buckets (as DDP's no_sync for the others).
  using BeforeBackward = std::function<void(double loss)>;
  double gradient(data::Batch& batch, const BeforeBackward& before_backward = {}) {
    return gradient(batch.x, batch.y, before_backward);
  }
  double gradient(torch::Tensor& x, const torch::Tensor& y, const BeforeBackward& before_backward = {});
  // The batch's mean loss without a gradient (autograd off).
  double loss_only(const torch::Tensor& x, const torch::Tensor& y);

  // Loss and accuracy over a whole split, in eval mode without autograd, in
  // chunks of `chunk` samples; restores the model's train/eval mode. (A
  // chunk's activations are the process's peak memory: LeNet's first layer
  // alone is 46 KB a sample, 46 MB at 1000, 3 MB at 64.)
  EvalResult evaluate(const data::Dataset& split, const data::Normalization& norm,
                      int64_t chunk = 64);

  bool reports_accuracy() const;
  // train.precision = bf16: forwards (training, loss-only, evaluation) run
  // under CPU autocast to bfloat16 (matrix products and convolutions in
  // bf16, reductions and norms in float32, as torch.autocast("cpu")), and
  // the model's outputs are cast back to float32 before the loss. Weights,
  // gradients and optimizer state stay float32; backward follows the
  // recorded casts, so every parameter's gradient arrives in float32.
  void set_bf16(bool on) { bf16_ = on; }
  bool bf16() const { return bf16_; }
  void set_micro_batches(int64_t k) { micro_ = k < 1 ? 1 : k; }
  int64_t micro_batches() const { return micro_; }
  // Testing aid (train.slow_step_ms): gradient() also sleeps this long.
  void set_testing_delay(std::chrono::milliseconds d) { delay_ = d; }
  LossKind loss_kind() const { return loss_; }
  models::Net& net() { return net_; }

 private:
  torch::Tensor loss(const torch::Tensor& x, const torch::Tensor& y);
  // The model's outputs (under autocast with bf16, returned as float32).
  torch::Tensor forward(const torch::Tensor& x);
  torch::Tensor predict(const torch::Tensor& x);
  torch::Tensor module_loss(const torch::Tensor& x, const torch::Tensor& y);
  void prepare(torch::Tensor& x) const;
  void check_labels(const torch::Tensor& y, int64_t classes) const;

  models::Net& net_;
  optim::FlatParams& flat_;
  LossKind loss_;
  bool channels_last_;
  std::chrono::milliseconds delay_{0};
  int64_t micro_ = 1;
  bool bf16_ = false;
};

// True when this CPU computes in bfloat16 natively (AVX-512 BF16 or AMX);
// elsewhere autocast to bf16 still runs, on emulated bf16 arithmetic.
// LIMBO_TESTING_NO_BF16=1 makes it false (a testing aid).
bool cpu_has_bf16();

// Mean loss and samples/s between two metrics lines.
class MetricsWindow {
 public:
  void add(double loss, int64_t samples) {
    loss_ += loss;
    steps_ += 1;
    samples_ += samples;
  }
  int64_t steps() const { return steps_; }
  double mean_loss() const { return steps_ ? loss_ / steps_ : 0.0; }
  double samples_per_second() const {
    const double s = seconds_since(start_);
    return s > 0 ? samples_ / s : 0.0;
  }
  // Starts a new window (also used to exclude evaluation time).
  void reset() {
    loss_ = 0;
    steps_ = samples_ = 0;
    start_ = Clock::now();
  }

 private:
  double loss_ = 0;
  int64_t steps_ = 0, samples_ = 0;
  Clock::time_point start_ = Clock::now();
};

// The learning rate of a step: the schedule at `epoch`, times the batch-size
// policy's multiplier for the nominal global batch (b * workers, so only
// membership changes move it). At a change of that multiplier the optimizer's
// momentum (SGD's buffer, Adam's exp_avg) is kept, reset or rescaled as elastic.momentum says. Every loop
// that steps (trainer, simulators) calls this once per step.
struct PolicyStep {
  optim::BatchSizePolicy::Step policy;
  double lr = 0;
};
// `scale_momentum` does the keeping, resetting or rescaling (by a factor;
// 0 = reset) where the state is not (only) the optimizer's own (sharded
// state: the homes and their copies); by default opt.scale_momentum().
PolicyStep policy_step(optim::BatchSizePolicy& policy, const optim::LrSchedule& schedule, optim::Optimizer& opt,
                       double epoch, int64_t step, int64_t nominal_global_batch,
                       const std::function<void(double)>& scale_momentum = {});

// A training-metrics line, the same fields from every loop (the status page,
// `limbo plot` and /metrics read them): {"kind": "train", step, epoch,
// loss (the window's mean), samples (so far), samples_per_second, and the
// optional fields when set}. A learner's line is kind "learner" with its own
// fields added by the caller.
struct StepRecord {
  int64_t step = 0;
  double epoch = 0;
  int64_t samples = 0;
  std::optional<double> lr, lr_multiplier;
  std::optional<double> grad_norm;  // mean pre-clip norm over the window (clipping on)
  std::optional<int64_t> batch_size, skipped_steps, workers;
};
nlohmann::json step_record(const StepRecord& r, const MetricsWindow& window, const char* kind = "train");

}  // namespace limbo::train
