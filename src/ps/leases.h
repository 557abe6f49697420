// Data assignment for asynchronous training (kept by shard 0).
//
// The epoch's sample order is a pure function of (order, seed, epoch) (see
// data/sampler.h), so a batch is fully named by (epoch, position, count).
// Shard 0 hands batches out as leases, in order, from a global cursor. A
// lease ends when shard 0 receives the gradient computed on it (whatever the
// outcome: applied or dropped for staleness). When a learner leaves or is
// dropped, its unfinished leases go back to a queue and are handed out again
// before any new batch.
//
// Guarantee: within an epoch every sample is handed out in exactly one lease
// that ends with a gradient received, however learners join or leave, as
// long as shard 0 runs without a restart. Leases that never end (their
// learner crashed) are re-issued, so nothing is skipped; no completed lease
// is re-issued, so nothing is repeated. A shard-0 restart rewinds the cursor
// to its checkpoint together with its weights (docs/parameter-server.md).
#pragma once

#include <cstdint>
#include <deque>
#include <map>

#include "data/sampler.h"

namespace limbo::ps {

struct Lease {
  int64_t id = -1;
  int64_t epoch = 0, position = 0, count = 0;
  uint32_t learner = 0;
};

class LeaseBook {
 public:
  LeaseBook(int64_t dataset_size, int64_t batch, int64_t epochs);

  enum class Next { Granted, Wait, Done };
  // Next batch for `learner` (any lease it still holds is re-queued first: a
  // learner holds at most one): Granted (lease filled in), Wait (all batches
  // are out but some may come back), or Done (every batch has ended).
  Next next(uint32_t learner, Lease& lease);
  // The gradient of a lease arrived. False if unknown (already ended/reissued).
  bool complete(int64_t lease_id);
  // A learner left: its open leases go back to the queue.
  int release(uint32_t learner);

  data::Cursor cursor() const { return cursor_; }
  // Samples handed out and ended so far (all epochs).
  int64_t completed_samples() const { return completed_samples_; }
  int64_t open() const { return static_cast<int64_t>(open_.size()); }
  double epoch_progress() const;  // completed samples / dataset size

  // Checkpointing: cursor, counters, and the open + queued leases as
  // (epoch, position, count) triples that are re-queued on restore.
  struct Snapshot {
    data::Cursor cursor;
    int64_t completed_samples = 0;
    int64_t next_id = 0;
    std::deque<Lease> queued;
  };
  Snapshot snapshot() const;
  void restore(const Snapshot& s);

 private:
  int64_t n_, batch_, epochs_;
  data::Cursor cursor_;
  int64_t next_id_ = 0;
  int64_t completed_samples_ = 0;
  std::map<int64_t, Lease> open_;
  std::deque<Lease> queue_;  // returned leases, handed out first
};

}  // namespace limbo::ps
