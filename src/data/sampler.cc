#include "data/sampler.h"

#include <algorithm>
#include <numeric>
#include <random>

#include "common/error.h"

namespace limbo::data {
namespace {

// SplitMix64: a well-mixed 64-bit stream, fully specified here so orders are
// identical across standard libraries (std::shuffle is not).
struct SplitMix64 {
  uint64_t s;
  uint64_t next() {
    uint64_t z = (s += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }
  // Unbiased integer in [0, bound) by rejection.
  uint64_t below(uint64_t bound) {
    uint64_t limit = UINT64_MAX - UINT64_MAX % bound;
    uint64_t x;
    do x = next(); while (x >= limit);
    return x % bound;
  }
};

}  // namespace

Order parse_order(const std::string& name) {
  if (name == "shuffle") return Order::Shuffle;
  if (name == "fixed-cycle") return Order::FixedCycle;
  if (name == "sequential") return Order::Sequential;
  throw InvalidInput("unknown sample order '" + name +
                     "'; allowed: shuffle, fixed-cycle, sequential");
}

const char* order_name(Order o) {
  switch (o) {
    case Order::Shuffle: return "shuffle";
    case Order::FixedCycle: return "fixed-cycle";
    case Order::Sequential: return "sequential";
  }
  return "?";
}

Sampler::Sampler(int64_t dataset_size, Order order, uint64_t seed)
    : n_(dataset_size), order_(order), seed_(seed) {
  if (n_ <= 0) throw InvalidInput("cannot sample from an empty dataset");
}

const std::vector<int64_t>& Sampler::epoch_order(int64_t epoch) {
  int64_t key = order_ == Order::Shuffle ? epoch : 0;
  if (key == cached_epoch_) return cache_;
  cache_.resize(n_);
  std::iota(cache_.begin(), cache_.end(), int64_t{0});
  if (order_ != Order::Sequential) {
    SplitMix64 rng{seed_ * 0xD1B54A32D192ED03ull + static_cast<uint64_t>(key) + 1};
    for (int64_t i = n_ - 1; i > 0; --i)
      std::swap(cache_[i], cache_[rng.below(static_cast<uint64_t>(i) + 1)]);
  }
  cached_epoch_ = key;
  return cache_;
}

std::vector<int64_t> slice_bounds(int64_t global, int world, const std::vector<int64_t>& weights) {
  std::vector<int64_t> b(static_cast<size_t>(world) + 1);
  if (weights.empty()) {
    for (int r = 0; r <= world; ++r) b[static_cast<size_t>(r)] = global * r / world;
    return b;
  }
  if (static_cast<int>(weights.size()) != world)
    throw Error("internal: " + std::to_string(weights.size()) + " shares for a group of " + std::to_string(world));
  int64_t total = 0;
  for (int64_t w : weights) {
    if (w < 1) throw Error("internal: a share of weight " + std::to_string(w));
    total += w;
  }
  int64_t cum = 0;
  for (int r = 0; r < world; ++r) {
    b[static_cast<size_t>(r)] = global * cum / total;
    cum += weights[static_cast<size_t>(r)];
  }
  b[static_cast<size_t>(world)] = global;
  if (global < world) return b;
  // At least one sample each: up from the front, then down from the back.
  for (int r = 1; r < world; ++r) b[r] = std::max(b[r], b[r - 1] + 1);
  for (int r = world - 1; r > 0; --r) b[r] = std::min(b[r], b[r + 1] - 1);
  return b;
}

BatchPlan plan_batch(Sampler& sampler, Cursor at, int64_t per_worker, int world, int rank,
                     bool drop_last, const std::vector<int64_t>& weights) {
  if (per_worker <= 0 || world <= 0 || rank < 0 || rank >= world)
    throw InvalidInput("plan_batch: bad batch " + std::to_string(per_worker) + ", world " +
                       std::to_string(world) + ", rank " + std::to_string(rank));
  const int64_t n = sampler.dataset_size();
  const int64_t want = per_worker * world;
  if (at.position >= n || (drop_last && n - at.position < want)) {
    at = {at.epoch + 1, 0};  // the previous epoch is exhausted
    if (drop_last && want > n)
      throw InvalidInput("global batch " + std::to_string(want) + " exceeds dataset size " +
                         std::to_string(n) + " with drop_last");
  }
  BatchPlan plan;
  plan.begin = at;
  plan.global_size = std::min(want, n - at.position);
  if (!drop_last && n - at.position - plan.global_size < world) plan.global_size = n - at.position;
  const auto& order = sampler.epoch_order(at.epoch);
  const auto bounds = slice_bounds(plan.global_size, world, weights);
  const int64_t lo = at.position + bounds[static_cast<size_t>(rank)];
  const int64_t hi = at.position + bounds[static_cast<size_t>(rank) + 1];
  plan.ids.assign(order.begin() + lo, order.begin() + hi);
  if (plan.ids.empty()) {
    plan.padded = true;
    plan.ids.push_back(order[static_cast<size_t>(at.position + rank % plan.global_size)]);
  }
  int64_t next = at.position + plan.global_size;
  plan.last_in_epoch = next >= n || (drop_last && n - next < want);
  plan.end = plan.last_in_epoch ? Cursor{at.epoch + 1, 0} : Cursor{at.epoch, next};
  return plan;
}

int64_t batches_per_epoch(int64_t n, int64_t global_batch, bool drop_last, int world) {
  if (drop_last) return n / global_batch;
  const int64_t rest = n % global_batch;
  if (n >= global_batch && rest > 0 && rest < world) return n / global_batch;
  return (n + global_batch - 1) / global_batch;
}

}  // namespace limbo::data
