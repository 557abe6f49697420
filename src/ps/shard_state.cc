#include "ps/shard_state.h"

#include <atomic>
#include <cstring>

#include "ps/protocol.h"

namespace limbo::ps {
namespace {

constexpr int64_t kParallelGrain = 1 << 20;  // floats per task of a parallel pass

// out = w - alpha * g in one pass that also checks g (see all_finite()).
__attribute__((optimize("O3"))) bool fused_sgd_chunk(float* __restrict out, const float* __restrict w,
                                                     const float* __restrict g, float alpha, size_t n) {
  // (exponent bits + 1 ulp of exponent) sets bit 31 only for all-ones
  // exponents; an OR of that vectorises with plain SSE2.
  uint32_t m = 0;
  for (size_t i = 0; i < n; ++i) {
    uint32_t u;
    std::memcpy(&u, g + i, 4);
    m |= (u & 0x7f800000u) + 0x00800000u;
    out[i] = w[i] - alpha * g[i];
  }
  return (m & 0x80000000u) == 0;
}

// Large slices are split over the intra-op threads.
bool fused_sgd_step(float* out, const float* w, const float* g, float alpha, size_t n) {
  std::atomic<bool> ok{true};
  at::parallel_for(0, static_cast<int64_t>(n), kParallelGrain, [&](int64_t a, int64_t b) {
    if (!fused_sgd_chunk(out + a, w + a, g + a, alpha, static_cast<size_t>(b - a))) ok = false;
  });
  return ok;
}

torch::Tensor view_of(const float* g, int64_t n) {
  return torch::from_blob(const_cast<float*>(g), {n}, torch::kFloat32);
}

}  // namespace

void copy_floats(float* dst, const void* src, size_t bytes) {
  const auto* from = static_cast<const unsigned char*>(src);
  auto* to = reinterpret_cast<unsigned char*>(dst);
  at::parallel_for(0, static_cast<int64_t>(bytes), 4 * kParallelGrain, [&](int64_t a, int64_t b) {
    std::memcpy(to + a, from + a, static_cast<size_t>(b - a));
  });
}

ShardState::ShardState(int64_t numel, const float* initial, UpdateOptions opt) : numel_(numel), opt_(opt) {
  weights_ = std::make_shared<torch::Tensor>(torch::empty({numel}, torch::kFloat32));
  std::memcpy(weights_->data_ptr<float>(), initial, static_cast<size_t>(numel) * 4);
  accum_ = torch::zeros({numel}, torch::kFloat32);
}

std::shared_ptr<torch::Tensor> ShardState::fresh_version() {
  for (auto it = spare_.begin(); it != spare_.end(); ++it) {
    if (it->use_count() == 1) {
      auto t = std::move(*it);
      spare_.erase(it);
      return t;
    }
  }
  return std::make_shared<torch::Tensor>(torch::empty({numel_}, torch::kFloat32));
}

void ShardState::publish(std::shared_ptr<torch::Tensor> next) {
  if (spare_.size() < 4) spare_.push_back(weights_);
  weights_ = std::move(next);
}

bool ShardState::step_single(const float* g, double alpha) {
  torch::NoGradGuard ng;
  auto next = fresh_version();
  if (opt_.momentum == 0 && opt_.weight_decay == 0) {
    if (!fused_sgd_step(next->data_ptr<float>(), weights_->data_ptr<float>(), g, static_cast<float>(alpha),
                        static_cast<size_t>(numel_))) {
      spare_.push_back(std::move(next));
      return false;
    }
  } else {
    if (!all_finite(g, static_cast<size_t>(numel_))) {
      spare_.push_back(std::move(next));
      return false;
    }
    torch::Tensor d = view_of(g, numel_).mul(alpha);
    if (opt_.weight_decay != 0) d.add_(*weights_, opt_.alpha0 * opt_.weight_decay);
    if (!momentum_.defined()) momentum_ = d;
    else momentum_.mul_(opt_.momentum).add_(d);
    torch::sub_out(*next, *weights_, momentum_);
  }
  publish(std::move(next));
  return true;
}

bool ShardState::accumulate(const float* g, double alpha) {
  if (!all_finite(g, static_cast<size_t>(numel_))) return false;
  torch::NoGradGuard ng;
  accum_.add_(view_of(g, numel_), alpha);
  return true;
}

void ShardState::apply(int64_t k) {
  torch::NoGradGuard ng;
  accum_.div_(static_cast<double>(k));
  if (opt_.weight_decay != 0) accum_.add_(*weights_, opt_.alpha0 * opt_.weight_decay);
  torch::Tensor step = accum_;
  if (opt_.momentum != 0) {
    if (!momentum_.defined()) momentum_ = accum_.clone();
    else momentum_.mul_(opt_.momentum).add_(accum_);
    step = momentum_;
  }
  auto next = fresh_version();
  torch::sub_out(*next, *weights_, step);
  publish(std::move(next));
  accum_.zero_();
}

void ShardState::restore(const float* weights, const float* momentum) {
  std::memcpy(weights_->data_ptr<float>(), weights, static_cast<size_t>(numel_) * 4);
  if (momentum) {
    momentum_ = torch::empty({numel_}, torch::kFloat32);
    std::memcpy(momentum_.data_ptr<float>(), momentum, static_cast<size_t>(numel_) * 4);
  } else {
    momentum_ = torch::Tensor();
  }
}

}  // namespace limbo::ps
