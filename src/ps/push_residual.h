// Error feedback for a learner's 16-bit pushes (ps.push_compression).
//
// A push rounds g + residual to 16 bits; what rounding dropped becomes the
// new residual, sent with the next gradient. The new residual replaces the
// old only when the shard accepted the push (commit): a push that is lost,
// dropped as too stale or rejected leaves the old one, so what it held goes
// out with the next push instead of vanishing with this one. Ranges are a
// shard's slice of the flat gradient; each is encoded and committed on its
// own, part by part.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstring>
#include <cstdint>
#include <vector>

#include "common/half.h"

namespace limbo::ps {

class PushResidual {
 public:
  // wire[0, n) = round16(g[offset, offset + n) + residual) (error feedback;
  // the residual this leaves is kept aside until commit()).
  void encode(HalfKind kind, const float* g, int64_t total, int64_t offset, int64_t n, uint16_t* wire) {
    if (static_cast<int64_t>(residual_.size()) != total) {
      residual_.assign(static_cast<size_t>(total), 0.0f);
      pending_ = residual_;
    }
    encode_with_feedback(kind, g + offset, residual_.data() + offset, pending_.data() + offset, wire,
                         static_cast<size_t>(n));
  }
  // The push of [offset, offset + n) was accepted.
  void commit(int64_t offset, int64_t n) {
    if (residual_.empty()) return;
    std::copy(pending_.begin() + offset, pending_.begin() + offset + n, residual_.begin() + offset);
  }
  const std::vector<float>& residual() const { return residual_; }
  // Whether every value of g[0, total) + residual rounds to a finite 16-bit
  // value (fp16 overflows to infinity at 65520; bf16 only where float32
  // nearly does). A value that does not would be infinite on one shard
  // only, which refuses it while the others apply their parts: the learner
  // sends such a gradient as NaN everywhere instead.
  bool encodes_finite(HalfKind kind, const float* g, int64_t total) const {
    const float limit = kind == HalfKind::Fp16 ? 65520.0f : bf16_overflow();
    const bool have = static_cast<int64_t>(residual_.size()) == total;
    bool ok = true;
    for (int64_t i = 0; i < total; ++i) {
      const float v = g[i] + (have ? residual_[static_cast<size_t>(i)] : 0.0f);
      ok &= std::fabs(v) < limit;  // false for NaN too
    }
    return ok;
  }

 private:
  // The smallest float that bf16's round-to-nearest-even makes infinite.
  static float bf16_overflow() {
    const uint32_t u = 0x7f7f8000u;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
  }
  std::vector<float> residual_, pending_;
};

}  // namespace limbo::ps
