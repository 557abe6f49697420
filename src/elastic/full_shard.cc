// The fully sharded mode of AllReduceUpdate (optim.shard_weights,
// limbo.Job(shard="full")): the weights in the homes, units gathered through
// the collectives' queue, buckets given back as backward reduces them
// (elastic/allreduce_update.h, docs/sharded_state.md).
#include <algorithm>
#include <cstring>

#include "common/error.h"
#include "elastic/allreduce_update.h"

namespace limbo::elastic {

void AllReduceUpdate::ready_weights(int64_t step) {
  gather_error_ = nullptr;
  queue_.reset();
  if (!full_ || !group_) return;
  ensure_home(step);
  weights_at_ = step;
  if (weights_whole_) {
    flat_.release_weights(0, flat_.numel());
    weights_whole_ = false;
  }
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

}  // namespace limbo::elastic
