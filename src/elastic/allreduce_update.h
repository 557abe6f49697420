// Synchronous data-parallel update: every member averages its gradient with
// all others (Gloo all-reduce over the flat gradient, in buckets) and applies
// the same SGD step, so all members keep identical weights.
//
// Members' batches may differ by one sample (the last batch of an epoch), so
// each gradient is weighted by its share of the global batch before the sum:
// the result is exactly the mean gradient over the global batch, as one
// process with batch R*b would compute it. The loss is averaged the same way,
// so loss-driven decisions (ISGD) agree on every member, and the float
// buffers that ride in the same all-reduce (BatchNorm running statistics,
// updated by each member's forward) become the same weighted mean everywhere.
#pragma once

#include <functional>
#include <memory>

#include "comm/collective.h"
#include "comm/compression.h"
#include "optim/sgd.h"
#include "train/update_rule.h"

namespace limbo::elastic {

class AllReduceUpdate : public train::UpdateRule {
 public:
  AllReduceUpdate(std::shared_ptr<comm::Collective> group, std::shared_ptr<optim::Sgd> sgd);
  // Broadcasts member 0's weights and buffers to everyone.
  void start(torch::Tensor& weights, torch::Tensor& buffers) override;
  train::StepResult apply(train::StepContext& ctx) override;
  double reduce(torch::Tensor* grad, double loss) override;
  const char* name() const override { return "allreduce"; }
  // Elastic training swaps the group when membership changes.
  void set_group(std::shared_ptr<comm::Collective> group) { group_ = std::move(group); }
  // A value each member contributes with every gradient (summed): elastic
  // training raises it to ask for a membership change, so all members see
  // the request after the same step.
  void set_flag_source(std::function<double()> f) { flag_source_ = std::move(f); }
  double last_flag_sum() const { return flag_sum_; }
  // comm.compression: the gradient all-reduce in 16 bits with error
  // feedback (ISGD's extra all-reduces stay in float32).
  void set_compression(comm::Compression c) {
    compressor_ = c == comm::Compression::None ? nullptr : std::make_unique<comm::Compressor>(c);
  }

 private:
  double weighted_sum(torch::Tensor* grad, double loss, double share);

  std::shared_ptr<comm::Collective> group_;
  std::shared_ptr<optim::Sgd> sgd_;
  torch::Tensor loss_buf_;
  double share_ = 1.0;  // this member's fraction of the last global batch
  std::function<double()> flag_source_;
  std::unique_ptr<comm::Compressor> compressor_;
  double flag_sum_ = 0;
};

}  // namespace limbo::elastic
