// The one seam between "a gradient was computed" and "the weights changed".
//
// The training loop is the same for single-process, all-reduce and
// parameter-server training; only the UpdateRule differs. After backward, the
// loop hands the rule the flat weights and gradient of this worker's batch;
// the rule turns them into an update (locally, after an all-reduce, or via a
// parameter server) and reports the loss it decided on (the global loss when
// workers average). Rules run on the training thread and may block; errors
// propagate as exceptions (PeerFailure / Timeout for distributed rules).
#pragma once

#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include <chrono>
#include <cmath>
#include <functional>
#include <memory>
#include <optional>

#include "optim/clip.h"
#include "optim/optimizer.h"
#include "train/membership.h"

namespace limbo::train {

struct DeferredShardState;  // train/checkpoint.h

struct StepContext {
  torch::Tensor& weights;  // flat, updated in place
  torch::Tensor& grad;     // flat mean gradient of this worker's batch
  torch::Tensor& grad_with_slot;  // [grad | buffers | 2 spare slots] (see FlatParams)
  double loss;             // this worker's mean batch loss
  int64_t batch_size;      // this worker's batch
  int64_t global_batch;    // the batch of all workers together (= batch_size alone)
  double lr;               // scheduled learning rate for this step
  int64_t iteration;       // steps completed before this one
  // Called by the rule once the loss to act on is known (the global loss when
  // workers average), before the weights change. ISGD decides here, so every
  // worker decides alike and an anchor can be taken before the update.
  std::function<void(double loss)> before_update;
  // Where the gradient stays in the parameters' own `.grad` rather than in
  // `grad` (one process, the front end's optimizer): whether it is finite.
  std::function<bool()> grad_finite;
};

struct StepResult {
  double loss;           // loss to report/decide on (global when averaged)
  int64_t global_batch;  // samples that contributed to this update
  // The (reduced) gradient or loss was not finite: the weights did not
  // change. Every member of a data-parallel group decides alike.
  bool skipped = false;
};

// Whether a gradient and its loss hold only finite values (one pass: a sum
// is finite only when every element is, short of overflowing float32).
inline bool finite_step(const torch::Tensor& grad, double loss) {
  return std::isfinite(loss) && (grad.numel() == 0 || std::isfinite(grad.sum().item<float>()));
}

// The optimizer as the rules apply it: clipping by global norm
// (optim.clip_grad_norm; 0 = off) of the gradient they decided on, then the
// optimizer's update. Data-parallel rules call it with the reduced gradient,
// so every member clips alike.
class OptimizerStep {
 public:
  OptimizerStep(std::unique_ptr<optim::Optimizer> opt, double clip_norm)
      : opt_(std::move(opt)), clip_(clip_norm) {}
  void apply(torch::Tensor& w, torch::Tensor& g, double lr) {
    if (clip_ > 0) last_norm_ = optim::clip_grad_norm(g, clip_);
    if (external_) external_(lr);
    else opt_->step(w, g, lr);
  }
  // The front end's own optimizer (a Python user's torch.optim) in place of
  // optimizer()'s update: called with the rate after clipping, it updates
  // the weights from the gradient in place (the parameters' data and grad
  // are views of `w` and `g`). optimizer() then holds no state.
  void set_external(std::function<void(double lr)> step) { external_ = std::move(step); }
  optim::Optimizer& optimizer() { return *opt_; }
  const optim::Optimizer& optimizer() const { return *opt_; }
  double clip_norm() const { return clip_; }
  // The norm before clipping at the last apply() (NaN while clipping is off).
  double last_norm() const { return last_norm_; }
  // A rule that clips by itself (sharded state: the norm comes from the
  // shards) reports the norm here.
  void set_last_norm(double norm) { last_norm_ = norm; }

 private:
  std::unique_ptr<optim::Optimizer> opt_;
  double clip_;
  double last_norm_ = std::nan("");
  std::function<void(double lr)> external_;
};

class UpdateRule {
 public:
  virtual ~UpdateRule() = default;
  // Called once before the first step: distributed rules make every member
  // start from the same weights and buffers here (a collective; blocks).
  virtual void start(torch::Tensor& weights, torch::Tensor& buffers) {}
  // A fixed group resumed from a checkpoint that only member 0 read (the
  // run directory is member 0's): the whole state from it (weights,
  // buffers, optimizer state, step and cursor, the policy's and the front
  // end's), in place of start(). A collective; every member calls it.
  virtual void start_resumed(SyncTargets& s) { start(s.weights, s.buffers); }
  // Called between forward and backward of a step's gradient, with the
  // context filled in (ctx.loss is the batch's loss). A rule that
  // communicates while backward runs (elastic.overlap) starts here; apply()
  // then finishes what it started. Optional: apply() alone must also work.
  virtual void backward_starts(StepContext& ctx) {}
  // The step's loss, when it became known after backward_starts() (a
  // front end that arms the reduction before forward).
  virtual void set_step_loss(double loss) {}
  // When this step's backward ended, where the rule saw it end (a reduction
  // finished at the end of backward); none: the front end's own clock.
  virtual std::optional<std::chrono::steady_clock::time_point> backward_ended() const { return std::nullopt; }
  // While on, backward passes add to this member's gradient without
  // reducing it (the user's micro-batches by hand); a backward after it is
  // turned off reduces the sum.
  virtual void no_sync(bool on) {}
  virtual StepResult apply(StepContext& ctx) = 0;
  // Averages an extra gradient (may be null: loss only) and loss across
  // workers, in place; returns the global loss. Used for additional passes
  // over the same batch (ISGD's subproblem). Identity for one process.
  virtual double reduce(torch::Tensor* grad, double loss) = 0;
  // Element-wise maximum of a small float64 tensor across the members, in
  // place (DiLoCo's agreement on what each member did in an outer step).
  // Identity for one process.
  virtual void agree_max(torch::Tensor& t) {}
  // Sum of a float32 tensor across the members, in place, this member's
  // part on the wire as comm.compression encodes it, with an error-feedback
  // residual of its own for each `key` (comm::sum_encoded): streaming
  // DiLoCo's fragment all-reduce, a key a fragment. The residual counts once
  // sum_committed(key) says the sum was used (a failed sum is redone from
  // the old one). Identity for one process.
  virtual void sum(torch::Tensor& t, int key) {}
  virtual void sum_committed(int key) {}
  // The bytes of this member's part of the gradient that its last apply()
  // or sum() handed to the collectives (as encoded: codes and scales, 16 or
  // 32 bits a value), the tail of buffers and scalars not counted; -1: the
  // rule sends nothing (one process).
  virtual int64_t last_payload_bytes() const { return -1; }
  // Streaming DiLoCo's outer update of the global fragment [lo, hi) of the
  // weights (`w`, its hi - lo values, updated in place) by the summed
  // pseudo-gradient `g`, where the rule shards the optimizer state: each
  // member updates its shard's part of the fragment (and the copies it
  // keeps for another host) from committed step `step`'s version into the
  // next, and the fragment's new weights are all-gathered. `skip` (a sum
  // that was not finite): the versions move to step + 1 unchanged. False
  // when the rule does not shard: the caller updates with the whole state.
  virtual bool update_fragment(torch::Tensor& w, const torch::Tensor& g, int64_t lo, int64_t hi, double lr,
                               int64_t step, bool skip) {
    return false;
  }
  // Whether update_fragment() updates (the optimizer state is sharded).
  virtual bool shards_state() const { return false; }
  // The membership-change flag this member sends with a gradient (0: none),
  // and, where it travels outside the gradient (streaming DiLoCo's
  // agreement), the members' sum of it, as apply() would have agreed it.
  virtual double change_flag() { return 0; }
  virtual void set_agreed_flag(double sum) {}
  virtual const char* name() const = 0;
  // Figures for the run's summary (merged into summary.json); none by default.
  virtual nlohmann::json summary() const { return nlohmann::json::object(); }
  // A rule that shards the optimizer state (optim.shard_state) puts the
  // whole state of committed step `step` into `opt` on the members that
  // pass `here` (a collective: every member calls it at the same point),
  // for a checkpoint (its writer) or a membership change (everyone); the
  // next update shards it again. No-op by default.
  virtual void gather_state(optim::Optimizer& opt, int64_t step, bool here) {}
  // Fully sharded (optim.shard_weights): the weights and the state are
  // only ever in shards.
  virtual bool shards_weights() const { return false; }
  // Fully sharded, before the forward of step `step` + 1 on a model that
  // has no units (the CLI's): the homes hold committed step `step`; the
  // weights are gathered whole (backward's buckets give them back). A
  // gather that fails fails the step (apply() throws it).
  virtual void before_forward(int64_t step) {}
  // Fully sharded: every member writes the shards it holds (its own, and
  // its copies of another host's) of committed step `step` beside `path`
  // (train/checkpoint.h: shard_file), in parallel; a collective. False,
  // nothing written, when some member has no path (no run directory): the
  // caller gathers the state instead.
  virtual bool write_shards(const std::string& path, int64_t step) { return false; }
  // Fully sharded, after the final checkpoint's shards are written: the
  // shards' optimizer state is given back (the weights stay), so that the
  // whole weights gathered after training fit where the state was.
  virtual void drop_saved_state() {}
  // After a checkpoint was written from a gathered state: `opt` holds this
  // member's shard again (the whole stays only where a membership change
  // needs it). No-op by default.
  virtual void release_state(optim::Optimizer& opt, int64_t step) {}
  // elastic.momentum at a batch change: multiplies the momentum of the
  // state of committed step `step` by `factor` (0: clears the whole state
  // and its update count). The default acts on `opt`'s own state.
  virtual void scale_momentum(optim::Optimizer& opt, double factor, int64_t step) { opt.scale_momentum(factor); }
  // The trainer replaced the weights and state (a checkpoint loaded after
  // the state was lost): what the rule knew of them no longer holds.
  virtual void state_replaced() {}
  // A resume of a fully sharded checkpoint by a rule that shards the
  // state: the state is left in the checkpoint's shard files, and the first
  // re-sharding reads from them what the new homes need (false: the rule
  // takes the state whole, as loaded).
  virtual bool takes_deferred_state() const { return false; }
  virtual void set_deferred_state(std::shared_ptr<const DeferredShardState> d) {}
  // Testing aid: a rule that keeps state outside the process removes it.
  virtual void testing_drop_kept_state() {}
};

// Single process: the optimizer's step with the local gradient.
class LocalUpdate : public UpdateRule {
 public:
  explicit LocalUpdate(std::shared_ptr<OptimizerStep> opt) : opt_(std::move(opt)) {}
  StepResult apply(StepContext& ctx) override {
    const bool finite = ctx.grad_finite ? std::isfinite(ctx.loss) && ctx.grad_finite() : finite_step(ctx.grad, ctx.loss);
    if (!finite) return {ctx.loss, ctx.batch_size, /*skipped=*/true};
    if (ctx.before_update) ctx.before_update(ctx.loss);
    opt_->apply(ctx.weights, ctx.grad, ctx.lr);
    return {ctx.loss, ctx.batch_size};
  }
  double reduce(torch::Tensor*, double loss) override { return loss; }
  const char* name() const override { return "local"; }

 private:
  std::shared_ptr<OptimizerStep> opt_;
};

}  // namespace limbo::train
