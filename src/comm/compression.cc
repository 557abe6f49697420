#include "comm/compression.h"

#include <algorithm>
#include <limits>
#include <cmath>
#include <cstring>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "comm/collective.h"
#include "common/error.h"
#include "common/half.h"

namespace limbo::comm {

Compression parse_compression(const std::string& s) {
  if (s == "none") return Compression::None;
  if (s == "fp16") return Compression::Fp16;
  if (s == "bf16") return Compression::Bf16;
  if (s == "int8") return Compression::Int8;
  if (s == "int4") return Compression::Int4;
  throw InvalidInput("comm.compression must be none, fp16, bf16, int8 or int4, got '" + s + "'");
}

const char* compression_name(Compression c) {
  switch (c) {
    case Compression::Fp16: return "fp16";
    case Compression::Bf16: return "bf16";
    case Compression::Int8: return "int8";
    case Compression::Int4: return "int4";
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

int64_t quantized_bytes(int64_t n, int bits) {
  const int64_t blocks = (n + kQuantBlock - 1) / kQuantBlock;
  return 4 * blocks + (bits == 8 ? n : (n + 1) / 2);
}

void quantize(const float* x, const float* residual, float* new_residual, uint8_t* out, int64_t n, int bits) {
  const float qmax = bits == 8 ? 127.0f : 7.0f;
  const int64_t blocks = (n + kQuantBlock - 1) / kQuantBlock;
  auto* scales = reinterpret_cast<float*>(out);  // (memcpy'd below: out need not be aligned)
  uint8_t* codes = out + 4 * blocks;
  if (bits == 4) std::memset(codes, 0, static_cast<size_t>((n + 1) / 2));
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t lo = b * kQuantBlock, hi = std::min(n, lo + kQuantBlock);
    float m = 0;
    bool finite = true;
    for (int64_t i = lo; i < hi; ++i) {
      const float v = x[i] + (residual ? residual[i] : 0.0f);
      new_residual[i] = v;  // the value, until its code is known
      finite = finite && std::isfinite(v);
      m = std::max(m, std::fabs(v));
    }
    // A block whose largest value is so small that its step would not be a
    // normal float (qmax / m overflows: 0 x inf = NaN) is sent as zeros and
    // kept whole in the residual. (Error feedback shrinks an unmoving block
    // by 254x a step with int8: from 1e-3 it gets there in some 14 steps.)
    const bool tiny = m < qmax * std::numeric_limits<float>::min();
    const float scale = !finite ? std::nanf("") : tiny ? 0.0f : m / qmax;
    std::memcpy(reinterpret_cast<uint8_t*>(scales) + 4 * b, &scale, 4);
    const float inv = finite && !tiny ? qmax / m : 0.0f;
    for (int64_t i = lo; i < hi; ++i) {
      const float v = new_residual[i];
      const float q = finite ? std::clamp(std::nearbyint(v * inv), -qmax, qmax) : 0.0f;
      new_residual[i] = finite ? v - q * scale : 0.0f;
      const int code = static_cast<int>(q);
      if (bits == 8) codes[i] = static_cast<uint8_t>(static_cast<int8_t>(code));
      else codes[i / 2] |= static_cast<uint8_t>((code + 8) << (4 * (i % 2)));
    }
  }
}

void dequantize_add(const uint8_t* in, float* acc, int64_t n, int bits) {
  const int64_t blocks = (n + kQuantBlock - 1) / kQuantBlock;
  const uint8_t* codes = in + 4 * blocks;
  for (int64_t b = 0; b < blocks; ++b) {
    float scale;
    std::memcpy(&scale, in + 4 * b, 4);
    const int64_t lo = b * kQuantBlock, hi = std::min(n, lo + kQuantBlock);
    if (bits == 8)
      for (int64_t i = lo; i < hi; ++i) acc[i] += static_cast<float>(static_cast<int8_t>(codes[i])) * scale;
    else
      for (int64_t i = lo; i < hi; ++i) acc[i] += static_cast<float>(((codes[i / 2] >> (4 * (i % 2))) & 15) - 8) * scale;
  }
}

torch::Tensor Compressor::encode(const torch::Tensor& g) {
  torch::NoGradGuard no_grad;
  if (g.scalar_type() != torch::kFloat32) throw InvalidInput("Compressor::encode takes float32 gradients");
  const torch::Tensor gc = g.contiguous();
  const int64_t n = gc.numel();
  if (is_quantized(kind_)) {
    if (!pending_.defined() || pending_.numel() != n) pending_ = torch::empty({n}, torch::kFloat32);
    const int bits = kind_ == Compression::Int8 ? 8 : 4;
    torch::Tensor wire = torch::empty({quantized_bytes(n, bits)}, torch::kUInt8);
    const float* old = residual_.defined() && residual_.numel() == n ? residual_.data_ptr<float>() : nullptr;
    quantize(gc.data_ptr<float>(), old, pending_.data_ptr<float>(), wire.data_ptr<uint8_t>(), n, bits);
    return wire;
  }
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

void gather_codes_and_sum(Collective& g, const uint8_t* mine, int64_t q, torch::Tensor& gathered, float* out,
                          int64_t n, int bits) {
  const int W = g.size();
  if (!gathered.defined() || gathered.numel() != W * q) gathered = torch::empty({W * q}, torch::kUInt8);
  uint8_t* all = gathered.data_ptr<uint8_t>();
  std::memcpy(all + g.rank() * q, mine, static_cast<size_t>(q));
  std::vector<int64_t> bounds;
  for (int r = 0; r <= W; ++r) bounds.push_back(r * q);
  g.all_gather(gathered, bounds);
  std::fill(out, out + n, 0.0f);
  for (int r = 0; r < W; ++r) dequantize_add(all + r * q, out, n, bits);
}

int64_t sum_encoded(Collective& g, torch::Tensor& t, Compressor* enc) {
  torch::NoGradGuard no_grad;
  if (!t.is_contiguous() || t.scalar_type() != torch::kFloat32)
    throw InvalidInput("sum_encoded takes a contiguous float32 tensor");
  const Compression kind = enc ? enc->kind() : Compression::None;
  if (kind == Compression::None) {
    g.allreduce_sum(t);
    return static_cast<int64_t>(t.nbytes());
  }
  torch::Tensor wire = enc->encode(t);
  const auto bytes = static_cast<int64_t>(wire.nbytes());
  if (is_16bit(kind)) {
    g.allreduce_sum_16(wire);
    t.copy_(wire.to(torch::kFloat32).view(t.sizes()));
    return bytes;
  }
  torch::Tensor gathered;
  gather_codes_and_sum(g, wire.data_ptr<uint8_t>(), wire.numel(), gathered, t.data_ptr<float>(), t.numel(),
                       kind == Compression::Int8 ? 8 : 4);
  return bytes;
}

}  // namespace limbo::comm
