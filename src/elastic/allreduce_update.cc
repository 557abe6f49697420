#include "elastic/allreduce_update.h"

namespace limbo::elastic {

AllReduceUpdate::AllReduceUpdate(std::shared_ptr<comm::Collective> group,
                                 std::shared_ptr<optim::Sgd> sgd)
    : group_(std::move(group)), sgd_(std::move(sgd)), loss_buf_(torch::zeros({1}, torch::kFloat64)) {}

void AllReduceUpdate::start(torch::Tensor& weights, torch::Tensor& buffers) {
  if (!group_) return;  // elastic training syncs in establish()
  group_->broadcast(weights, 0);
  if (buffers.numel() > 0) group_->broadcast(buffers, 0);
}

double AllReduceUpdate::weighted_sum(torch::Tensor* grad, double loss, double share) {
  torch::NoGradGuard no_grad;
  if (grad) {
    grad->mul_(share);
    group_->allreduce_sum(*grad);
  }
  loss_buf_.fill_(loss * share);
  group_->allreduce_sum(loss_buf_);
  return loss_buf_.item<double>();
}

train::StepResult AllReduceUpdate::apply(train::StepContext& ctx) {
  share_ = ctx.global_batch > 0 ? static_cast<double>(ctx.batch_size) / ctx.global_batch : 0.0;
  // One collective for gradient and loss: the loss rides in the spare slot
  // after the gradient (a separate tiny all-reduce costs a full round trip).
  double global_loss;
  {
    torch::NoGradGuard no_grad;
    auto& buf = ctx.grad_with_slot;
    const int64_t n = buf.numel() - 2;  // gradient and buffers, then the two slots
    buf.narrow(0, 0, n).mul_(share_);
    buf[n].fill_(ctx.loss * share_);
    buf[n + 1].fill_(flag_source_ ? flag_source_() : 0.0);
    if (compressor_ && compressor_->kind() != comm::Compression::None) {
      // The gradient travels in 16 bits (with this member's error feedback);
      // the float buffers, the loss and the flag stay exact in a small
      // float32 all-reduce behind it.
      const int64_t g = ctx.grad.numel();
      torch::Tensor wire = compressor_->encode(buf.narrow(0, 0, g));
      group_->allreduce_sum_16(wire);
      torch::Tensor tail = buf.narrow(0, g, buf.numel() - g);
      group_->allreduce_sum(tail);
      compressor_->commit();  // only a step that went through moves the residual
      buf.narrow(0, 0, g).copy_(wire);
    } else {
      group_->allreduce_sum(buf);
    }
    global_loss = buf[n].item<double>();
    flag_sum_ = buf[n + 1].item<double>();
  }
  if (ctx.before_update) ctx.before_update(global_loss);
  sgd_->step(ctx.weights, ctx.grad, ctx.lr);
  return {global_loss, ctx.global_batch};
}

double AllReduceUpdate::reduce(torch::Tensor* grad, double loss) {
  return weighted_sum(grad, loss, share_);
}

}  // namespace limbo::elastic
