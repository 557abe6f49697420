#include "elastic/allreduce_update.h"

namespace limbo::elastic {

AllReduceUpdate::AllReduceUpdate(std::shared_ptr<comm::Collective> group,
                                 std::shared_ptr<optim::Sgd> sgd)
    : group_(std::move(group)), sgd_(std::move(sgd)), loss_buf_(torch::zeros({1}, torch::kFloat64)) {}

void AllReduceUpdate::start(torch::Tensor& weights) { group_->broadcast(weights, 0); }

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
  double global_loss = weighted_sum(&ctx.grad, ctx.loss, share_);
  if (ctx.before_update) ctx.before_update(global_loss);
  sgd_->step(ctx.weights, ctx.grad, ctx.lr);
  return {global_loss, ctx.global_batch};
}

double AllReduceUpdate::reduce(torch::Tensor* grad, double loss) {
  return weighted_sum(grad, loss, share_);
}

}  // namespace limbo::elastic
