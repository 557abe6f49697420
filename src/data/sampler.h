// Deterministic sample orders and how a batch is cut from them.
//
// An epoch has one global order of sample ids, a pure function of
// (order kind, seed, epoch):
//   shuffle     - a fresh permutation every epoch;
//   fixed-cycle - one permutation drawn from the seed, repeated every epoch,
//                 so the same batches recur in the same order (ISGD);
//   sequential  - 0, 1, 2, ... (evaluation).
// A Cursor (epoch, position) says how many samples of that epoch's order the
// whole job has consumed. A global batch is the next G samples after the
// cursor; worker `rank` of `world` takes a contiguous slice of it. Because the
// cursor is global, a restart or a change of world size neither repeats nor
// skips a sample within the epoch.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace limbo::data {

enum class Order { Shuffle, FixedCycle, Sequential };
Order parse_order(const std::string& name);  // throws InvalidInput
const char* order_name(Order o);

struct Cursor {
  int64_t epoch = 0;
  int64_t position = 0;  // samples of this epoch already consumed (all workers)
  bool operator==(const Cursor& o) const { return epoch == o.epoch && position == o.position; }
};

class Sampler {
 public:
  Sampler(int64_t dataset_size, Order order, uint64_t seed);
  // Global order for `epoch`; the last one is cached. Not thread-safe.
  const std::vector<int64_t>& epoch_order(int64_t epoch);
  int64_t dataset_size() const { return n_; }
  Order order() const { return order_; }

 private:
  int64_t n_;
  Order order_;
  uint64_t seed_;
  int64_t cached_epoch_ = -1;
  std::vector<int64_t> cache_;
};

struct BatchPlan {
  std::vector<int64_t> ids;  // this worker's sample ids
  Cursor begin, end;         // cursor before / after the global batch
  int64_t global_size = 0;   // samples in the global batch (all workers)
  bool last_in_epoch = false;
  // This worker's slice of the global batch is empty: `ids` holds one
  // sample of another worker's slice, which the step computes with weight 0
  // (it counts for nothing in the gradient, the loss or the buffers).
  bool padded = false;
  // Samples this worker contributes to the global batch (0 when padded).
  int64_t samples() const { return padded ? 0 : static_cast<int64_t>(ids.size()); }
};

// Member r's slice of a global batch of `global` samples is [bounds[r],
// bounds[r + 1]) of the result (world + 1 offsets). `weights` (integers, one
// a member; empty: equal) share it out: slices in proportion, every member
// at least one sample when global >= world. Equal weights: slices differ by
// at most one sample.
std::vector<int64_t> slice_bounds(int64_t global, int world, const std::vector<int64_t>& weights = {});

// Cuts the next global batch of up to per_worker * world samples at `at`.
// The final batch of an epoch is smaller unless drop_last (then the remainder
// is skipped and the next epoch starts). Slices follow `weights` (see
// slice_bounds; empty: equal, differing by at most one sample); the global
// batch does not depend on them.
// A remainder of fewer samples than members would leave a member without a
// sample: it joins the batch before (at most world - 1 samples more), so an
// epoch's last batch is never split into empty slices. Only a group larger
// than what is left of the epoch when the step starts (it grew after the
// batch before was cut, or the data set is smaller than the group) leaves a
// worker's slice empty: it is padded with one sample of another slice, of
// weight 0 (BatchPlan::padded), so that every member runs the same step.
BatchPlan plan_batch(Sampler& sampler, Cursor at, int64_t per_worker, int world, int rank,
                     bool drop_last, const std::vector<int64_t>& weights = {});

// Number of global batches per epoch for this configuration (`world`
// members: a remainder of fewer samples joins the batch before).
int64_t batches_per_epoch(int64_t dataset_size, int64_t global_batch, bool drop_last, int world = 1);

}  // namespace limbo::data
