#include "comm/compression.h"

#include <cstring>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "common/error.h"
#include "common/half.h"

namespace limbo::comm {

Compression parse_compression(const std::string& s) {
  if (s == "none") return Compression::None;
  if (s == "fp16") return Compression::Fp16;
  if (s == "bf16") return Compression::Bf16;
  throw InvalidInput("comm.compression must be none, fp16 or bf16, got '" + s + "'");
}

const char* compression_name(Compression c) {
  switch (c) {
    case Compression::Fp16: return "fp16";
    case Compression::Bf16: return "bf16";
    default: return "none";
  }
}

namespace {

#if defined(__x86_64__)
__attribute__((target("avx,f16c"))) void sum_fp16_f16c(uint16_t* c, const uint16_t* a, const uint16_t* b, size_t n) {
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    __m256 x = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(a + i)));
    __m256 y = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + i)));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(c + i), _mm256_cvtps_ph(_mm256_add_ps(x, y), _MM_FROUND_TO_NEAREST_INT));
  }
  for (; i < n; ++i) c[i] = float_to_fp16(fp16_to_float(a[i]) + fp16_to_float(b[i]));
}
const bool kHaveF16c = __builtin_cpu_supports("f16c") && __builtin_cpu_supports("avx");
#else
const bool kHaveF16c = false;
#endif

}  // namespace

void sum_fp16(void* c, const void* a, const void* b, size_t n) {
#if defined(__x86_64__)
  if (kHaveF16c)
    return sum_fp16_f16c(static_cast<uint16_t*>(c), static_cast<const uint16_t*>(a), static_cast<const uint16_t*>(b), n);
#endif
  auto* out = static_cast<uint16_t*>(c);
  const auto* x = static_cast<const uint16_t*>(a);
  const auto* y = static_cast<const uint16_t*>(b);
  for (size_t i = 0; i < n; ++i) out[i] = float_to_fp16(fp16_to_float(x[i]) + fp16_to_float(y[i]));
}

void sum_bf16(void* c, const void* a, const void* b, size_t n) {
  auto* out = static_cast<uint16_t*>(c);
  const auto* x = static_cast<const uint16_t*>(a);
  const auto* y = static_cast<const uint16_t*>(b);
  for (size_t i = 0; i < n; ++i) out[i] = float_to_bf16(bf16_to_float(x[i]) + bf16_to_float(y[i]));
}

torch::Tensor Compressor::encode(const torch::Tensor& g) {
  torch::NoGradGuard no_grad;
  if (g.scalar_type() != torch::kFloat32) throw InvalidInput("Compressor::encode takes float32 gradients");
  const torch::Tensor gc = g.contiguous();
  const int64_t n = gc.numel();
  // One pass (common/half.h): wire = round16(g + residual), and the new
  // residual (what rounding dropped; zero where not finite) goes to a buffer
  // of its own until commit(). Buffers are reused from step to step.
  if (!pending_.defined() || pending_.numel() != n) {
    pending_ = spare_.defined() && spare_.numel() == n ? spare_ : torch::empty({n}, torch::kFloat32);
    spare_ = torch::Tensor();
  }
  torch::Tensor wire = torch::empty(g.sizes(), kind_ == Compression::Fp16 ? torch::kHalf : torch::kBFloat16);
  const float* old = residual_.defined() && residual_.numel() == n ? residual_.data_ptr<float>() : nullptr;
  encode_with_feedback(kind_ == Compression::Fp16 ? HalfKind::Fp16 : HalfKind::Bf16, gc.data_ptr<float>(), old,
                       pending_.data_ptr<float>(), static_cast<uint16_t*>(wire.data_ptr()), static_cast<size_t>(n));
  return wire;
}

void Compressor::commit() {
  if (!pending_.defined()) return;
  spare_ = std::move(residual_);
  residual_ = std::move(pending_);
  pending_ = torch::Tensor();
}

}  // namespace limbo::comm
