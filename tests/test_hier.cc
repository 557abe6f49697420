// Groups across hosts (comm/hier_group.h): the flat Gloo path sums a
// power-of-two group as a tree over ranks, the hierarchical group gives the
// same bits when hosts hold consecutive ranks, uneven layouts agree on every
// member, and an abort anywhere fails every member. Members are threads of
// this process placed on "hosts" by GroupOptions::host; test_hosts runs
// the same groups across network namespaces with real processes.
#include <gtest/gtest.h>

#include <torch/torch.h>

#include <functional>
#include <thread>

#include "comm/collective.h"
#include "comm/compression.h"
#include "comm/hier_group.h"
#include "comm/store.h"
#include "common/error.h"
#include "member_threads.h"

using namespace limbo;

namespace {

// Runs fn on one thread per entry of `hosts` (member r on host hosts[r]),
// each with the group make_group() forms; returns the members' errors.
std::vector<std::string> with_group(const std::vector<std::string>& hosts, const std::string& prefix,
                                    const std::function<void(int, comm::Collective&)>& fn,
                                    bool hierarchical = true) {
  const int world = static_cast<int>(hosts.size());
  return limbo::testing::on_member_threads(world, [&](int r, comm::GroupOptions go) {
    go.prefix = prefix;
    go.host = hosts[r];
    go.hierarchical = hierarchical;
    auto g = comm::make_group(go, r, world);
    fn(r, *g);
  });
}

// Member r's values, of magnitudes that differ by member so that the order
// of the sums shows in the last bits.
torch::Tensor values(int rank, int64_t n) {
  auto gen = at::detail::createCPUGenerator(300 + rank);
  return torch::randn({n}, gen) * static_cast<float>(1 + 37 * rank);
}

// The tree over ranks: ((x0 + x1) + (x2 + x3)) + ... with `add`.
torch::Tensor tree(std::vector<torch::Tensor> xs, const std::function<torch::Tensor(const torch::Tensor&, const torch::Tensor&)>& add) {
  while (xs.size() > 1) {
    std::vector<torch::Tensor> next;
    for (size_t i = 0; i < xs.size(); i += 2) next.push_back(add(xs[i], xs[i + 1]));
    xs = next;
  }
  return xs[0];
}

torch::Tensor add_f32(const torch::Tensor& a, const torch::Tensor& b) { return a + b; }

torch::Tensor add_bf16(const torch::Tensor& a, const torch::Tensor& b) {
  auto out = torch::empty_like(a);
  comm::sum_bf16(out.data_ptr(), a.data_ptr(), b.data_ptr(), static_cast<size_t>(a.numel()));
  return out;
}

std::vector<torch::Tensor> all_values(int world, int64_t n) {
  std::vector<torch::Tensor> xs;
  for (int r = 0; r < world; ++r) xs.push_back(values(r, n));
  return xs;
}

torch::Tensor chain(const std::vector<torch::Tensor>& xs) {
  auto acc = xs[0].clone();
  for (size_t i = 1; i < xs.size(); ++i) acc = acc + xs[i];
  return acc;
}

}  // namespace

// Flat Gloo groups of 4 and 8 sum every element as a tree over ranks,
// whatever its position and however short the tensor (shorter than the
// group, too). The reference is computed here; it differs from member
// order, so the check would see another order.
TEST(Hier, AFlatPowerOfTwoGroupSumsAsATreeOverRanks) {
  for (int world : {4, 8}) {
    for (int64_t n : {int64_t{1000003}, int64_t{3}, int64_t{1}}) {
      if (world == 8 && n > 100000) continue;  // 8 threads on this machine: keep it short
      const auto xs = all_values(world, n);
      const auto want = tree(xs, add_f32);
      if (n > 1000) {
        ASSERT_FALSE(torch::equal(want, chain(xs))) << "the orders must differ for the check to mean anything";
      }
      std::vector<torch::Tensor> bf(xs.size());
      for (int r = 0; r < world; ++r) bf[r] = xs[r].to(torch::kBFloat16);
      const auto want16 = tree(bf, add_bf16);
      std::vector<std::string> hosts;  // one member per host
      for (int r = 0; r < world; ++r) hosts.push_back("h" + std::to_string(r));
      auto errors = with_group(hosts, "flat", [&](int r, comm::Collective& g) {
        EXPECT_STREQ(g.transport(), "gloo");
        auto t = values(r, n);
        g.allreduce_sum(t);
        EXPECT_TRUE(torch::equal(t, want)) << "world " << world << ", n " << n << ", member " << r;
        auto h = values(r, n).to(torch::kBFloat16);
        g.allreduce_sum_16(h);
        EXPECT_TRUE(torch::equal(h, want16)) << "bf16: world " << world << ", n " << n << ", member " << r;
      });
      limbo::testing::expect_no_member_errors(errors);
    }
  }
}

// 2 hosts of 2 members (ranks 0, 1 on A; 2, 3 on B): a hierarchical group,
// giving the flat tree's bits for float32 (several 8 MiB pieces) and bf16
// sums, the exact maximum, and every member's broadcast.
TEST(Hier, TwoHostsOfTwoGiveTheFlatTreesBits) {
  const int64_t n = 3 * (1 << 20) + 17;
  const auto xs = all_values(4, n);
  const auto want = tree(xs, add_f32);
  ASSERT_FALSE(torch::equal(want, chain(xs)));
  std::vector<torch::Tensor> bf;
  for (const auto& x : xs) bf.push_back(x.to(torch::kBFloat16));
  const auto want16 = tree(bf, add_bf16);
  std::vector<torch::Tensor> short_xs;
  for (int r = 0; r < 4; ++r) short_xs.push_back(values(r, 1001));
  const auto want_max = torch::stack(short_xs).amax(0);
  auto errors = with_group({"A", "A", "B", "B"}, "two-by-two", [&](int r, comm::Collective& g) {
    EXPECT_STREQ(g.transport(), "hierarchical");
    EXPECT_EQ(g.size(), 4);
    EXPECT_EQ(g.rank(), r);
    auto t = values(r, n);
    g.allreduce_sum(t);
    EXPECT_TRUE(torch::equal(t, want)) << "member " << r;
    auto h = values(r, n).to(torch::kBFloat16);
    g.allreduce_sum_16(h);
    EXPECT_TRUE(torch::equal(h, want16)) << "member " << r;
    auto m = values(r, 1001);
    g.allreduce_max(m);
    EXPECT_TRUE(torch::equal(m, want_max)) << "member " << r;
    for (int root = 0; root < 4; ++root) {
      auto b = values(r, 777);
      g.broadcast(b, root);
      EXPECT_TRUE(torch::equal(b, values(root, 777))) << "member " << r << ", root " << root;
    }
  });
  limbo::testing::expect_no_member_errors(errors);
}

// Hosts of different sizes (2 + 3 + 1: one chunk, led by each host's first
// member) and hosts whose ranks interleave (A holds 0 and 2): every member
// ends with the same bits, the sum within float32 rounding of the exact
// one, and the maximum and broadcasts exact.
TEST(Hier, UnevenAndInterleavedHostsAgreeOnEveryMember) {
  for (const auto& hosts : std::vector<std::vector<std::string>>{{"A", "A", "B", "B", "B", "C"}, {"A", "B", "A", "B"}}) {
    const int world = static_cast<int>(hosts.size());
    const int64_t n = 100003;
    const auto xs = all_values(world, n);
    auto exact = torch::zeros({n}, torch::kFloat64);
    for (const auto& x : xs) exact += x.to(torch::kFloat64);
    std::vector<torch::Tensor> sums(world);
    auto errors = with_group(hosts, "uneven" + std::to_string(world), [&](int r, comm::Collective& g) {
      EXPECT_STREQ(g.transport(), "hierarchical");
      auto t = values(r, n);
      g.allreduce_sum(t);
      sums[r] = t;
      auto m = values(r, n);
      g.allreduce_max(m);
      EXPECT_TRUE(torch::equal(m, torch::stack(xs).amax(0))) << "member " << r;
      for (int root = 0; root < world; ++root) {
        auto b = values(r, 99);
        g.broadcast(b, root);
        EXPECT_TRUE(torch::equal(b, values(root, 99))) << "member " << r << ", root " << root;
      }
    });
    limbo::testing::expect_no_member_errors(errors);
    for (int r = 0; r < world; ++r) {
      ASSERT_TRUE(sums[r].defined());
      EXPECT_TRUE(torch::equal(sums[r], sums[0])) << "member " << r;
    }
    EXPECT_LT((sums[0].to(torch::kFloat64) - exact).abs().max().item<double>(), 1e-3 * (1 + exact.abs().max().item<double>()));
  }
}

// Which group: one member per host, or hierarchical off, is one flat Gloo
// group.
TEST(Hier, OneMemberPerHostOrHierarchyOffIsFlatGloo) {
  for (bool hierarchical : {true, false}) {
    const std::vector<std::string> hosts = hierarchical ? std::vector<std::string>{"A", "B", "C"}
                                                        : std::vector<std::string>{"A", "A", "B", "B"};
    auto errors = with_group(hosts, hierarchical ? "one-each" : "off", [&](int r, comm::Collective& g) {
      EXPECT_STREQ(g.transport(), "gloo");
      auto t = torch::full({3}, static_cast<float>(r + 1));
      g.allreduce_sum(t);
      EXPECT_EQ(t[0].item<float>(), hierarchical ? 6.0f : 10.0f);
    }, hierarchical);
    limbo::testing::expect_no_member_errors(errors);
  }
}

// Member 3 (host B) aborts while the other three wait in an all-reduce for
// it: they fail with PeerFailure (its host through the segment's flag, host
// A through the cross groups' connections), long before the 20 s timeout.
TEST(Hier, AnAbortOnOneHostFailsTheMembersOfEveryHost) {
  std::vector<std::string> outcome(4);
  std::vector<double> seconds(4);
  auto errors = with_group({"A", "A", "B", "B"}, "abort", [&](int r, comm::Collective& g) {
    auto warm = values(r, 1000);
    g.allreduce_sum(warm);
    if (r == 3) {
      std::this_thread::sleep_for(std::chrono::milliseconds(300));
      g.abort();
      return;
    }
    const auto start = std::chrono::steady_clock::now();
    auto t = values(r, 1 << 20);
    try {
      g.allreduce_sum(t);
      outcome[r] = "completed";
    } catch (const PeerFailure&) {
      outcome[r] = "PeerFailure";
    } catch (const std::exception& e) {
      outcome[r] = std::string("other: ") + e.what();
    }
    seconds[r] = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  });
  limbo::testing::expect_no_member_errors(errors);
  for (int r = 0; r < 3; ++r) {
    EXPECT_EQ(outcome[r], "PeerFailure") << "member " << r;
    EXPECT_LT(seconds[r], 15.0) << "member " << r << " waited for the timeout instead";
  }
}

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  at::set_num_threads(1);
  return RUN_ALL_TESTS();
}
