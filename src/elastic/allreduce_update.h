// Synchronous data-parallel update: every member averages its gradient with
// all others (Gloo all-reduce over the flat gradient, in buckets) and applies
// the same optimizer step, so all members keep identical weights.
//
// Members' batches may differ by one sample (the last batch of an epoch), so
// each gradient is weighted by its share of the global batch before the sum:
// the result is exactly the mean gradient over the global batch, as one
// process with batch R*b would compute it. The loss is averaged the same way,
// so loss-driven decisions (ISGD) agree on every member, and the float
// buffers that ride in the same all-reduce (BatchNorm running statistics,
// updated by each member's forward) become the same weighted mean everywhere;
// integer buffers (BatchNorm's num_batches_tracked) take member 0's value
// (see FlatParams). A sum that is not finite skips the update on every
// member alike (StepResult::skipped).
#pragma once

#include <functional>
#include <memory>

#include "comm/collective.h"
#include "comm/compression.h"
#include "elastic/bucket_reducer.h"
#include "train/update_rule.h"

namespace limbo::elastic {

struct ReduceOptions {
  int64_t bucket_bytes = 0;  // elastic.bucket_mb; 0 = one bucket
  bool overlap = false;      // elastic.overlap: reduce buckets while backward runs
  comm::Compression compression = comm::Compression::None;  // comm.compression
  int64_t testing_die_in_bucket = 0;  // train.testing_die_in_bucket (see BucketReducer)
};

class AllReduceUpdate : public train::UpdateRule {
 public:
  // `flat` (the trainer's flat parameters) must outlive the rule.
  AllReduceUpdate(std::shared_ptr<comm::Collective> group, std::shared_ptr<train::OptimizerStep> optimizer,
                  optim::FlatParams& flat, const ReduceOptions& opt);
  // Broadcasts member 0's weights and buffers to everyone.
  void start(torch::Tensor& weights, torch::Tensor& buffers) override;
  void backward_starts(train::StepContext& ctx) override;
  train::StepResult apply(train::StepContext& ctx) override;
  double reduce(torch::Tensor* grad, double loss) override;
  const char* name() const override { return "allreduce"; }
  // Buckets, how many overlapped backward, the exposed communication.
  nlohmann::json summary() const override;
  // Elastic training swaps the group when membership changes.
  void set_group(std::shared_ptr<comm::Collective> group) { group_ = std::move(group); }
  // A value each member contributes with every gradient (summed): elastic
  // training raises it to ask for a membership change, so all members see
  // the request after the same step.
  void set_flag_source(std::function<double()> f) { flag_source_ = std::move(f); }
  double last_flag_sum() const { return flag_sum_; }
  const BucketReducer& reducer() const { return reducer_; }

 private:
  std::shared_ptr<comm::Collective> group_;
  std::shared_ptr<train::OptimizerStep> opt_;
  optim::FlatParams& flat_;
  BucketReducer reducer_;
  torch::Tensor loss_buf_;
  double share_ = 1.0;  // this member's fraction of the last global batch
  std::function<double()> flag_source_;
  double flag_sum_ = 0;
};

}  // namespace limbo::elastic
