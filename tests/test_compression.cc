// 16-bit gradients on the wire (comm/compression.h): the reduce functions
// gloo calls add in float32 and round once, and the error-feedback residual
// keeps what rounding dropped, so over many steps nothing is lost.
#include <gtest/gtest.h>

#include <torch/torch.h>

#include "comm/compression.h"
#include "common/error.h"

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
  EXPECT_THROW(parse_compression("fp32"), InvalidInput);
}

}  // namespace
