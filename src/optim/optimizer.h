// The one optimizer interface over the flat parameter buffer.
//
// An optimizer's state is a few flat float32 tensors the size of the
// trainable parameters, each with a name (SGD: momentum_buffer; Adam:
// exp_avg, exp_avg_sq), plus a count of the updates made (Adam's bias
// correction). State sync, checkpoints, the parameter-server shards and the
// simulators move that state by name and never know the algorithm.
//
// An algorithm is one elementwise rule, `update()`: it reads a slice of the
// weights, the gradient and the state, and writes the new weights and state
// (to the same memory, or to other buffers: a parameter-server shard writes a
// new version beside the published one). The base class runs it in place
// over whole tensors, split across the intra-op threads.
//
// Concrete rules: optim/sgd.h, optim/adam.h; make_optimizer() picks one from
// OptimizerOptions. Not thread-safe; update() is const and may run on
// disjoint slices from several threads.
#pragma once

#include <torch/torch.h>

#include <memory>
#include <string>
#include <vector>

namespace limbo::optim {

struct OptimizerOptions {
  std::string algorithm = "sgd";  // sgd | adam | adamw
  double weight_decay = 0.0;      // L2 (sgd, adam) or decoupled (adamw)
  // SGD
  double momentum = 0.0;
  double dampening = 0.0;
  bool nesterov = false;
  // Keep the learning rate inside the momentum buffer, v = mu v + lr g and
  // w -= v (the parameter server's form: a stale gradient's smaller rate
  // then scales that gradient only, not the momentum it joins). The default
  // is PyTorch's v = mu v + g and w -= lr v; both agree at a constant rate.
  bool lr_in_buffer = false;
  // Adam / AdamW
  double beta1 = 0.9, beta2 = 0.999, eps = 1e-8;
};

constexpr int kMaxStateTensors = 2;

// One slice [0, n) of one update. `w_out` may be `w` (in place), and each
// `s_out[i]` may be `s[i]`. s[i] == nullptr: no state yet (the first update;
// a rule reads it as zeros, or as SGD's "buffer = first gradient").
struct UpdateSlice {
  float* w_out = nullptr;
  const float* w = nullptr;
  const float* g = nullptr;
  float* s_out[kMaxStateTensors] = {nullptr, nullptr};
  const float* s[kMaxStateTensors] = {nullptr, nullptr};
  int64_t n = 0;
};

struct UpdateScalars {
  double lr = 0;        // this update's learning rate
  double decay_lr = 0;  // the rate weight decay is applied at (= lr; a PS shard may use its base rate)
  int64_t t = 1;        // 1-based number of this update (bias correction)
};

class Optimizer {
 public:
  explicit Optimizer(OptimizerOptions opt) : opt_(std::move(opt)) {}
  virtual ~Optimizer() = default;

  const OptimizerOptions& options() const { return opt_; }
  const std::string& algorithm() const { return opt_.algorithm; }
  // Names of the state tensors this configuration keeps (fixed for its
  // lifetime; SGD without momentum keeps none).
  virtual std::vector<std::string> state_names() const = 0;
  // The rule on one slice; returns whether every g in it was finite (checked
  // in the same pass). Writes every output even when not.
  virtual bool update(const UpdateSlice& s, const UpdateScalars& k) const = 0;

  // One update of `w` in place with gradient `g` at rate `lr` (the trainer's
  // path); allocates the state at the first update. Returns whether g was finite.
  bool step(torch::Tensor& w, const torch::Tensor& g, double lr);
  // One update of n elements into other memory (a sharded state's next
  // version, optim/shards.h): reads w, g and the state `s` (one pointer per
  // state name, or empty before the first update), writes w_out and s_out
  // (w_out may be w, s_out[i] may be s[i]). Counts the update in steps();
  // state() is left as it is. Split across the intra-op threads as step().
  bool step_into(const float* w, float* w_out, const float* g, const std::vector<const float*>& s,
                 const std::vector<float*>& s_out, int64_t n, double lr);

  // The state, in state_names() order: undefined tensors before the first
  // update (or after reset_state()).
  const std::vector<torch::Tensor>& state() const { return state_; }
  bool has_state() const { return !state_.empty() && state_[0].defined(); }
  int64_t steps() const { return steps_; }
  // Replaces the state (a checkpoint, a peer, an undo): `tensors` in
  // state_names() order, flat float32, or empty for none.
  void set_state(std::vector<torch::Tensor> tensors, int64_t steps);
  // A deep copy of the state and count, and back (undo of extra updates).
  struct Snapshot {
    std::vector<torch::Tensor> tensors;
    int64_t steps = 0;
  };
  Snapshot snapshot() const;
  void restore(const Snapshot& s) { set_state(s.tensors, s.steps); }
  void reset_state() { set_state({}, 0); }
  // The batch ratio kappa = B / B_ref of the batch-size policy in effect
  // (optim/batch_policy.h). Adam scales (1 - beta1) and (1 - beta2) by kappa
  // (at most 1) and eps by 1 / sqrt(kappa), the square-root rule's
  // hyperparameters; SGD needs only the learning rate and ignores it.
  void set_batch_scale(double kappa) { kappa_ = kappa > 0 ? kappa : 1.0; }
  double batch_scale() const { return kappa_; }
  // Batch-change policies: multiplies the state that carries past gradients'
  // direction (SGD's momentum buffer, Adam's exp_avg); 0 clears all state.
  void scale_momentum(double factor);
  // The index, in state_names() order, of the state scale_momentum() scales.
  int momentum_index() const { return momentum_slot(); }

 protected:
  // Index of the state tensor scale_momentum() multiplies.
  virtual int momentum_slot() const { return 0; }

 private:
  OptimizerOptions opt_;
  std::vector<torch::Tensor> state_;
  int64_t steps_ = 0;
  double kappa_ = 1.0;
};

// The optimizer for `opt.algorithm`; throws InvalidInput naming the setting
// on an unknown algorithm or inconsistent options.
std::unique_ptr<Optimizer> make_optimizer(const OptimizerOptions& opt);
std::vector<std::string> optimizer_algorithms();  // sgd, adam, adamw

// Whether a float's exponent bits are all ones (NaN or inf), as an OR-able
// mask: (exponent + one exponent ulp) sets bit 31 only then. The rules fold
// it over each slice to check g in the pass that reads it.
inline uint32_t nonfinite_bits(float x) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  return (u & 0x7f800000u) + 0x00800000u;
}
inline bool finite_from_bits(uint32_t m) { return (m & 0x80000000u) == 0; }

}  // namespace limbo::optim
