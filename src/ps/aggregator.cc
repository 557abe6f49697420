#include "ps/aggregator.h"

#include <cmath>

#include "common/error.h"

namespace limbo::ps {

Protocol parse_protocol(const std::string& s) {
  if (s == "hardsync") return Protocol::Hardsync;
  if (s == "softsync") return Protocol::Softsync;
  throw InvalidInput("unknown protocol '" + s + "' (expected hardsync or softsync)");
}

StalenessPolicy parse_staleness_policy(const std::string& s) {
  if (s == "constant") return StalenessPolicy::Constant;
  if (s == "inverse") return StalenessPolicy::Inverse;
  if (s == "inverse_sqrt") return StalenessPolicy::InverseSqrt;
  throw InvalidInput("unknown staleness policy '" + s + "' (expected constant, inverse or inverse_sqrt)");
}

BoundAction parse_bound_action(const std::string& s) {
  if (s == "drop") return BoundAction::Drop;
  if (s == "wait") return BoundAction::Wait;
  throw InvalidInput("unknown staleness bound action '" + s + "' (expected drop or wait)");
}

const char* protocol_name(Protocol p) { return p == Protocol::Hardsync ? "hardsync" : "softsync"; }
const char* policy_name(StalenessPolicy p) {
  switch (p) {
    case StalenessPolicy::Constant: return "constant";
    case StalenessPolicy::InverseSqrt: return "inverse_sqrt";
    default: return "inverse";
  }
}

double staleness_lr(StalenessPolicy p, double alpha0, int64_t tau) {
  if (p == StalenessPolicy::Constant || tau <= 0) return alpha0;
  if (p == StalenessPolicy::InverseSqrt) return alpha0 / std::sqrt(static_cast<double>(tau));
  return alpha0 / static_cast<double>(tau);
}

Aggregator::Aggregator(AggregatorOptions opt) : opt_(opt) {
  if (opt_.softsync_n < 1) throw InvalidInput("ps.softsync_n must be >= 1");
  if (opt_.alpha0 <= 0) throw InvalidInput("the learning rate alpha0 (optim.lr) must be > 0");
  if (opt_.max_staleness < 0) throw InvalidInput("ps.max_staleness must be >= 0 (0 = unbounded)");
}

bool Aggregator::add_learner(uint32_t id) { return learners_.emplace(id, Learner{}).second; }

bool Aggregator::remove_learner(uint32_t id) { return learners_.erase(id) != 0; }

std::vector<uint32_t> Aggregator::learner_ids() const {
  std::vector<uint32_t> ids;
  for (const auto& [id, l] : learners_) ids.push_back(id);
  return ids;
}

int Aggregator::c() const {
  if (opt_.protocol == Protocol::Hardsync) return std::max(1, learners());
  return std::max(1, learners() / opt_.softsync_n);
}

void Aggregator::on_pull(uint32_t id) {
  auto it = learners_.find(id);
  if (it == learners_.end()) return;
  it->second.outstanding = true;
  it->second.pulled = clock_;
}

bool Aggregator::held_by_bound() const {
  if (opt_.max_staleness <= 0 || opt_.bound_action != BoundAction::Wait) return false;
  for (const auto& [id, l] : learners_)
    if (l.outstanding && static_cast<int64_t>(clock_ + 1 - l.pulled) > opt_.max_staleness) return true;
  return false;
}

bool Aggregator::may_pull(uint32_t id) const {
  auto it = learners_.find(id);
  if (it == learners_.end()) return true;  // observers and unknown learners are answered
  if (opt_.protocol == Protocol::Hardsync) return !it->second.contributed;
  if (it->second.contributed && static_cast<int>(pending_.size()) >= c() && held_by_bound()) return false;
  return true;
}

Aggregator::Offer Aggregator::offer(uint32_t id, uint64_t pulled) {
  Offer o;
  auto it = learners_.find(id);
  if (it == learners_.end()) {
    o.why = "learner " + std::to_string(id) + " is not registered";
    return o;
  }
  if (pulled > clock_) {
    o.why = "gradient computed at clock " + std::to_string(pulled) + ", ahead of the server clock " +
            std::to_string(clock_);
    return o;
  }
  Learner& l = it->second;
  if (opt_.protocol == Protocol::Hardsync && l.contributed) {
    o.why = "hardsync: learner " + std::to_string(id) + " already pushed in this round";
    return o;
  }
  l.outstanding = false;
  o.tau = static_cast<int64_t>(clock_ - pulled);
  if (opt_.max_staleness > 0 && o.tau > opt_.max_staleness && opt_.bound_action == BoundAction::Drop) {
    o.outcome = Offer::Dropped;
    return o;
  }
  o.outcome = Offer::Accepted;
  o.alpha = staleness_lr(opt_.policy, opt_.alpha0, o.tau);
  l.contributed = true;
  pending_.push_back(o.tau);
  return o;
}

void Aggregator::retract(uint32_t id, uint64_t pulled) {
  auto it = learners_.find(id);
  if (it == learners_.end() || pending_.empty()) return;
  pending_.pop_back();
  it->second.contributed = false;
  it->second.outstanding = true;
  it->second.pulled = pulled;
}

bool Aggregator::ready() const {
  if (pending_.empty()) return false;
  if (opt_.protocol == Protocol::Hardsync) {
    for (const auto& [id, l] : learners_)
      if (!l.contributed) return false;
    return true;
  }
  return static_cast<int>(pending_.size()) >= c() && !held_by_bound();
}

std::vector<int64_t> Aggregator::commit() {
  std::vector<int64_t> taus;
  taus.swap(pending_);
  for (auto& [id, l] : learners_) l.contributed = false;
  clock_ += 1;
  return taus;
}

}  // namespace limbo::ps
