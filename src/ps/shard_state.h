// The tensor side of one parameter-server shard: the published weights, the
// accumulator of staleness-weighted gradients, and the optimizer that turns
// them into an update (optim/optimizer.h: SGD with momentum and weight decay,
// Adam, AdamW), with its state for this shard's slice. The shard server and
// the simulator both drive it the same way, next to an Aggregator that makes
// the decisions:
//
//   offer = agg.offer(...)                  // accepted with alpha(tau)?
//   single = agg.pending() == 1 && agg.ready()
//   ok = single ? state.step_single(g, alpha) : state.accumulate(g, alpha)
//   if (!ok) agg.retract(...)               // NaN/Inf: never applied
//   else if (single) state.published(agg.commit())
//   else while (agg.ready()) state.apply(agg.commit().size())
//
// Update: one gradient g of rate alpha is the optimizer's update at rate
// alpha (the staleness rule divides it). k gradients are applied as one: their
// alpha-weighted mean g = sum alpha_l g_l / sum alpha_l at the mean rate
// sum alpha_l / k. SGD runs in its lr_in_buffer form (buf = m buf + alpha g +
// decay_lr wd w; w <- w - buf), so a stale gradient's smaller rate scales
// only that gradient. Weight decay (SGD's, AdamW's decoupled one) runs at the
// update's rate, or at alpha0 (UpdateOptions::decay_at_base_rate).
//
// Published versions are never written again: a holder of weights() (a send
// in flight, a simulated learner's snapshot) keeps its version alive; old
// versions are reused for new ones once nobody holds them.
#pragma once

#include <torch/torch.h>

#include <memory>
#include <vector>

#include "optim/optimizer.h"
#include "ps/protocol.h"

namespace limbo::ps {

// A single-gradient update computed part by part while the gradient is still
// arriving (see ShardState::begin_step).
struct StreamedStep {
  std::shared_ptr<torch::Tensor> base;  // the version it reads
  std::shared_ptr<torch::Tensor> next;  // the version it writes
  std::vector<torch::Tensor> state_next;  // the optimizer state it writes
  double alpha = 0;
  bool finite = true;
};

struct UpdateOptions {
  double alpha0 = 0.01;               // the base rate
  optim::OptimizerOptions optimizer;  // optim.* (SGD: momentum 0 = plain steps)
  // The rate weight decay runs at (ps.weight_decay_rate): false, the
  // update's own rate alpha(tau) (as a synchronous step decays at its own
  // rate: a stale update decays as little as it moves, so the decay per
  // sample is the same under every protocol); true, the base rate alpha0 in
  // every update (n-softsync then decays about n times a hardsync round's).
  bool decay_at_base_rate = false;
};

class ShardState {
 public:
  ShardState(int64_t numel, const float* initial, UpdateOptions opt);

  // The current version (shared; never modified after publishing).
  const std::shared_ptr<torch::Tensor>& weights() const { return weights_; }
  int64_t numel() const { return numel_; }

  // One gradient makes the whole update (the optimizer's at rate alpha), in
  // one pass that also checks g. Returns
  // false and changes nothing when g holds NaN or Inf.
  bool step_single(const float* g, double alpha);
  bool step_single(const std::vector<GradPart>& g, double alpha);
  // Adds alpha * g to the accumulator; false (nothing added) on NaN/Inf.
  bool accumulate(const float* g, double alpha);
  bool accumulate(const std::vector<GradPart>& g, double alpha);

  // Streaming a single-gradient update: begin_step() on the current
  // version, step_part() as each part arrives (the update above on that
  // range, checking g; the new optimizer state goes to buffers of the step's
  // own), then finish_step(), which publishes w' and adopts the new state
  // unless a part held NaN/Inf (then it returns false and changes nothing).
  // finish_step() requires current(): no other update since begin_step();
  // otherwise abandon() the step (the state is untouched) and make the
  // update again with step_single().
  bool streams() const { return true; }
  StreamedStep begin_step(double alpha);
  void step_part(StreamedStep& s, const GradPart& g);
  bool current(const StreamedStep& s) const { return s.base == weights_; }
  bool finish_step(StreamedStep& s);
  void abandon(StreamedStep& s);
  // Applies the accumulated k gradients and clears the accumulator.
  void apply(int64_t k);

  // Checkpointing: the optimizer (its state by name and its update count).
  const optim::Optimizer& optimizer() const { return *opt_; }
  // `state`: one vector of numel floats per state_names() entry, or none.
  void restore(const float* weights, const std::vector<std::vector<float>>& state, int64_t steps);

 private:
  std::shared_ptr<torch::Tensor> fresh_version();
  void publish(std::shared_ptr<torch::Tensor> next);

  // One optimizer update of [offset, offset + n) from `w` (and the current
  // state) into `out` and `state_out`; false when g held NaN/Inf.
  bool update_range(float* out, const float* w, const float* g, int64_t offset, int64_t n, double lr,
                    const std::vector<torch::Tensor>& state_out);

  int64_t numel_;
  double alpha0_;
  bool decay_at_base_rate_;
  std::unique_ptr<optim::Optimizer> opt_;
  std::shared_ptr<torch::Tensor> weights_;
  std::vector<std::shared_ptr<torch::Tensor>> spare_;
  torch::Tensor accum_;
  double alpha_sum_ = 0;                   // of the accumulated gradients
  // Released optimizer states that a later step writes into (each step in
  // progress holds its own, never shared).
  std::vector<std::vector<torch::Tensor>> spare_states_;
  void keep_spare_state(std::vector<torch::Tensor> state);
};

// Copies a received payload into place, split over the intra-op threads for
// large payloads (learners use it for the weights they pull).
void copy_floats(float* dst, const void* src, size_t bytes);

}  // namespace limbo::ps
