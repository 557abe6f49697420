// Gradients on the wire in 16 bits (comm.compression = fp16 | bf16): the
// member rounds its gradient to half precision, the all-reduce adds two
// halves at a time in float32 and rounds the sum back (gloo's ring moves
// 2 bytes per element instead of 4), and an error-feedback residual keeps
// what this member's rounding dropped, added to its next gradient, so no
// part of a gradient is lost for good, only delayed by a step.
//
// 8 and 4 bits (comm.compression = int8 | int4; made for DiLoCo's outer
// all-reduce, docs/diloco.md): each block of kQuantBlock values gets a
// float32 scale (its largest magnitude over 127, or over 7) and every value
// a symmetric integer code; the error-feedback residual keeps what the
// codes dropped, as above. Integer codes cannot be summed on the wire, so
// every member's codes are all-gathered and each member decodes and adds
// them in float32 in rank order (every member gets the same bits): a
// member sends (W - 1) x (1 or 1/2 byte + 4 / kQuantBlock) per element in
// a group of W, against 8 (W - 1) / W bytes for float32's ring all-reduce.
#pragma once

#include <torch/torch.h>

#include <cstdint>
#include <string>

namespace limbo::comm {

class Collective;

enum class Compression { None, Fp16, Bf16, Int8, Int4 };
Compression parse_compression(const std::string& s);  // InvalidInput on anything else
const char* compression_name(Compression c);
inline bool is_quantized(Compression c) { return c == Compression::Int8 || c == Compression::Int4; }
inline bool is_16bit(Compression c) { return c == Compression::Fp16 || c == Compression::Bf16; }

// Values per float32 scale of the 8- and 4-bit codes.
constexpr int64_t kQuantBlock = 256;
// Bytes of n values quantized to `bits` (8 or 4): the scales, then the codes.
int64_t quantized_bytes(int64_t n, int bits);
// Quantizes x[i] + residual[i] (residual may be null) into `out`
// (quantized_bytes(n, bits)); what the codes dropped goes to new_residual
// (0 where not finite). A block holding a value that is not finite gets a
// NaN scale, so its decoded values, and the sum, are not finite.
void quantize(const float* x, const float* residual, float* new_residual, uint8_t* out, int64_t n, int bits);
// acc[i] += the value `in` codes (n values, `bits`).
void dequantize_add(const uint8_t* in, float* acc, int64_t n, int bits);

// Element-wise c = round(float(a) + float(b)) on 16-bit values of the given
// kind; the signature gloo's all-reduce takes (n = element count).
void sum_fp16(void* c, const void* a, const void* b, size_t n);
void sum_bf16(void* c, const void* a, const void* b, size_t n);

// One member's encoder with its error-feedback residual.
class Compressor {
 public:
  explicit Compressor(Compression kind) : kind_(kind) {}
  Compression kind() const { return kind_; }
  // wire = round16(g + residual) as a kHalf / kBFloat16 tensor (int8 and
  // int4: the quantized bytes as a kUInt8 tensor); the new residual
  // (g + residual - wire) is kept aside until commit().
  torch::Tensor encode(const torch::Tensor& g);
  // The step's all-reduce succeeded: the new residual replaces the old. A
  // failed step is redone from the old one (nothing is counted twice).
  void commit();
  void reset() { residual_ = pending_ = spare_ = torch::Tensor(); }
  const torch::Tensor& residual() const { return residual_; }

 private:
  Compression kind_;
  torch::Tensor residual_, pending_, spare_;  // spare_: the residual before last, reused
};

// Every member's `q` bytes of codes (`mine`, this member's) all-gathered
// into `gathered` (resized to W x q bytes as needed), then decoded and
// added in rank order into out[0, n) (overwritten): every member gets the
// same bits.
void gather_codes_and_sum(Collective& g, const uint8_t* mine, int64_t q, torch::Tensor& gathered, float* out,
                          int64_t n, int bits);

// The sum of float32 `t` across the members of `g`, in place, with this
// member's part on the wire as `enc` encodes it (null, or a Compression::None
// encoder: float32; 16 bits: summed pairwise in float32; int8 / int4: codes
// gathered and summed by gather_codes_and_sum). The encoder's new residual
// is pending until its commit(). DiLoCo's fragment all-reduce.
// Returns the bytes this member put on the wire (its codes and scales, or
// 16 or 32 bits a value).
int64_t sum_encoded(Collective& g, torch::Tensor& t, Compressor* enc);

}  // namespace limbo::comm
