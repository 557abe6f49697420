#include "ps/shard_state.h"

#include <atomic>
#include <cstdint>
#include <cstring>
#include <stdexcept>

#include "ps/protocol.h"

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

namespace limbo::ps {
namespace {

constexpr int64_t kParallelGrain = 1 << 20;  // floats per task of a parallel pass
constexpr size_t kSpareVersions = 4;          // released versions kept for re-use

#if defined(__SSE2__)
// Ends a pass of streaming stores and folds the per-lane exponent checks.
inline uint32_t finish_stream(__m128i acc) {
  _mm_sfence();
  alignas(16) uint32_t lanes[4];
  _mm_store_si128(reinterpret_cast<__m128i*>(lanes), acc);
  return lanes[0] | lanes[1] | lanes[2] | lanes[3];
}
#endif

// out = w - alpha * g in one pass that also checks g (see all_finite()).
// The new version is written with streaming (non-temporal) stores where the
// CPU has them: it is far larger than the caches and is only read again when
// it is sent, so reading its old contents first (a normal store's
// read-for-ownership) would be a wasted third of the memory traffic.
__attribute__((optimize("O3"))) bool fused_sgd_chunk(float* __restrict out, const float* __restrict w,
                                                     const float* __restrict g, float alpha, size_t n) {
  // (exponent bits + 1 ulp of exponent) sets bit 31 only for all-ones
  // exponents; an OR of that vectorises with plain SSE2.
  uint32_t m = 0;
  size_t i = 0;
  auto scalar = [&](size_t k) {
    uint32_t u;
    std::memcpy(&u, g + k, 4);
    m |= (u & 0x7f800000u) + 0x00800000u;
    out[k] = w[k] - alpha * g[k];
  };
#if defined(__SSE2__)
  for (; i < n && (reinterpret_cast<uintptr_t>(out + i) & 15) != 0; ++i) scalar(i);
  const __m128 va = _mm_set1_ps(alpha);
  const __m128i exponent = _mm_set1_epi32(0x7f800000), ulp = _mm_set1_epi32(0x00800000);
  __m128i acc = _mm_setzero_si128();
  for (; i + 4 <= n; i += 4) {
    const __m128 gv = _mm_loadu_ps(g + i);
    acc = _mm_or_si128(acc, _mm_add_epi32(_mm_and_si128(_mm_castps_si128(gv), exponent), ulp));
    _mm_stream_ps(out + i, _mm_sub_ps(_mm_loadu_ps(w + i), _mm_mul_ps(va, gv)));
  }
  m |= finish_stream(acc);
#endif
  for (; i < n; ++i) scalar(i);
  return (m & 0x80000000u) == 0;
}

// memcpy with streaming stores (see above); a learner's copy of the weights
// it pulled is read again only by the next forward pass.
void stream_copy(unsigned char* __restrict to, const unsigned char* __restrict from, size_t n) {
  size_t i = 0;
#if defined(__SSE2__)
  const size_t head = (16 - (reinterpret_cast<uintptr_t>(to) & 15)) & 15;
  if (n >= 4096 + head) {
    std::memcpy(to, from, head);
    i = head;
    for (; i + 64 <= n; i += 64) {
      const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(from + i));
      const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(from + i + 16));
      const __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(from + i + 32));
      const __m128i d = _mm_loadu_si128(reinterpret_cast<const __m128i*>(from + i + 48));
      _mm_stream_si128(reinterpret_cast<__m128i*>(to + i), a);
      _mm_stream_si128(reinterpret_cast<__m128i*>(to + i + 16), b);
      _mm_stream_si128(reinterpret_cast<__m128i*>(to + i + 32), c);
      _mm_stream_si128(reinterpret_cast<__m128i*>(to + i + 48), d);
    }
    _mm_sfence();
  }
#endif
  std::memcpy(to + i, from + i, n - i);
}

// With weight decay and/or momentum, in one pass that also checks g:
//   d = alpha g + decay w;  v' = mu v + d (v' = d on the first step);
//   out = w - v'           (out = w - d without momentum).
__attribute__((optimize("O3"))) bool fused_momentum_chunk(float* __restrict out, float* __restrict vout,
                                                          const float* __restrict w, const float* __restrict v,
                                                          const float* __restrict g, float alpha, float decay,
                                                          float mu, size_t n) {
  uint32_t m = 0;
  size_t i = 0;
  auto scalar = [&](size_t k) {
    uint32_t u;
    std::memcpy(&u, g + k, 4);
    m |= (u & 0x7f800000u) + 0x00800000u;
    const float d = alpha * g[k] + decay * w[k];
    const float nv = v ? mu * v[k] + d : d;
    if (vout) vout[k] = nv;
    out[k] = w[k] - nv;
  };
#if defined(__SSE2__)
  // As fused_sgd_chunk: the new version goes out with streaming stores (the
  // momentum, read again next step, with normal ones).
  for (; i < n && (reinterpret_cast<uintptr_t>(out + i) & 15) != 0; ++i) scalar(i);
  const __m128 va = _mm_set1_ps(alpha), vd = _mm_set1_ps(decay), vm = _mm_set1_ps(mu);
  const __m128i exponent = _mm_set1_epi32(0x7f800000), ulp = _mm_set1_epi32(0x00800000);
  __m128i acc = _mm_setzero_si128();
  for (; i + 4 <= n; i += 4) {
    const __m128 gv = _mm_loadu_ps(g + i), wv = _mm_loadu_ps(w + i);
    acc = _mm_or_si128(acc, _mm_add_epi32(_mm_and_si128(_mm_castps_si128(gv), exponent), ulp));
    __m128 nv = _mm_add_ps(_mm_mul_ps(va, gv), _mm_mul_ps(vd, wv));
    if (v) nv = _mm_add_ps(_mm_mul_ps(vm, _mm_loadu_ps(v + i)), nv);
    if (vout) _mm_storeu_ps(vout + i, nv);
    _mm_stream_ps(out + i, _mm_sub_ps(wv, nv));
  }
  m |= finish_stream(acc);
#endif
  for (; i < n; ++i) scalar(i);
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

bool parts_finite(const std::vector<GradPart>& g) {
  for (const auto& p : g)
    if (!all_finite(p.data, static_cast<size_t>(p.n))) return false;
  return true;
}

torch::Tensor view_of(const float* g, int64_t n) {
  return torch::from_blob(const_cast<float*>(g), {n}, torch::kFloat32);
}

}  // namespace

void copy_floats(float* dst, const void* src, size_t bytes) {
  const auto* from = static_cast<const unsigned char*>(src);
  auto* to = reinterpret_cast<unsigned char*>(dst);
  at::parallel_for(0, static_cast<int64_t>(bytes), 4 * kParallelGrain, [&](int64_t a, int64_t b) {
    stream_copy(to + a, from + a, static_cast<size_t>(b - a));
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
  if (spare_.size() < kSpareVersions) spare_.push_back(weights_);
  weights_ = std::move(next);
}

bool ShardState::step_single(const float* g, double alpha) { return step_single({{0, g, numel_}}, alpha); }

bool ShardState::accumulate(const float* g, double alpha) { return accumulate({{0, g, numel_}}, alpha); }

bool ShardState::step_single(const std::vector<GradPart>& g, double alpha) {
  torch::NoGradGuard ng;
  if (streams()) {
    StreamedStep s = begin_step(alpha);
    for (const auto& p : g) step_part(s, p);
    return finish_step(s);
  }
  if (!parts_finite(g)) return false;
  torch::Tensor d = torch::empty({numel_}, torch::kFloat32);
  for (const auto& p : g) {
    torch::Tensor slice = d.narrow(0, p.offset, p.n);
    torch::mul_out(slice, view_of(p.data, p.n), torch::scalar_tensor(alpha));
  }
  if (opt_.weight_decay != 0) d.add_(*weights_, opt_.alpha0 * opt_.weight_decay);
  if (!momentum_.defined()) momentum_ = d;
  else momentum_.mul_(opt_.momentum).add_(d);
  auto next = fresh_version();
  torch::sub_out(*next, *weights_, momentum_);
  publish(std::move(next));
  return true;
}

bool ShardState::accumulate(const std::vector<GradPart>& g, double alpha) {
  if (!parts_finite(g)) return false;
  torch::NoGradGuard ng;
  for (const auto& p : g) accum_.narrow(0, p.offset, p.n).add_(view_of(p.data, p.n), alpha);
  return true;
}

StreamedStep ShardState::begin_step(double alpha) {
  StreamedStep s;
  s.base = weights_;
  s.next = fresh_version();
  s.alpha = static_cast<float>(alpha);
  if (opt_.momentum != 0) {
    // The new momentum is written beside the current one, which stays as it
    // is until the step is published (an abandoned step changes nothing).
    if (!spare_momentum_.defined()) spare_momentum_ = torch::empty({numel_}, torch::kFloat32);
    s.momentum_next = spare_momentum_;
  }
  return s;
}

void ShardState::step_part(StreamedStep& s, const GradPart& g) {
  if (!s.finite) return;  // the step is lost anyway
  const size_t n = static_cast<size_t>(g.n);
  float* out = s.next->data_ptr<float>() + g.offset;
  const float* w = s.base->data_ptr<float>() + g.offset;
  if (opt_.momentum == 0 && opt_.weight_decay == 0) {
    s.finite = fused_sgd_step(out, w, g.data, s.alpha, n);
    return;
  }
  float* vout = s.momentum_next.defined() ? s.momentum_next.data_ptr<float>() + g.offset : nullptr;
  const float* v = vout && momentum_.defined() ? momentum_.data_ptr<float>() + g.offset : nullptr;
  const float decay = static_cast<float>(opt_.alpha0 * opt_.weight_decay);
  const float mu = static_cast<float>(opt_.momentum);
  std::atomic<bool> ok{true};
  at::parallel_for(0, static_cast<int64_t>(n), kParallelGrain, [&](int64_t a, int64_t b) {
    if (!fused_momentum_chunk(out + a, vout ? vout + a : nullptr, w + a, v ? v + a : nullptr, g.data + a, s.alpha,
                              decay, mu, static_cast<size_t>(b - a)))
      ok = false;
  });
  s.finite = ok;
}

bool ShardState::finish_step(StreamedStep& s) {
  if (!current(s)) throw std::logic_error("ShardState::finish_step on a step whose base version is no longer current");
  const bool ok = s.finite;
  if (ok) {
    publish(std::move(s.next));
    if (s.momentum_next.defined()) {
      spare_momentum_ = momentum_;  // undefined after the first step: allocated again
      momentum_ = s.momentum_next;
    }
  } else {
    abandon(s);
  }
  s = StreamedStep();
  return ok;
}

void ShardState::abandon(StreamedStep& s) {
  if (s.next && spare_.size() < kSpareVersions) spare_.push_back(std::move(s.next));
  s = StreamedStep();
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
