#include "common/half.h"

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace limbo {

float fp16_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu, man = h & 0x3ffu, u;
  if (exp == 0x1f) {
    u = sign | 0x7f800000u | (man << 13);  // infinity or NaN
  } else if (exp != 0) {
    u = sign | ((exp + 112) << 23) | (man << 13);  // rebias 15 -> 127
  } else if (man == 0) {
    u = sign;  // zero
  } else {     // subnormal: normalise
    int e = -1;
    do {
      man <<= 1;
      ++e;
    } while (!(man & 0x400u));
    u = sign | (static_cast<uint32_t>(112 - e) << 23) | ((man & 0x3ffu) << 13);
  }
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

uint16_t float_to_fp16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  const uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  const uint32_t abs = u & 0x7fffffffu;
  if (abs > 0x7f800000u) return sign | 0x7e00u;         // NaN
  if (abs >= 0x477ff000u) return sign | 0x7c00u;        // rounds to >= 65520: infinity
  if (abs < 0x33000000u) return sign;                   // below half the smallest subnormal: zero
  const int exp = static_cast<int>(abs >> 23);
  uint32_t man = (abs & 0x7fffffu) | 0x800000u;         // with the implicit bit
  int shift = exp < 113 ? 126 - exp : 13;               // subnormal results shift further
  uint32_t half_man = man >> shift;
  const uint32_t rest = man & ((1u << shift) - 1), halfway = 1u << (shift - 1);
  if (rest > halfway || (rest == halfway && (half_man & 1u))) ++half_man;  // nearest, ties to even
  if (exp < 113) return sign | static_cast<uint16_t>(half_man);  // a carry into the exponent is right
  return sign | static_cast<uint16_t>((static_cast<uint32_t>(exp - 112) << 10) + (half_man - 0x400u));
}

namespace {
#if defined(__x86_64__)
const bool kF16c = __builtin_cpu_supports("f16c") && __builtin_cpu_supports("avx");

__attribute__((target("avx,f16c"))) size_t widen_fp16_f16c(const uint16_t* s, float* d, size_t n) {
  size_t i = 0;
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(d + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i))));
  return i;
}
__attribute__((target("avx,f16c"))) size_t narrow_fp16_f16c(const float* s, uint16_t* d, size_t n) {
  size_t i = 0;
  for (; i + 8 <= n; i += 8)
    _mm_storeu_si128(reinterpret_cast<__m128i*>(d + i),
                     _mm256_cvtps_ph(_mm256_loadu_ps(s + i), _MM_FROUND_TO_NEAREST_INT));
  return i;
}
#endif
}  // namespace

void halves_to_floats(HalfKind kind, const uint16_t* src, float* dst, size_t n) {
  size_t i = 0;
  if (kind == HalfKind::Bf16) {
    for (; i < n; ++i) dst[i] = bf16_to_float(src[i]);
    return;
  }
#if defined(__x86_64__)
  if (kF16c) i = widen_fp16_f16c(src, dst, n);
#endif
  for (; i < n; ++i) dst[i] = fp16_to_float(src[i]);
}

void floats_to_halves(HalfKind kind, const float* src, uint16_t* dst, size_t n) {
  size_t i = 0;
  if (kind == HalfKind::Bf16) {
    for (; i < n; ++i) dst[i] = float_to_bf16(src[i]);
    return;
  }
#if defined(__x86_64__)
  if (kF16c) i = narrow_fp16_f16c(src, dst, n);
#endif
  for (; i < n; ++i) dst[i] = float_to_fp16(src[i]);
}

namespace {
// A residual that is not finite (a NaN gradient, or one beyond fp16's range
// that rounded to infinity) would poison every later encoding: drop it.
inline float finite_or_zero(float r) {
  uint32_t u;
  std::memcpy(&u, &r, 4);
  return (u & 0x7f800000u) == 0x7f800000u ? 0.0f : r;
}
}  // namespace

void encode_with_feedback(HalfKind kind, const float* g, const float* residual_in, float* residual_out,
                          uint16_t* out, size_t n) {
  if (kind == HalfKind::Bf16) {  // one pass
    for (size_t i = 0; i < n; ++i) {
      const float v = residual_in ? g[i] + residual_in[i] : g[i];
      const uint16_t h = float_to_bf16(v);
      out[i] = h;
      residual_out[i] = finite_or_zero(v - bf16_to_float(h));
    }
    return;
  }
  constexpr size_t kChunk = 4096;  // stays in cache between the passes
  float v[kChunk], back[kChunk];
  for (size_t at = 0; at < n; at += kChunk) {
    const size_t k = n - at < kChunk ? n - at : kChunk;
    for (size_t i = 0; i < k; ++i) v[i] = residual_in ? g[at + i] + residual_in[at + i] : g[at + i];
    floats_to_halves(kind, v, out + at, k);
    halves_to_floats(kind, out + at, back, k);
    for (size_t i = 0; i < k; ++i) residual_out[at + i] = finite_or_zero(v[i] - back[i]);
  }
}

void encode_with_feedback(HalfKind kind, const float* g, float* residual, uint16_t* out, size_t n) {
  encode_with_feedback(kind, g, residual, residual, out, n);
}

}  // namespace limbo
