// The parameter server's decision logic, without tensors or sockets: who is
// registered, the clock, how many gradients make an update (c), each
// gradient's staleness and learning rate, the hardsync barrier, the
// staleness bound, and whether a learner's pull may be answered now.
// The shard server (and the simulator) own the tensors and call this.
//
// Protocols (Zhang et al., "Staleness-aware Async-SGD"):
//   hardsync    - one gradient from every registered learner, then update;
//                 a learner that has pushed in the current round is not
//                 answered a pull until the update. tau = 0 always.
//   n-softsync  - update as soon as c = max(1, floor(lambda / n)) gradients
//                 are pending, from any learners. lambda = registered learners,
//                 re-read whenever it changes.
// Each gradient gets alpha(tau): constant alpha0, or inverse alpha0 / tau,
// or inverse_sqrt alpha0 / sqrt(tau)
// (alpha0 at tau = 0). The update is  w -= (1/k) sum alpha(tau_l) g_l  over
// the k gradients pending (k = c normally; k can exceed c under the "wait"
// bound, when an update was held back).
//
// Staleness bound (max_staleness > 0):
//   drop - a gradient with tau > max_staleness is discarded and counted;
//   wait - an update is held back while it would leave some learner's
//          outstanding pull more than max_staleness behind; learners that
//          already contributed to the held update wait for their next pull
//          (stale-synchronous style). Held gradients are applied once the
//          slow learner pushes or is dropped.
#pragma once

#include <chrono>
#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace limbo::ps {

enum class Protocol { Hardsync, Softsync };
enum class StalenessPolicy { Constant, Inverse, InverseSqrt };
enum class BoundAction { Drop, Wait };
Protocol parse_protocol(const std::string& s);
StalenessPolicy parse_staleness_policy(const std::string& s);
BoundAction parse_bound_action(const std::string& s);
const char* protocol_name(Protocol p);
const char* policy_name(StalenessPolicy p);

struct AggregatorOptions {
  Protocol protocol = Protocol::Softsync;
  int softsync_n = 1;
  StalenessPolicy policy = StalenessPolicy::Inverse;
  double alpha0 = 0.01;
  int64_t max_staleness = 0;  // 0 = unbounded
  BoundAction bound_action = BoundAction::Drop;
};

// Learning rate for one gradient of staleness tau.
double staleness_lr(StalenessPolicy p, double alpha0, int64_t tau);

class Aggregator {
 public:
  explicit Aggregator(AggregatorOptions opt);  // throws InvalidInput on bad options

  // Registration. Adding an existing learner is a no-op (returns false).
  bool add_learner(uint32_t id);
  // Removes a learner and anything it had pending is kept (its gradient was
  // valid when it arrived). Returns false when it was not registered.
  bool remove_learner(uint32_t id);
  bool registered(uint32_t id) const { return learners_.count(id) != 0; }
  int learners() const { return static_cast<int>(learners_.size()); }
  std::vector<uint32_t> learner_ids() const;

  uint64_t clock() const { return clock_; }
  void set_clock(uint64_t c) { clock_ = c; }  // restore from a checkpoint
  // Gradients per update for the current lambda (1 with no learners).
  int c() const;

  // A pull answered at the current clock: the learner now has an
  // outstanding gradient based on clock().
  void on_pull(uint32_t id);
  // May this learner's pull be answered now (else it is held)?
  bool may_pull(uint32_t id) const;

  struct Offer {
    enum Outcome { Accepted, Dropped, Rejected } outcome = Rejected;
    int64_t tau = 0;
    double alpha = 0;
    std::string why;  // for Rejected
  };
  // A gradient from `id` computed on weights of clock `pulled`. Accepted
  // gradients are pending until the next update.
  Offer offer(uint32_t id, uint64_t pulled);

  // Takes back the offer just accepted from `id` (pulled at `pulled`): the
  // caller found the gradient unusable (e.g. NaN) after offering it.
  void retract(uint32_t id, uint64_t pulled);

  // True when the pending gradients make an update now.
  bool ready() const;
  int pending() const { return static_cast<int>(pending_.size()); }
  // Applies the pending set: advances the clock and returns the staleness of
  // each gradient in it (the caller has already accumulated alpha * g and
  // divides by the returned size).
  std::vector<int64_t> commit();

  const AggregatorOptions& options() const { return opt_; }

 private:
  struct Learner {
    bool outstanding = false;  // pulled, not yet pushed
    uint64_t pulled = 0;
    bool contributed = false;  // has a gradient in the pending set
  };
  bool held_by_bound() const;

  AggregatorOptions opt_;
  std::map<uint32_t, Learner> learners_;
  uint64_t clock_ = 0;
  std::vector<int64_t> pending_;  // staleness of pending gradients
};

}  // namespace limbo::ps
