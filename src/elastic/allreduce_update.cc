#include "elastic/allreduce_update.h"

namespace limbo::elastic {

AllReduceUpdate::AllReduceUpdate(std::shared_ptr<comm::Collective> group,
                                 std::shared_ptr<train::OptimizerStep> optimizer, optim::FlatParams& flat,
                                 const ReduceOptions& opt)
    : group_(std::move(group)),
      opt_(std::move(optimizer)),
      flat_(flat),
      reducer_(flat, opt.bucket_bytes, opt.overlap, opt.compression),
      loss_buf_(torch::zeros({1}, torch::kFloat64)) {
  reducer_.set_testing_death(opt.testing_die_in_bucket);
}

void AllReduceUpdate::start(torch::Tensor& weights, torch::Tensor& buffers) {
  if (!group_) return;  // elastic training syncs in establish()
  group_->broadcast(weights, 0);
  if (buffers.numel() > 0) {
    flat_.buffers_to_flat();
    group_->broadcast(buffers, 0);
    flat_.flat_to_buffers();
  }
}

// ISGD's extra passes: not bucketed, not overlapped, float32.
double AllReduceUpdate::reduce(torch::Tensor* grad, double loss) {
  torch::NoGradGuard no_grad;
  const double share = share_;
  if (grad) {
    grad->mul_(share);
    group_->allreduce_sum(*grad);
  }
  loss_buf_.fill_(loss * share);
  group_->allreduce_sum(loss_buf_);
  return loss_buf_.item<double>();
}

void AllReduceUpdate::backward_starts(train::StepContext& ctx) {
  share_ = ctx.global_batch > 0 ? static_cast<double>(ctx.batch_size) / ctx.global_batch : 0.0;
  reducer_.begin(group_, share_, ctx.loss);
}

train::StepResult AllReduceUpdate::apply(train::StepContext& ctx) {
  // Gradient, float buffers, loss and flag in one pass of buckets; the loss
  // and flag ride in the spare slots after the gradient (a separate tiny
  // all-reduce costs a full round trip).
  if (!reducer_.armed()) backward_starts(ctx);
  reducer_.finish(flag_source_ ? flag_source_() : 0.0);
  auto& buf = ctx.grad_with_slot;
  const int64_t n = buf.numel() - optim::FlatParams::kSlots;
  const double global_loss = buf[n].item<double>();
  flag_sum_ = buf[n + 1].item<double>();
  if (!reducer_.finite()) return {global_loss, ctx.global_batch, /*skipped=*/true};
  if (ctx.before_update) ctx.before_update(global_loss);
  opt_->apply(ctx.weights, ctx.grad, ctx.lr);
  return {global_loss, ctx.global_batch};
}

nlohmann::json AllReduceUpdate::summary() const {
  const auto& st = reducer_.stats();
  const double steps = std::max<int64_t>(st.steps, 1);
  return {{"buckets", reducer_.buckets().size()},
          {"overlap", reducer_.overlapped()},
          {"buckets_started_in_backward", st.buckets_started_in_backward},
          {"exposed_communication_ms_per_step", 1000.0 * st.exposed_seconds / steps}};
}

}  // namespace limbo::elastic
