#include "elastic/allreduce_update.h"

#include <chrono>
#include <cmath>
#include <cstring>

#include "common/error.h"

namespace limbo::elastic {

AllReduceUpdate::AllReduceUpdate(std::shared_ptr<comm::Collective> group,
                                 std::shared_ptr<train::OptimizerStep> optimizer, optim::FlatParams& flat,
                                 const ReduceOptions& opt)
    : group_(std::move(group)),
      opt_(std::move(optimizer)),
      flat_(flat),
      reducer_(flat, opt.bucket_bytes, opt.overlap, opt.compression, opt.shard_state),
      loss_buf_(torch::zeros({1}, torch::kFloat64)),
      shard_(opt.shard_state),
      home_prefix_(opt.home_prefix),
      stats_(torch::zeros({2}, torch::kFloat32)) {
  reducer_.set_testing_death(opt.testing_die_in_bucket);
  if (shard_ && opt.compression != comm::Compression::None)
    throw InvalidInput("optim.shard_state = true reduce-scatters a float32 gradient; set comm.compression = \"none\"");
  if (group_) set_group(group_);
}

void AllReduceUpdate::set_group(std::shared_ptr<comm::Collective> group) {
  group_ = std::move(group);
  if (!shard_ || !group_) return;
  bounds_ = shard_bounds(flat_.numel(), group_->size());
  reducer_.set_shards(bounds_);
}

ShardHome& AllReduceUpdate::new_home(int64_t round, int states) {
  const int64_t lo = bounds_.at(group_->rank()), hi = bounds_.at(group_->rank() + 1);
  std::string name;
  if (!home_prefix_.empty()) name = home_prefix_ + "m" + std::to_string(member_id_) + "-r" + std::to_string(round);
  if (home_) retired_.push_back(std::move(home_));
  // A round formed again after a failure has the same number: a fresh name.
  for (int k = 0; !name.empty(); ++k) {
    const std::string tried = k == 0 ? name : name + "-" + std::to_string(k);
    bool taken = false;
    for (const auto& h : retired_) taken = taken || h->name() == tried;
    if (!taken) {
      name = tried;
      break;
    }
  }
  home_ = std::make_unique<ShardHome>(name, flat_.numel(), lo, hi, states);
  return *home_;
}

std::vector<ShardHome*> AllReduceUpdate::kept_homes() {
  std::vector<ShardHome*> out;
  if (home_) out.push_back(home_.get());
  for (auto& h : retired_) out.push_back(h.get());
  return out;
}

void AllReduceUpdate::adopt_dead(std::vector<std::unique_ptr<ShardHome>> homes) {
  for (auto& h : homes) {
    bool known = false;
    for (auto* k : kept_homes()) known = known || k->name() == h->name();
    if (!known) retired_.push_back(std::move(h));
  }
}

bool AllReduceUpdate::version_meta(int64_t step, int64_t* optimizer_steps, bool* has_state) {
  const int v = home_ ? home_->version_of(step) : -1;
  if (v < 0) return false;
  *optimizer_steps = home_->optimizer_steps(v);
  *has_state = home_->has_state(v);
  return true;
}

// The home of this member's shard holds committed step `step`; when not
// (the first step of a static group, or after a resume), it is made from
// the optimizer's whole state (or none) and the weights.
void AllReduceUpdate::ensure_home(int64_t step) {
  auto& opt = opt_->optimizer();
  const int states = static_cast<int>(opt.state_names().size());
  if (home_ && home_->version_of(step) >= 0 && home_->lo() == bounds_[group_->rank()] &&
      home_->hi() == bounds_[group_->rank() + 1])
    return;
  const int64_t n = flat_.numel();
  if (opt.has_state() && opt.state()[0].numel() != n)
    throw Error("internal: the optimizer holds a shard of another layout and no home has step " + std::to_string(step));
  ShardHome& h = new_home(0, states);
  const int64_t lo = h.lo(), m = h.size();
  if (opt.has_state())
    for (int i = 0; i < states; ++i) std::memcpy(h.state(0, i), opt.state()[i].data_ptr<float>() + lo, sizeof(float) * m);
  h.commit(0, step, opt.steps(), opt.has_state());
}

void AllReduceUpdate::gather_state(optim::Optimizer& opt, int64_t step, bool here) {
  if (!shard_ || !group_) return;
  // Whether everyone takes part must not depend on this member's own state.
  auto flag = torch::tensor({here ? 1.0f : 0.0f, 1.0f});
  group_->allreduce_sum(flag);
  const bool everywhere = flag[0].item<float>() == flag[1].item<float>();
  if (gathered_everywhere_ == step) return;
  ensure_home(step);
  const int v = home_->version_of(step);
  const int states = static_cast<int>(opt.state_names().size());
  const int64_t n = flat_.numel(), lo = home_->lo(), hi = home_->hi();
  if (!home_->has_state(v)) {
    opt.set_state({}, home_->optimizer_steps(v));
  } else {
    std::vector<torch::Tensor> whole;
    if (here)
      for (int i = 0; i < states; ++i) whole.push_back(torch::empty({n}, torch::kFloat32));
    const int64_t piece = 1 << 20;  // floats
    auto buf = torch::empty({std::min(piece, n)}, torch::kFloat32);
    float* b = buf.data_ptr<float>();
    for (int i = 0; i < states; ++i)
      for (int64_t at = 0; at < n; at += piece) {
        const int64_t m = std::min(piece, n - at);
        auto part = buf.narrow(0, 0, m);
        part.fill_(-0.0f);
        const int64_t a = std::max(at, lo), e = std::min(at + m, hi);
        if (e > a) std::memcpy(b + (a - at), home_->state(v, i) + (a - lo), sizeof(float) * (e - a));
        group_->allreduce_sum(part);
        if (here) std::memcpy(whole[i].data_ptr<float>() + at, b, sizeof(float) * m);
      }
    if (here) opt.set_state(std::move(whole), home_->optimizer_steps(v));
  }
  if (everywhere) gathered_everywhere_ = step;
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
  if (shard_) {
    // The gradient's sum came from every member: each finished the state
    // sync before this step, so the homes kept for a retried sync can go.
    drop_retired();
    return apply_shard(ctx, global_loss);
  }
  if (!reducer_.finite()) return {global_loss, ctx.global_batch, /*skipped=*/true};
  if (ctx.before_update) ctx.before_update(global_loss);
  const auto t0 = std::chrono::steady_clock::now();
  opt_->apply(ctx.weights, ctx.grad, ctx.lr);
  update_seconds_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  updates_ += 1;
  return {global_loss, ctx.global_batch};
}

// This member's shard: agree on finiteness and the norm (one small
// all-reduce), clip, update into the home's other version, all-gather.
train::StepResult AllReduceUpdate::apply_shard(train::StepContext& ctx, double global_loss) {
  torch::NoGradGuard no_grad;
  const int64_t k = ctx.iteration;
  ensure_home(k);
  ShardHome& h = *home_;
  const int cur = h.version_of(k), next = 1 - cur;
  const int64_t lo = h.lo(), m = h.size();
  auto g = ctx.grad.narrow(0, lo, m);
  auto& opt = opt_->optimizer();
  const int states = h.states();
  const bool clip = opt_->clip_norm() > 0;
  h.begin(next);
  // Clipping needs the global norm before the update: the shards' squared
  // norms are summed (a square that is not finite makes the sum so).
  // Without clipping the update runs first, into the next version (nothing
  // committed is touched), and reports whether its gradient was finite.
  float* st = stats_.data_ptr<float>();
  st[0] = st[1] = 0.0f;
  if (clip && m > 0) st[1] = static_cast<float>(g.square().sum().item<double>());
  const auto t_update = std::chrono::steady_clock::now();
  float coef = 1.0f;
  if (clip) {
    group_->allreduce_sum(stats_);
    const double norm = std::sqrt(static_cast<double>(st[1]));
    opt_->set_last_norm(norm);
    coef = static_cast<float>(opt_->clip_norm()) / (static_cast<float>(norm) + 1e-6f);
    if (!std::isfinite(norm)) st[0] = 1.0f;
  }
  bool finite = reducer_.finite() && st[0] == 0;
  if (finite) {
    if (coef < 1.0f) g.mul_(coef);
    std::vector<const float*> in;
    std::vector<float*> out;
    for (int i = 0; i < states; ++i) {
      out.push_back(h.state(next, i));
      if (h.has_state(cur)) in.push_back(h.state(cur, i));
    }
    opt.set_state({}, h.optimizer_steps(cur));
    // The new weights of the shard go into the gradient's place (each
    // element is read before it is written), to be all-gathered there.
    const bool mine = opt.step_into(ctx.weights.data_ptr<float>() + lo, g.data_ptr<float>(), g.data_ptr<float>(),
                                    in, out, m, ctx.lr);
    if (!clip) {  // every member's verdict on its own shard
      st[0] = mine ? 0.0f : 1.0f;
      group_->allreduce_sum(stats_);
      finite = st[0] == 0;
    }
  }
  if (!finite) {  // skipped everywhere: the next version repeats this one
    if (states > 0) std::memcpy(h.state(next, 0), h.state(cur, 0), static_cast<size_t>(h.version_bytes()));
    h.commit(next, k + 1, h.optimizer_steps(cur), h.has_state(cur));
    std::vector<torch::Tensor> views;
    if (h.has_state(cur))
      for (int i = 0; i < states; ++i) views.push_back(torch::from_blob(h.state(next, i), {m}, torch::kFloat32));
    opt.set_state(std::move(views), h.optimizer_steps(cur));
    return {global_loss, ctx.global_batch, /*skipped=*/true};
  }
  if (ctx.before_update) ctx.before_update(global_loss);
  h.commit(next, k + 1, opt.steps(), states > 0);
  // The optimizer's state is this shard's (views of the home).
  std::vector<torch::Tensor> views;
  for (int i = 0; i < states; ++i) views.push_back(torch::from_blob(h.state(next, i), {m}, torch::kFloat32));
  opt.set_state(std::move(views), opt.steps());
  // The whole weights change only once every shard is here: until then a
  // failure leaves them at step k on this member.
  const auto t_gather = std::chrono::steady_clock::now();
  group_->all_gather(ctx.grad, bounds_);
  ctx.weights.copy_(ctx.grad);
  weights_step_ = k + 1;
  const auto t_end = std::chrono::steady_clock::now();
  update_seconds_ += std::chrono::duration<double>(t_gather - t_update).count();
  gather_seconds_ += std::chrono::duration<double>(t_end - t_gather).count();
  updates_ += 1;
  return {global_loss, ctx.global_batch};
}

void AllReduceUpdate::testing_drop_kept_state() {
  for (auto* h : kept_homes()) h->unlink();
}

void AllReduceUpdate::drop_retired() {
  for (auto& h : retired_) h->unlink();
  retired_.clear();
}

nlohmann::json AllReduceUpdate::summary() const {
  const auto& st = reducer_.stats();
  const double steps = std::max<int64_t>(st.steps, 1);
  nlohmann::json out = {{"buckets", reducer_.buckets().size()},
          {"overlap", reducer_.overlapped()},
          {"buckets_started_in_backward", st.buckets_started_in_backward},
          {"exposed_communication_ms_per_step", 1000.0 * st.exposed_seconds / steps}};
  // The optimizer's step (sharded: this member's shard, with its share of
  // clipping), and the weights' all-gather after it.
  if (updates_ > 0) out["update_ms_per_step"] = 1000.0 * update_seconds_ / updates_;
  if (shard_ && updates_ > 0) out["all_gather_ms_per_step"] = 1000.0 * gather_seconds_ / updates_;
  return out;
}

}  // namespace limbo::elastic
