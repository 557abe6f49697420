// Checks on the checkpoints of two runs: the same weights and optimizer
// state, bit for bit (the sharded path against the replicated one).
#pragma once

#include <gtest/gtest.h>
#include <torch/script.h>

#include <cstdio>
#include <map>
#include <string>

namespace limbo::testing {

// Every tensor of a checkpoint but its run state (whose config differs).
inline std::map<std::string, torch::Tensor> checkpoint_tensors(const std::string& path) {
  std::map<std::string, torch::Tensor> out;
  auto m = torch::jit::load(path);
  for (const auto& a : m.named_attributes(/*recurse=*/true))
    if (a.value.isTensor() && a.name.rfind("state.", 0) != 0) out[a.name] = a.value.toTensor();
  return out;
}

// The checkpoints of run directories a and b hold the same weights and
// optimizer state, bit for bit.
inline void expect_same_checkpoint(const std::string& a, const std::string& b) {
  auto x = checkpoint_tensors(a + "/checkpoint.pt"), y = checkpoint_tensors(b + "/checkpoint.pt");
  ASSERT_EQ(x.size(), y.size());
  int optim = 0;
  for (const auto& [name, t] : x) {
    ASSERT_TRUE(y.count(name)) << name;
    EXPECT_TRUE(torch::equal(t, y[name])) << name << " differs";
    optim += name.rfind("optim.", 0) == 0 && t.numel() > 1;
  }
  EXPECT_GT(optim, 0) << "the checkpoints hold no optimizer state";
}

// The checkpoints of run directories a and b hold the same weights and
// optimizer state up to float rounding: for runs whose sums were added in
// different orders (an all-reduce of three or more members over buckets cut
// differently), which no bit-for-bit check can ask of them. Every tensor
// within rtol of its magnitude plus atol; the largest difference is
// reported.
inline void expect_close_checkpoint(const std::string& a, const std::string& b, double rtol, double atol) {
  auto x = checkpoint_tensors(a + "/checkpoint.pt"), y = checkpoint_tensors(b + "/checkpoint.pt");
  ASSERT_EQ(x.size(), y.size());
  int optim = 0;
  for (const auto& [name, t] : x) {
    ASSERT_TRUE(y.count(name)) << name;
    const auto& u = y[name];
    ASSERT_EQ(t.sizes(), u.sizes()) << name;
    if (!t.is_floating_point()) {
      EXPECT_TRUE(torch::equal(t, u)) << name << " differs";
      continue;
    }
    const double diff = (t - u).abs().max().item<double>();
    std::printf("%s: largest difference %.3g (largest magnitude %.3g)\n", name.c_str(), diff,
                t.abs().max().item<double>());
    EXPECT_TRUE(torch::allclose(t, u, rtol, atol)) << name << " differs by up to " << diff;
    optim += name.rfind("optim.", 0) == 0 && t.numel() > 1;
  }
  EXPECT_GT(optim, 0) << "the checkpoints hold no optimizer state";
}

}  // namespace limbo::testing
