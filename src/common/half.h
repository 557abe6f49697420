// 16-bit floats on the wire: IEEE half (fp16) and bfloat16, converted to and
// from float32 with round-to-nearest-even (plain C++, no libtorch: the
// parameter server's codec uses these too). fp16 overflows to infinity;
// NaN stays NaN in both.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>

namespace limbo {

enum class HalfKind { Fp16, Bf16 };

inline float bf16_to_float(uint16_t h) {
  const uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline uint16_t float_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  // Branch-free (a select), so that loops over it vectorise.
  const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  const uint32_t quiet_nan = (u >> 16) | 0x40u;
  return static_cast<uint16_t>((u & 0x7fffffffu) > 0x7f800000u ? quiet_nan : rounded);
}

float fp16_to_float(uint16_t h);
uint16_t float_to_fp16(float f);

// n values from src to dst (the buffers may not overlap).
void halves_to_floats(HalfKind kind, const uint16_t* src, float* dst, size_t n);
void floats_to_halves(HalfKind kind, const float* src, uint16_t* dst, size_t n);

// Error feedback: v = g + residual is rounded into `out`, and the residual
// becomes what the rounding dropped (v - out), to be sent with the next one
// (0 where that is not finite: a NaN, or an fp16 overflow to infinity).
void encode_with_feedback(HalfKind kind, const float* g, float* residual, uint16_t* out, size_t n);
// The same with the old residual read from `residual_in` (null: zeros) and
// the new one written to `residual_out` (one pass; the buffers may not
// overlap), for a caller that keeps the old one until the step succeeds.
void encode_with_feedback(HalfKind kind, const float* g, const float* residual_in, float* residual_out,
                          uint16_t* out, size_t n);

}  // namespace limbo
