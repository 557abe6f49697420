// The fully sharded mode of AllReduceUpdate (optim.shard_weights,
// limbo.Job(shard="full")): the weights in the homes, units gathered through
// the collectives' queue, buckets given back as backward reduces them
// (elastic/allreduce_update.h, docs/sharded_state.md).
#include <fcntl.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <thread>

#include "comm/shm_group.h"
#include "common/error.h"
#include "common/log.h"
#include "elastic/allreduce_update.h"
#include "train/checkpoint.h"

namespace limbo::elastic {

void AllReduceUpdate::ready_weights(int64_t step) {
  gather_error_ = commit_error_;  // the last commit's second barrier failed: this step fails at once
  commit_error_ = nullptr;
  queue_.reset();
  if (!full_ || !group_) return;
  if (!gather_error_) ensure_home(step);
  weights_at_ = step;
  if (weights_whole_) {
    flat_.release_weights(0, flat_.numel());
    weights_whole_ = false;
  }
}

void AllReduceUpdate::before_forward(int64_t step) {
  if (!full_) return;
  ready_weights(step);
  gather_weights(0, flat_.numel());
}

void AllReduceUpdate::weights_resharded(int64_t step) {
  weights_at_ = step;
  if (weights_whole_) {  // this member's own weights, not the group's: given back
    flat_.release_weights(0, flat_.numel());
    weights_whole_ = false;
  }
}

void AllReduceUpdate::gather_weights(int64_t a, int64_t b) { wait_gather(issue_gather(a, b)); }

int64_t AllReduceUpdate::issue_gather(int64_t a, int64_t b) {
  if (!full_ || weights_whole_ || b <= a || !home_ || !group_ || gather_error_) return -1;
  const int v = home_->version_of(weights_at_);
  if (v < 0) throw Error("internal: this member's home has no weights of step " + std::to_string(weights_at_));
  // What the job needs, taken now: the group and the home are this step's.
  const float* src = home_->state(v, 0);
  const int64_t hlo = home_->lo(), hhi = home_->hi();
  float* w = flat_.data().data_ptr<float>();
  std::vector<int64_t> rel;
  for (int64_t x : bounds_) rel.push_back(std::clamp(x, a, b) - a);
  return queue_.push([g = group_, src, hlo, hhi, w, a, b, rel = std::move(rel)] {
    const int64_t lo = std::max(a, hlo), hi = std::min(b, hhi);
    if (hi > lo) std::memcpy(w + lo, src + (lo - hlo), sizeof(float) * (hi - lo));
    auto part = torch::from_blob(w + a, {b - a}, torch::kFloat32);
    g->all_gather(part, rel);
  });
}

void AllReduceUpdate::wait_gather(int64_t ticket) {
  if (ticket < 0) return;
  queue_.wait(ticket);
  if (!gather_error_) gather_error_ = queue_.error();  // apply() fails the step with it
}

void AllReduceUpdate::release_weights(int64_t a, int64_t b) {
  if (full_ && !weights_whole_) flat_.release_weights(a, b);
}

void AllReduceUpdate::gather_all_weights() {
  if (!full_ || weights_whole_ || !home_) return;
  gather_weights(0, flat_.numel());
  if (gather_error_) {  // a collective of the caller's (a checkpoint's gather): it fails with it
    auto e = gather_error_;
    gather_error_ = nullptr;
    std::rethrow_exception(e);
  }
  weights_whole_ = true;
}

void AllReduceUpdate::bucket_reduced(int64_t a, int64_t b) {
  // What this member keeps of the gradient: its shard and the shards it
  // keeps copies of (across hosts the bucket was all-reduced, so theirs
  // are here too).
  std::vector<std::pair<int64_t, int64_t>> keep;
  if (group_ && !bounds_.empty()) {
    keep.push_back({bounds_[group_->rank()], bounds_[group_->rank() + 1]});
    for (int r : copy_ranks_) keep.push_back({bounds_[r], bounds_[r + 1]});
  }
  std::sort(keep.begin(), keep.end());
  int64_t at = a;
  for (const auto& [x, y] : keep) {
    if (y <= at || x >= b) continue;
    if (x > at) flat_.release_grad(at, x);
    at = std::max(at, y);
  }
  if (at < b) flat_.release_grad(at, b);
  release_weights(a, b);
}

// The commit of a step with sharded weights, through the homes' logs (one
// version of the weights and the state a home, not two):
//
//   1. every member writes the log of each home it keeps (its own shard,
//      and its copies of another host's): its shard of the reduced,
//      clipped gradient, the rate, whether the step is skipped;
//   2. barrier 1 (a small all-reduce). A member that passes it knows every
//      log of the step is written: the step is committed on it (apply()
//      returns it whatever happens next, and a state sync it takes part in
//      takes this step);
//   3. barrier 2. A member that passes it knows every member passed
//      barrier 1, so every member that survives takes this step in any
//      sync: only now does it update its homes in place from their logs.
//
// So a home is updated in place only where the step cannot be undone, and
// an update cut short (a death, the second barrier failing) is finished
// from the log by whoever holds the home next (settle_logs(), before a
// sync). A member that fails before passing barrier 1 redoes the step; no
// home was touched anywhere, since no member passed barrier 2.
train::StepResult AllReduceUpdate::apply_logged(train::StepContext& ctx, double global_loss,
                                                const std::vector<ShardHome*>& homes, float coef, bool finite) {
  const auto t0 = std::chrono::steady_clock::now();
  const int64_t k = ctx.iteration;
  for (ShardHome* x : homes) {
    x->begin_log();
    if (finite) {
      auto g = ctx.grad.narrow(0, x->lo(), x->size());
      auto log = torch::from_blob(x->log(), {x->size()}, torch::kFloat32);
      if (coef < 1.0f)
        torch::mul_out(log, g, coef);
      else
        log.copy_(g);
    }
    x->log_written(k + 1, ctx.lr, !finite);
    flat_.release_grad(x->lo(), x->hi());  // the log holds it now
  }
  maybe_die_in_commit("logged", k);
  float* st = stats_.data_ptr<float>();
  st[0] = st[1] = 0.0f;
  group_->allreduce_sum(stats_);  // barrier 1: a failure here redoes the step
  maybe_die_in_commit("barrier1", k);
  if (finite && ctx.before_update) ctx.before_update(global_loss);
  try {
    st[0] = st[1] = 0.0f;
    group_->allreduce_sum(stats_);  // barrier 2
  } catch (const Error& e) {
    // The step counts (barrier 1 passed), but another member may not have
    // passed barrier 1: the homes keep its log, and the next step fails at
    // its first gather, for the group to re-form and settle the logs.
    log_warn(std::string("the commit of step ") + std::to_string(k + 1) + " did not finish on every member (" +
             e.what() + "); the group re-forms at the next step");
    commit_error_ = std::current_exception();
    weights_at_ = k + 1;
    return {global_loss, ctx.global_batch, /*skipped=*/!finite};
  }
  for (ShardHome* x : homes) roll_forward(*x, k + 1);
  auto& opt = opt_->optimizer();
  const int first = first_state_slot();
  std::vector<torch::Tensor> views;
  if (home_->has_state(0))
    for (int i = first; i < home_->states(); ++i)
      views.push_back(torch::from_blob(home_->state(0, i), {home_->size()}, torch::kFloat32));
  opt.set_state(std::move(views), home_->optimizer_steps(0));
  weights_at_ = k + 1;
  update_seconds_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  if (finite) updates_ += 1;
  return {global_loss, ctx.global_batch, /*skipped=*/!finite};
}

bool AllReduceUpdate::write_shards(const std::string& path, int64_t step) {
  if (!full_ || !group_) return false;
  auto flag = torch::tensor({path.empty() ? 1.0f : 0.0f});
  group_->allreduce_sum(flag);  // alike on every member
  if (flag.item<float>() > 0) return false;
  ensure_home(step);
  const auto names = opt_->optimizer().state_names();
  std::vector<std::pair<int, ShardHome*>> held{{group_->rank(), home_.get()}};
  for (size_t i = 0; i < copies_.size(); ++i) held.push_back({copy_ranks_[i], copies_[i].get()});
  for (const auto& [r, h] : held) {
    const int v = h->version_of(step);
    if (v < 0) throw Error("internal: a shard home without step " + std::to_string(step) + " for a checkpoint");
    std::vector<const float*> state;
    if (h->has_state(v))
      for (int i = first_state_slot(); i < h->states(); ++i) state.push_back(h->state(v, i));
    train::save_shard(train::shard_file(path, r, group_->size(), step), h->lo(), h->hi(), h->n(), step, h->state(v, 0),
                      names, state, h->optimizer_steps(v));
  }
  flag.zero_();
  group_->allreduce_sum(flag);  // every shard is on its disk before the checkpoint's file names them
  return true;
}

void AllReduceUpdate::drop_saved_state() {
  if (!full_) return;
  for (ShardHome* h : kept_homes()) h->drop_state();
  opt_->optimizer().set_state({}, opt_->optimizer().steps());
}

void AllReduceUpdate::give_back_retired(ShardHome::Part part) {
  if (!full_) return;
  for (auto& h : retired_)
    if (h->logged() && h->owner() == ::getpid()) h->give_back(part);
}

void AllReduceUpdate::give_back_logs() {
  if (!full_) return;
  // A step cut short leaves pages of the flat weights and gradient that
  // its gathers and buckets touched: the new group gathers again.
  if (!weights_whole_) {
    flat_.release_weights(0, flat_.numel());
    flat_.release_grad(0, flat_.numel());
  }
  for (ShardHome* h : kept_homes())
    if (h->logged() && h->owner() == ::getpid()) h->give_back(ShardHome::kLog);
}

void AllReduceUpdate::maybe_die_in_commit(const std::string& where, int64_t iteration) {
  const auto& d = die_in_commit_;
  if (d.where != where || d.iteration != iteration || !group_ || group_->size() < 2 || group_->rank() != d.rank)
    return;
  const int fd = ::open(d.marker.c_str(), O_CREAT | O_EXCL | O_WRONLY, 0644);
  if (fd < 0) return;  // once a job
  const std::string line = std::to_string(::getpid()) + " commit_" + where + "\n";
  if (::write(fd, line.data(), line.size()) < 0) {
  }
  ::close(fd);
  ::raise(d.freeze ? SIGSTOP : SIGKILL);
}

bool AllReduceUpdate::roll_forward(ShardHome& h, int64_t step) {
  auto& opt = opt_->optimizer();
  const int first = first_state_slot();
  int chunks = 0;
  return h.roll_forward(
      step,
      [&](int64_t a, int64_t b, int64_t optimizer_steps, bool has_state, double lr, const std::vector<float*>& out) {
        if (&h == home_.get() && ++chunks == 3) maybe_die_in_commit("update", step - 1);
        std::vector<const float*> in;
        std::vector<float*> st_out;
        for (int i = first; i < h.states(); ++i) {
          if (has_state) in.push_back(h.state(0, i) + a);
          st_out.push_back(out[static_cast<size_t>(i)]);
        }
        opt.set_state({}, optimizer_steps);
        opt.step_into(h.state(0, 0) + a, out[0], h.log() + a, in, st_out, b - a, lr);
      },
      /*first_state_is_weights=*/first == 1);
}

void AllReduceUpdate::settle_logs(int64_t step) {
  if (!full_) return;
  for (ShardHome* h : kept_homes()) {
    if (!h->logged() || h->version_of(step) >= 0 || h->log_step() != step) continue;
    const pid_t owner = h->owner();
    if (owner != ::getpid() && comm::process_alive(owner)) {
      // Frozen, or out of the round: it passed the commit's second barrier
      // and could go on updating its home while it is read.
      log_warn("the home " + h->name() + " holds step " + std::to_string(step) + "'s update cut short and its owner (pid " +
               std::to_string(owner) + ") is out of the group but alive: it is stopped (SIGKILL) before the update is finished here");
      ::kill(owner, SIGKILL);
      for (int i = 0; i < 5000 && comm::process_alive(owner); ++i) std::this_thread::sleep_for(std::chrono::milliseconds(1));
      if (comm::process_alive(owner)) continue;  // left alone: the shard comes from another holder, or is lost
    }
    roll_forward(*h, step);
  }
}

}  // namespace limbo::elastic
