#include "ps/shard_state.h"

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <stdexcept>

#include "common/half.h"
#include "ps/protocol.h"

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

namespace limbo::ps {
namespace {

constexpr int64_t kParallelGrain = 1 << 20;  // floats per task of a parallel pass
constexpr size_t kSpareVersions = 4;          // released versions kept for re-use
constexpr size_t kSpareStates = 2;            // released optimizer states kept for re-use

// memcpy with streaming (non-temporal) stores: a learner's copy of the
// weights it pulled is far larger than the caches and is read again only by
// the next forward pass, so a normal store's read-for-ownership would be
// wasted memory traffic.
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

// 16-bit values widened this many at a time: the chunk stays in the cache
// between its widening and its use.
constexpr int64_t kHalfChunk = 8192;

HalfKind kind_of(const GradPart& p) { return p.bf16 ? HalfKind::Bf16 : HalfKind::Fp16; }

// Calls f(o, x, k) over part p's values as floats, x holding its values
// [o, o + k): its own floats at once, or its 16-bit values widened a chunk
// at a time. Stops at the first f that returns false; returns whether none did.
template <class F>
bool for_each_float_run(const GradPart& p, F&& f) {
  if (!p.halves) return f(int64_t{0}, p.data, p.n);
  float wide[kHalfChunk];
  for (int64_t o = 0; o < p.n; o += kHalfChunk) {
    const int64_t k = std::min(kHalfChunk, p.n - o);
    halves_to_floats(kind_of(p), p.halves + o, wide, static_cast<size_t>(k));
    if (!f(o, static_cast<const float*>(wide), k)) return false;
  }
  return true;
}

// NaN or Inf among 16-bit values: the exponent bits all ones (bf16: 8 bits,
// fp16: 5); one exponent ulp more carries into bit 15.
__attribute__((optimize("O3"))) bool halves_finite(const uint16_t* h, size_t n, bool bf16) {
  const uint32_t mask = bf16 ? 0x7f80u : 0x7c00u, ulp = bf16 ? 0x0080u : 0x0400u;
  uint32_t m = 0;
  for (size_t i = 0; i < n; ++i) m |= (h[i] & mask) + ulp;
  return (m & 0x8000u) == 0;
}

bool parts_finite(const std::vector<GradPart>& g) {
  for (const auto& p : g) {
    const bool ok = p.halves ? halves_finite(p.halves, static_cast<size_t>(p.n), p.bf16)
                             : all_finite(p.data, static_cast<size_t>(p.n));
    if (!ok) return false;
  }
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

ShardState::ShardState(int64_t numel, const float* initial, UpdateOptions opt)
    : numel_(numel), alpha0_(opt.alpha0), decay_at_base_rate_(opt.decay_at_base_rate) {
  opt.optimizer.lr_in_buffer = true;  // see the header: the rate scales only its own gradient
  opt_ = optim::make_optimizer(opt.optimizer);
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

bool ShardState::update_range(float* out, const float* w, const float* g, int64_t offset, int64_t n, double lr,
                              const std::vector<torch::Tensor>& state_out) {
  const auto& in = opt_->state();
  const bool have = opt_->has_state();
  const optim::UpdateScalars k{lr, decay_at_base_rate_ ? alpha0_ : lr, opt_->steps() + 1};
  std::atomic<bool> ok{true};
  at::parallel_for(0, n, kParallelGrain, [&](int64_t a, int64_t b) {
    optim::UpdateSlice sl;
    sl.w_out = out + a;
    sl.w = w + a;
    sl.g = g + a;
    for (size_t i = 0; i < state_out.size(); ++i) {
      sl.s_out[i] = state_out[i].data_ptr<float>() + offset + a;
      sl.s[i] = have ? in[i].data_ptr<float>() + offset + a : nullptr;
    }
    sl.n = b - a;
    if (!opt_->update(sl, k)) ok = false;
  });
  return ok;
}

bool ShardState::step_single(const float* g, double alpha) { return step_single({{0, g, numel_}}, alpha); }

bool ShardState::accumulate(const float* g, double alpha) { return accumulate({{0, g, numel_}}, alpha); }

bool ShardState::step_single(const std::vector<GradPart>& g, double alpha) {
  torch::NoGradGuard ng;
  StreamedStep s = begin_step(alpha);
  for (const auto& p : g) step_part(s, p);
  return finish_step(s);
}

bool ShardState::accumulate(const std::vector<GradPart>& g, double alpha) {
  if (!parts_finite(g)) return false;
  torch::NoGradGuard ng;
  for (const auto& p : g)
    for_each_float_run(p, [&](int64_t o, const float* x, int64_t k) {
      accum_.narrow(0, p.offset + o, k).add_(view_of(x, k), alpha);
      return true;
    });
  alpha_sum_ += alpha;
  return true;
}

StreamedStep ShardState::begin_step(double alpha) {
  StreamedStep s;
  s.base = weights_;
  s.next = fresh_version();
  s.alpha = alpha;
  // The new state is written beside the current one, which stays as it is
  // until the step is published (an abandoned step changes nothing). Each
  // step in progress writes buffers of its own: a streamed push and a
  // single step made meanwhile (another learner's push, which may turn out
  // not finite) must never write into the same memory.
  const size_t k = opt_->state_names().size();
  if (!spare_states_.empty()) {
    s.state_next = std::move(spare_states_.back());
    spare_states_.pop_back();
  }
  while (s.state_next.size() < k) s.state_next.push_back(torch::empty({numel_}, torch::kFloat32));
  return s;
}

void ShardState::keep_spare_state(std::vector<torch::Tensor> state) {
  if (!state.empty() && spare_states_.size() < kSpareStates) spare_states_.push_back(std::move(state));
}

void ShardState::step_part(StreamedStep& s, const GradPart& g) {
  if (!s.finite) return;  // the step is lost anyway
  s.finite = for_each_float_run(g, [&](int64_t o, const float* x, int64_t k) {
    const int64_t at = g.offset + o;
    return update_range(s.next->data_ptr<float>() + at, s.base->data_ptr<float>() + at, x, at, k, s.alpha,
                        s.state_next);
  });
}

bool ShardState::finish_step(StreamedStep& s) {
  if (!current(s)) throw std::logic_error("ShardState::finish_step on a step whose base version is no longer current");
  const bool ok = s.finite;
  if (ok) {
    publish(std::move(s.next));
    // The old state becomes a later step's spare (none before the first update).
    if (opt_->has_state()) keep_spare_state(opt_->state());
    opt_->set_state(std::move(s.state_next), opt_->steps() + 1);
  } else {
    abandon(s);
  }
  s = StreamedStep();
  return ok;
}

void ShardState::abandon(StreamedStep& s) {
  if (s.next && spare_.size() < kSpareVersions) spare_.push_back(std::move(s.next));
  keep_spare_state(std::move(s.state_next));
  s = StreamedStep();
}

void ShardState::apply(int64_t k) {
  torch::NoGradGuard ng;
  if (alpha_sum_ > 0) {
    // The alpha-weighted mean gradient at the mean rate: for SGD, rate times
    // gradient is sum alpha_l g_l / k.
    accum_.div_(alpha_sum_);
    const size_t n = opt_->state_names().size();
    std::vector<torch::Tensor> state = opt_->has_state() ? opt_->state() : std::vector<torch::Tensor>();
    for (size_t i = state.size(); i < n; ++i) state.push_back(torch::empty({numel_}, torch::kFloat32));
    auto next = fresh_version();
    update_range(next->data_ptr<float>(), weights_->data_ptr<float>(), accum_.data_ptr<float>(), 0, numel_,
                 alpha_sum_ / static_cast<double>(k), state);
    publish(std::move(next));
    opt_->set_state(std::move(state), opt_->steps() + 1);
  }
  accum_.zero_();
  alpha_sum_ = 0;
}

void ShardState::restore(const float* weights, const std::vector<std::vector<float>>& state, int64_t steps) {
  std::memcpy(weights_->data_ptr<float>(), weights, static_cast<size_t>(numel_) * 4);
  std::vector<torch::Tensor> tensors;
  for (const auto& v : state) {
    torch::Tensor t = torch::empty({numel_}, torch::kFloat32);
    std::memcpy(t.data_ptr<float>(), v.data(), static_cast<size_t>(numel_) * 4);
    tensors.push_back(t);
  }
  // No state: the update count restarts with it (Adam's bias correction
  // at a count of N with zero moments would move the first steps too far).
  const bool none = tensors.empty() && !opt_->state_names().empty();
  opt_->set_state(std::move(tensors), none ? 0 : steps);
  spare_states_.clear();
}

}  // namespace limbo::ps
