// The tensor side of one parameter-server shard: the published weights, the
// accumulator of staleness-weighted gradients, and server-side momentum and
// weight decay. The shard server and the simulator both drive it the same
// way, next to an Aggregator that makes the decisions:
//
//   offer = agg.offer(...)                  // accepted with alpha(tau)?
//   single = agg.pending() == 1 && agg.ready()
//   ok = single ? state.step_single(g, alpha) : state.accumulate(g, alpha)
//   if (!ok) agg.retract(...)               // NaN/Inf: never applied
//   else if (single) state.published(agg.commit())
//   else while (agg.ready()) state.apply(agg.commit().size())
//
// Update: g = (1/k) sum alpha_l g_l (+ alpha0 * wd * w); buf = m * buf + g;
// w <- w - buf (w <- w - g without momentum).
//
// Published versions are never written again: a holder of weights() (a send
// in flight, a simulated learner's snapshot) keeps its version alive; old
// versions are reused for new ones once nobody holds them.
#pragma once

#include <torch/torch.h>

#include <memory>
#include <vector>

#include "ps/protocol.h"

namespace limbo::ps {

// A single-gradient update computed part by part while the gradient is still
// arriving (see ShardState::begin_step).
struct StreamedStep {
  std::shared_ptr<torch::Tensor> base;  // the version it reads
  std::shared_ptr<torch::Tensor> next;  // the version it writes
  torch::Tensor momentum_next;          // with momentum: the buffer it writes
  float alpha = 0;
  bool finite = true;
};

struct UpdateOptions {
  double alpha0 = 0.01;  // for weight decay
  double momentum = 0;
  double weight_decay = 0;
};

class ShardState {
 public:
  ShardState(int64_t numel, const float* initial, UpdateOptions opt);

  // The current version (shared; never modified after publishing).
  const std::shared_ptr<torch::Tensor>& weights() const { return weights_; }
  int64_t numel() const { return numel_; }

  // One gradient makes the whole update: w' = w - alpha g (with momentum and
  // weight decay as configured), in one pass that also checks g. Returns
  // false and changes nothing when g holds NaN or Inf.
  bool step_single(const float* g, double alpha);
  bool step_single(const std::vector<GradPart>& g, double alpha);
  // Adds alpha * g to the accumulator; false (nothing added) on NaN/Inf.
  bool accumulate(const float* g, double alpha);
  bool accumulate(const std::vector<GradPart>& g, double alpha);

  // Streaming a single-gradient update, with or without momentum and weight
  // decay: begin_step() on the current version, step_part() as each part
  // arrives (the update above on that range, checking g; the new momentum
  // goes to a buffer of the step's own), then finish_step(), which publishes
  // w' and adopts the new momentum unless a part held NaN/Inf (then it
  // returns false and changes nothing). finish_step() requires current():
  // no other update since begin_step(); otherwise abandon() the step (the
  // momentum is untouched) and make the update again with step_single().
  bool streams() const { return true; }
  StreamedStep begin_step(double alpha);
  void step_part(StreamedStep& s, const GradPart& g);
  bool current(const StreamedStep& s) const { return s.base == weights_; }
  bool finish_step(StreamedStep& s);
  void abandon(StreamedStep& s);
  // Applies the accumulated k gradients and clears the accumulator.
  void apply(int64_t k);

  // Checkpointing.
  torch::Tensor& momentum_buffer() { return momentum_; }
  void restore(const float* weights, const float* momentum);  // momentum may be null

 private:
  std::shared_ptr<torch::Tensor> fresh_version();
  void publish(std::shared_ptr<torch::Tensor> next);

  int64_t numel_;
  UpdateOptions opt_;
  std::shared_ptr<torch::Tensor> weights_;
  std::vector<std::shared_ptr<torch::Tensor>> spare_;
  torch::Tensor accum_, momentum_, spare_momentum_;
};

// Copies a received payload into place, split over the intra-op threads for
// large payloads (learners use it for the weights they pull).
void copy_floats(float* dst, const void* src, size_t bytes);

}  // namespace limbo::ps
