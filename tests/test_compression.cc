// 16-bit gradients on the wire (comm/compression.h): the reduce functions
// gloo calls add in float32 and round once, and the error-feedback residual
// keeps what rounding dropped, so over many steps nothing is lost.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>

#include <torch/torch.h>

#include "comm/compression.h"
#include "common/error.h"
#include "common/half.h"

using namespace limbo;
using namespace limbo::comm;

namespace {

torch::Tensor sample_values(int64_t n) {
  torch::manual_seed(7);
  // Gradient-like magnitudes across many binades, both signs, and exact zeros.
  auto v = torch::randn({n}) * torch::pow(10.0, torch::randint(-6, 3, {n}).to(torch::kFloat32));
  v.narrow(0, 0, 10).zero_();
  return v;
}

void check_sum(torch::ScalarType type, void (*fn)(void*, const void*, const void*, size_t)) {
  const int64_t n = 10007;  // not a multiple of the vector width
  auto a = sample_values(n).to(type), b = (sample_values(n) * 0.37).to(type);
  auto c = torch::empty_like(a);
  fn(c.data_ptr(), a.data_ptr(), b.data_ptr(), static_cast<size_t>(n));
  auto want = (a.to(torch::kFloat32) + b.to(torch::kFloat32)).to(type);  // float32 sum, one rounding
  EXPECT_TRUE(torch::equal(c.view(torch::kInt16), want.view(torch::kInt16)));
}

TEST(Compression, SumsAddInFloat32AndRoundOnce) {
  check_sum(torch::kBFloat16, &sum_bf16);
  check_sum(torch::kHalf, &sum_fp16);
}

TEST(Compression, ErrorFeedbackLosesNothingOverSteps) {
  for (auto kind : {Compression::Bf16, Compression::Fp16}) {
    Compressor c(kind);
    auto g = sample_values(4096) * 1e-3;
    torch::Tensor sent = torch::zeros_like(g);
    const int steps = 200;
    for (int i = 0; i < steps; ++i) {
      auto wire = c.encode(g);
      EXPECT_EQ(wire.scalar_type(), kind == Compression::Fp16 ? torch::kHalf : torch::kBFloat16);
      c.commit();
      sent += wire.to(torch::kFloat32);
    }
    // What arrived plus what is still held equals what was given, exactly up
    // to float32 arithmetic; without the residual the error grows with steps.
    auto total = sent + c.residual();
    EXPECT_LT((total - g * steps).abs().max().item<double>(), 1e-4 * (g * steps).abs().max().item<double>() + 1e-6)
        << compression_name(kind);
    auto plain = (g.to(kind == Compression::Fp16 ? torch::kHalf : torch::kBFloat16).to(torch::kFloat32) * steps);
    EXPECT_GT((plain - g * steps).abs().max().item<double>(), (total - g * steps).abs().max().item<double>());
  }
}

TEST(Compression, AFailedStepLeavesTheResidualAsItWas) {
  Compressor c(Compression::Bf16);
  auto g = sample_values(1000);
  auto first = c.encode(g);
  c.commit();
  const auto kept = c.residual().clone();
  auto lost = c.encode(g);  // this step's all-reduce fails: no commit
  auto again = c.encode(g);
  EXPECT_TRUE(torch::equal(lost.view(torch::kInt16), again.view(torch::kInt16)));
  EXPECT_TRUE(torch::equal(c.residual(), kept));
}

TEST(Compression, NamesAreParsedStrictly) {
  EXPECT_EQ(parse_compression("bf16"), Compression::Bf16);
  EXPECT_EQ(parse_compression("fp16"), Compression::Fp16);
  EXPECT_EQ(parse_compression("none"), Compression::None);
  EXPECT_EQ(parse_compression("int8"), Compression::Int8);
  EXPECT_EQ(parse_compression("int4"), Compression::Int4);
  EXPECT_THROW(parse_compression("fp32"), InvalidInput);
  EXPECT_THROW(parse_compression("int2"), InvalidInput);
}

// Decoding the codes of x = dequantize_add into zeros.
torch::Tensor round_trip(const torch::Tensor& x, int bits, torch::Tensor* residual = nullptr) {
  const int64_t n = x.numel();
  auto wire = torch::empty({quantized_bytes(n, bits)}, torch::kUInt8);
  auto res = torch::empty({n});
  quantize(x.data_ptr<float>(), nullptr, res.data_ptr<float>(), wire.data_ptr<uint8_t>(), n, bits);
  auto out = torch::zeros({n});
  dequantize_add(wire.data_ptr<uint8_t>(), out.data_ptr<float>(), n, bits);
  if (residual) *residual = res;
  return out;
}

// Each value is off by at most half its block's step (the block's largest
// magnitude over 127, or over 7), the residual holds exactly what the codes
// dropped, and an odd count packs its last 4-bit code alone.
TEST(Quantization, EveryValueWithinHalfAStepOfItsBlockAndTheResidualHoldsTheRest) {
  for (int bits : {8, 4}) {
    for (int64_t n : {int64_t{1}, int64_t{255}, int64_t{257}, int64_t{10007}}) {
      SCOPED_TRACE(std::to_string(bits) + " bits, " + std::to_string(n) + " values");
      auto x = torch::randn({n}) * torch::rand({n}) * 3;
      torch::Tensor res;
      auto y = round_trip(x, bits, &res);
      const float qmax = bits == 8 ? 127.0f : 7.0f;
      for (int64_t lo = 0; lo < n; lo += kQuantBlock) {
        const int64_t m = std::min(kQuantBlock, n - lo);
        auto xb = x.narrow(0, lo, m), yb = y.narrow(0, lo, m);
        const double step = xb.abs().max().item<double>() / qmax;
        EXPECT_LE((xb - yb).abs().max().item<double>(), 0.5 * step * (1 + 1e-5));
        // The largest magnitude is coded exactly (up to float rounding).
        EXPECT_NEAR(yb.abs().max().item<double>(), xb.abs().max().item<double>(), 1e-6 * step * qmax);
      }
      EXPECT_LT((x - y - res).abs().max().item<double>(), 1e-6);
      EXPECT_EQ(quantized_bytes(n, bits), 4 * ((n + 255) / 256) + (bits == 8 ? n : (n + 1) / 2));
    }
  }
}

// Error feedback over outer steps: what arrived plus the residual still
// held equals what was given; without it 4-bit codes lose far more.
TEST(Quantization, ErrorFeedbackLosesNothingOverSteps) {
  for (auto kind : {Compression::Int8, Compression::Int4}) {
    Compressor c(kind);
    auto g = sample_values(4096) * 1e-3;
    torch::Tensor sent = torch::zeros_like(g);
    const int steps = 50;
    const int bits = kind == Compression::Int8 ? 8 : 4;
    for (int i = 0; i < steps; ++i) {
      auto wire = c.encode(g);
      EXPECT_EQ(wire.numel(), quantized_bytes(g.numel(), bits));
      c.commit();
      dequantize_add(wire.data_ptr<uint8_t>(), sent.data_ptr<float>(), g.numel(), bits);
    }
    auto total = sent + c.residual();
    EXPECT_LT((total - g * steps).abs().max().item<double>(), 1e-4 * (g * steps).abs().max().item<double>())
        << compression_name(kind);
    auto plain = round_trip(g.contiguous(), bits) * steps;
    EXPECT_GT((plain - g * steps).abs().sum().item<double>(), 10 * (total - g * steps).abs().sum().item<double>());
  }
}

// A value that is not finite makes its block's scale NaN: the decoded sum is
// not finite (the step is skipped everywhere) and the residual stays finite.
TEST(Quantization, AValueThatIsNotFiniteMakesItsBlockNotFinite) {
  auto x = torch::randn({600});
  x[300] = std::numeric_limits<float>::infinity();
  torch::Tensor res;
  auto y = round_trip(x, 8, &res);
  EXPECT_FALSE(std::isfinite(y.narrow(0, 256, 256).sum().item<float>()));
  EXPECT_TRUE(std::isfinite(y.narrow(0, 0, 256).sum().item<float>()));
  EXPECT_TRUE(std::isfinite(y.narrow(0, 512, 88).sum().item<float>()));
  EXPECT_TRUE(std::isfinite(res.sum().item<float>()));
}

// Found: a block whose largest value was tiny but not zero made the scale's
// inverse overflow (qmax / m = inf), and an exact zero in it decoded as
// 0 x inf = NaN. Error feedback shrinks a block whose input stopped moving
// by 254x a step (int8; 14x int4), so from 1e-3 it got there in about 14
// (31) steps: every step after was skipped as not finite and the run
// stopped as diverged. Such a block stays finite for ever, losing nothing.
TEST(Quantization, ABlockThatStopsMovingStaysFiniteForEver) {
  for (auto kind : {Compression::Int8, Compression::Int4}) {
    const int bits = kind == Compression::Int8 ? 8 : 4;
    Compressor c(kind);
    torch::manual_seed(3);
    auto g = torch::randn({kQuantBlock}) * 1e-3;
    g[5] = 0.0f;  // an element that is exactly zero
    torch::Tensor sent = torch::zeros_like(g);
    for (int step = 0; step < 200; ++step) {
      auto wire = c.encode(step == 0 ? g : torch::zeros_like(g));  // then the block stops moving
      c.commit();
      dequantize_add(wire.data_ptr<uint8_t>(), sent.data_ptr<float>(), g.numel(), bits);
      ASSERT_TRUE(torch::isfinite(sent).all().item<bool>()) << compression_name(kind) << " step " << step;
      ASSERT_TRUE(torch::isfinite(c.residual()).all().item<bool>()) << compression_name(kind) << " step " << step;
    }
    EXPECT_LT((sent + c.residual() - g).abs().max().item<double>(), 1e-9) << compression_name(kind);
  }
}

}  // namespace

// The plain-C++ conversions the parameter server uses agree with libtorch's
// (c10::Half, c10::BFloat16: round to nearest even) bit for bit.
TEST(Compression, SixteenBitConversionsMatchLibtorch) {
  // Every fp16 and bf16 value to float.
  std::vector<uint16_t> all(65536);
  for (uint32_t i = 0; i < 65536; ++i) all[i] = static_cast<uint16_t>(i);
  std::vector<float> wide(65536);
  halves_to_floats(HalfKind::Fp16, all.data(), wide.data(), all.size());
  auto want_h = torch::from_blob(all.data(), {65536}, torch::kInt16).view(torch::kHalf).to(torch::kFloat32);
  auto got = torch::from_blob(wide.data(), {65536}, torch::kFloat32);
  auto finite = want_h.isfinite() | want_h.isinf();  // NaN payloads may differ; NaN must stay NaN
  EXPECT_TRUE(torch::equal(got.masked_select(finite), want_h.masked_select(finite)));
  EXPECT_TRUE(got.masked_select(~finite).isnan().all().item<bool>());
  halves_to_floats(HalfKind::Bf16, all.data(), wide.data(), all.size());
  auto want_b = torch::from_blob(all.data(), {65536}, torch::kInt16).view(torch::kBFloat16).to(torch::kFloat32);
  auto fin_b = want_b.isfinite() | want_b.isinf();
  EXPECT_TRUE(torch::equal(got.masked_select(fin_b), want_b.masked_select(fin_b)));
  // Floats to 16 bits: magnitudes from fp16's subnormals to past its
  // overflow, exact ties included; the scalar tail and the vector path both.
  torch::manual_seed(3);
  auto f = torch::randn({100003}) * torch::pow(2.0, torch::randint(-30, 20, {100003}).to(torch::kFloat32));
  f[0] = 65504.f;
  f[1] = 65520.f;              // ties to infinity
  f[2] = std::ldexp(1.f, -25);  // ties to zero
  f[3] = std::ldexp(3.f, -26);  // rounds up to the smallest subnormal
  f[4] = 1.f + std::ldexp(1.f, -11);  // a tie at 1: stays 1 (even)
  f[5] = -0.f;
  f[6] = std::numeric_limits<float>::infinity();
  f = f.contiguous();
  std::vector<uint16_t> h(f.numel());
  floats_to_halves(HalfKind::Fp16, f.data_ptr<float>(), h.data(), h.size());
  auto want16 = f.to(torch::kHalf).view(torch::kInt16);
  EXPECT_TRUE(torch::equal(torch::from_blob(h.data(), {f.numel()}, torch::kInt16), want16));
  for (size_t i = 0; i < h.size(); i += 997)  // the scalar path alone
    ASSERT_EQ(float_to_fp16(f[i].item<float>()), h[i]) << f[i].item<float>();
  floats_to_halves(HalfKind::Bf16, f.data_ptr<float>(), h.data(), h.size());
  EXPECT_TRUE(torch::equal(torch::from_blob(h.data(), {f.numel()}, torch::kInt16),
                           f.to(torch::kBFloat16).view(torch::kInt16)));
}

TEST(Compression, PushEncodingKeepsWhatRoundingDroppedForTheNextPush) {
  for (auto kind : {HalfKind::Bf16, HalfKind::Fp16}) {
    auto g = sample_values(5000) * 1e-3;
    std::vector<float> residual(5000, 0.f);
    std::vector<uint16_t> wire(5000);
    std::vector<double> sent(5000, 0.0);
    for (int step = 0; step < 100; ++step) {
      encode_with_feedback(kind, g.data_ptr<float>(), residual.data(), wire.data(), wire.size());
      for (size_t i = 0; i < wire.size(); ++i)
        sent[i] += kind == HalfKind::Bf16 ? bf16_to_float(wire[i]) : fp16_to_float(wire[i]);
    }
    double worst = 0, scale = 0;
    for (size_t i = 0; i < wire.size(); ++i) {
      const double total = sent[i] + residual[i], want = 100.0 * g[i].item<float>();
      worst = std::max(worst, std::fabs(total - want));
      scale = std::max(scale, std::fabs(want));
    }
    EXPECT_LT(worst, 1e-4 * scale + 1e-6);
  }
}

// A gradient beyond fp16's range (it rounds to infinity) or a NaN must not
// leave a residual that poisons every later step.
TEST(Compression, AnOverflowOrANanDoesNotPoisonLaterSteps) {
  for (auto kind : {HalfKind::Fp16, HalfKind::Bf16}) {
    std::vector<float> g = {1e6f, std::nanf(""), 0.25f, -3.0f}, residual(4, 0.f);
    std::vector<uint16_t> wire(4);
    encode_with_feedback(kind, g.data(), residual.data(), wire.data(), 4);
    for (float r : residual) EXPECT_TRUE(std::isfinite(r));
    std::vector<float> next = {0.5f, 0.5f, 0.5f, 0.5f};
    encode_with_feedback(kind, next.data(), residual.data(), wire.data(), 4);
    for (size_t i = 0; i < 4; ++i) {
      const float sent = kind == HalfKind::Bf16 ? bf16_to_float(wire[i]) : fp16_to_float(wire[i]);
      EXPECT_TRUE(std::isfinite(sent)) << i;
      // bf16 holds 1e6 (its rounding error is a finite residual, carried
      // over); fp16 overflowed, and the NaN's residual is dropped.
      if (i > 0 || kind == HalfKind::Fp16) {
        EXPECT_NEAR(sent, 0.5f, 1e-2) << i;
      }
    }
  }
  for (auto kind : {Compression::Fp16, Compression::Bf16}) {
    Compressor c(kind);
    c.encode(torch::tensor({1e6f, std::nanf(""), 0.25f}));
    c.commit();
    EXPECT_TRUE(c.residual().isfinite().all().item<bool>());
    auto wire = c.encode(torch::full({3}, 0.5f)).to(torch::kFloat32);
    EXPECT_TRUE(wire.isfinite().all().item<bool>());
    EXPECT_NEAR(wire[1].item<float>(), 0.5f, 1e-2);
    EXPECT_NEAR(wire[2].item<float>(), 0.5f, 1e-2);
    if (kind == Compression::Fp16) {
      EXPECT_NEAR(wire[0].item<float>(), 0.5f, 1e-2);
    }
  }
}
