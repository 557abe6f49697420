#include "optim/sgd.h"

#include <cstring>

#include "common/error.h"

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

namespace limbo::optim {

Sgd::Sgd(OptimizerOptions opt) : Optimizer(std::move(opt)) {
  const auto& o = options();
  if (o.nesterov && (o.momentum <= 0 || o.dampening != 0))
    throw InvalidInput("Nesterov momentum needs optim.momentum > 0 and zero dampening");
  if (o.momentum < 0 || o.weight_decay < 0)
    throw InvalidInput("optim.momentum and optim.weight_decay must be >= 0");
}

std::vector<std::string> Sgd::state_names() const {
  if (options().momentum == 0) return {};
  return {"momentum_buffer"};
}

namespace {

struct Coefficients {
  float a, c, mu, keep, o;  // d = a g + c w; v = mu v + keep d; w -= o step
};

// The whole update in one pass over memory (reads w, g and v once, writes w
// and v once), where the same rule as separate tensor operations takes five
// passes: on large models memory bandwidth is what the step costs. Outputs
// may be the inputs (in place): each element is read before it is written.
template <bool Momentum, bool First, bool Nesterov>
__attribute__((optimize("O3"))) uint32_t sgd_pass(const UpdateSlice& s, Coefficients k) {
  uint32_t m = 0;
  float* wo = s.w_out;
  float* vo = s.s_out[0];
  const float* w = s.w;
  const float* g = s.g;
  const float* v = s.s[0];
#pragma GCC ivdep
  for (int64_t i = 0; i < s.n; ++i) {
    m |= nonfinite_bits(g[i]);
    const float d = k.a * g[i] + k.c * w[i];
    float step = d;
    if (Momentum) {
      const float vi = First ? d : k.mu * v[i] + k.keep * d;
      vo[i] = vi;
      step = Nesterov ? d + k.mu * vi : vi;
    }
    wo[i] = w[i] - k.o * step;
  }
  return m;
}

#if defined(__SSE2__)
// The parameter server's update into a new version (w_out is not w): the new
// weights go out with streaming (non-temporal) stores. They are far larger
// than the caches and only read again when sent, so a normal store's
// read-for-ownership would be a wasted third of the memory traffic. The
// momentum, read again next step, is stored normally.
__attribute__((optimize("O3"))) uint32_t sgd_stream_pass(const UpdateSlice& s, Coefficients k) {
  uint32_t m = 0;
  int64_t i = 0;
  float* out = s.w_out;
  float* vout = s.s_out[0];
  const float *w = s.w, *g = s.g, *v = s.s[0];
  auto scalar = [&](int64_t j) {
    m |= nonfinite_bits(g[j]);
    const float d = k.a * g[j] + k.c * w[j];
    const float nv = v ? k.mu * v[j] + k.keep * d : d;
    if (vout) vout[j] = nv;
    out[j] = w[j] - nv;
  };
  for (; i < s.n && (reinterpret_cast<uintptr_t>(out + i) & 15) != 0; ++i) scalar(i);
  const __m128 va = _mm_set1_ps(k.a), vc = _mm_set1_ps(k.c), vm = _mm_set1_ps(k.mu), vk = _mm_set1_ps(k.keep);
  const __m128i exponent = _mm_set1_epi32(0x7f800000), ulp = _mm_set1_epi32(0x00800000);
  __m128i acc = _mm_setzero_si128();
  for (; i + 4 <= s.n; i += 4) {
    const __m128 gv = _mm_loadu_ps(g + i), wv = _mm_loadu_ps(w + i);
    acc = _mm_or_si128(acc, _mm_add_epi32(_mm_and_si128(_mm_castps_si128(gv), exponent), ulp));
    __m128 nv = _mm_add_ps(_mm_mul_ps(va, gv), _mm_mul_ps(vc, wv));
    if (v) nv = _mm_add_ps(_mm_mul_ps(vm, _mm_loadu_ps(v + i)), _mm_mul_ps(vk, nv));
    if (vout) _mm_storeu_ps(vout + i, nv);
    _mm_stream_ps(out + i, _mm_sub_ps(wv, nv));
  }
  _mm_sfence();
  alignas(16) uint32_t lanes[4];
  _mm_store_si128(reinterpret_cast<__m128i*>(lanes), acc);
  m |= lanes[0] | lanes[1] | lanes[2] | lanes[3];
  for (; i < s.n; ++i) scalar(i);
  return m;
}
#endif

}  // namespace

bool Sgd::update(const UpdateSlice& s, const UpdateScalars& k) const {
  const auto& o = options();
  const bool inside = o.lr_in_buffer;
  Coefficients c{inside ? static_cast<float>(k.lr) : 1.0f,
                 static_cast<float>(inside ? k.decay_lr * o.weight_decay : o.weight_decay),
                 static_cast<float>(o.momentum), static_cast<float>(1.0 - o.dampening),
                 inside ? 1.0f : static_cast<float>(k.lr)};
  const bool momentum = o.momentum != 0, first = s.s[0] == nullptr;
#if defined(__SSE2__)
  if (inside && !o.nesterov && s.w_out != s.w) return finite_from_bits(sgd_stream_pass(s, c));
#endif
  uint32_t m;
  if (!momentum) m = sgd_pass<false, false, false>(s, c);
  else if (o.nesterov) m = first ? sgd_pass<true, true, true>(s, c) : sgd_pass<true, false, true>(s, c);
  else m = first ? sgd_pass<true, true, false>(s, c) : sgd_pass<true, false, false>(s, c);
  return finite_from_bits(m);
}

}  // namespace limbo::optim
