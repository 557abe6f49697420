// Gradients on the wire in 16 bits (comm.compression = fp16 | bf16): the
// member rounds its gradient to half precision, the all-reduce adds two
// halves at a time in float32 and rounds the sum back (gloo's ring moves
// 2 bytes per element instead of 4), and an error-feedback residual keeps
// what this member's rounding dropped, added to its next gradient, so no
// part of a gradient is lost for good, only delayed by a step.
#pragma once

#include <torch/torch.h>

#include <cstdint>
#include <string>

namespace limbo::comm {

enum class Compression { None, Fp16, Bf16 };
Compression parse_compression(const std::string& s);  // InvalidInput on anything else
const char* compression_name(Compression c);

// Element-wise c = round(float(a) + float(b)) on 16-bit values of the given
// kind; the signature gloo's all-reduce takes (n = element count).
void sum_fp16(void* c, const void* a, const void* b, size_t n);
void sum_bf16(void* c, const void* a, const void* b, size_t n);

// One member's encoder with its error-feedback residual.
class Compressor {
 public:
  explicit Compressor(Compression kind) : kind_(kind) {}
  Compression kind() const { return kind_; }
  // wire = round16(g + residual) as a kHalf / kBFloat16 tensor; the new
  // residual (g + residual - wire) is kept aside until commit().
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

}  // namespace limbo::comm
