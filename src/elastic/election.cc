#include "elastic/election.h"

#include <algorithm>
#include <cmath>

#include "common/log.h"
#include "common/process.h"

namespace limbo::elastic {
namespace {

const char* kBeat = "elastic/coordinator_beat";
// The highest term ever reserved (no lease: it outlives every coordinator).
const char* kTerms = "elastic/coordinator_terms";

int64_t term_of(const std::string& value) {
  try {
    return std::stoll(value.substr(0, value.find(' ')));
  } catch (const std::exception&) {
    return 0;
  }
}

}  // namespace

Election::Election(const comm::EtcdOptions& o, std::string me, std::chrono::milliseconds heartbeat_timeout)
    : c_(o, heartbeat_timeout),
      prefix_(o.prefix()),
      me_(std::move(me)),
      timeout_(heartbeat_timeout),
      interval_(std::max<std::chrono::milliseconds>(std::chrono::milliseconds(10), heartbeat_timeout / 4)) {
  // The lease outlives a few missed renewals; etcd rounds a TTL below its
  // minimum (about 2 s with default election timing) up to it.
  lease_ttl_s_ = std::max(3, static_cast<int>(std::ceil(heartbeat_timeout.count() * 5 / 1000.0)));
  thread_ = std::thread([this] { loop(); });
}

Election::~Election() {
  stop_ = true;
  if (thread_.joinable()) thread_.join();
  try {
    resign();
  } catch (const std::exception&) {
    // the lease expires on its own
  }
}

void Election::loop() {
  name_this_thread("limbo-election");
  while (!stop_) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (!stop_) tick();
    }
    std::this_thread::sleep_for(std::min<std::chrono::milliseconds>(interval_, std::chrono::milliseconds(20)));
  }
}

std::string Election::fence_value() const {
  std::lock_guard<std::mutex> lock(mu_);
  return value_;
}

void Election::resign() {
  stop_ = true;
  std::lock_guard<std::mutex> lock(mu_);
  if (lease_) c_.revoke_lease(lease_);
  lease_ = 0;
  leading_ = false;
}

void Election::ensure_lease() {
  const auto now = Clock::now();
  if (lease_ && now - last_keepalive_ < std::chrono::seconds(1)) return;
  if (lease_ && c_.keep_alive(lease_)) {
    last_keepalive_ = now;
    return;
  }
  if (lease_ && leading_) step_down_locked("its etcd lease expired");
  lease_ = c_.grant_lease(lease_ttl_s_);
  last_keepalive_ = now;
}

void Election::tick() {
  const auto now = Clock::now();
  if (now < next_) return;
  next_ = now + interval_;
  try {
    if (leading_) lead_tick();
    else follow_tick();
  } catch (const comm::FencedOut& e) {
    step_down_locked(e.what());
  } catch (const Error& e) {
    read_failed_ = true;
    // A leader that cannot renew its lease for its whole TTL has lost it.
    if (leading_ && Clock::now() - last_beat_ok_ > std::chrono::seconds(lease_ttl_s_))
      step_down_locked(std::string("no answer from etcd for the lease's TTL (") + e.what() + ")");
  }
}

void Election::lead_tick() {
  ensure_lease();
  if (!leading_) return;
  using Cmp = comm::EtcdClient::Compare;
  if (!c_.txn({{Cmp::Value, prefix_ + kKey, value_, 0}}, {{prefix_ + kBeat, std::to_string(++beats_)}}))
    return step_down_locked("the coordinator key no longer holds '" + value_ + "'");
  last_beat_ok_ = Clock::now();
}

void Election::follow_tick() {
  const auto now = Clock::now();
  std::string value, beat;
  int64_t mod_revision = 0;
  bool present = false;
  for (const auto& kv : c_.list(prefix_ + kKey)) {
    if (kv.key == prefix_ + kKey) {
      present = true;
      value = kv.value;
      mod_revision = kv.mod_revision;
    } else if (kv.key == prefix_ + kBeat) {
      beat = kv.value;
    }
  }
  // Silence counts only over time this launcher's own reads went through.
  if (read_failed_ || value != seen_value_ || beat != seen_beat_) seen_change_ = now;
  read_failed_ = false;
  seen_value_ = value;
  seen_beat_ = beat;
  if (!present) {
    if (const int64_t term = reserve_term(1 + term_of(value)))
      campaign(0, term, "nobody (no coordinator yet, or its lease expired)");
  } else if (now - seen_change_ > timeout_) {
    if (const int64_t term = reserve_term(term_of(value) + 1))
      campaign(mod_revision, term, "'" + value + "', silent for " + std::to_string(timeout_.count()) + " ms");
  }
}

// Terms are taken from a counter that no lease removes, so a fence value
// ("<term> <launcher>") is never used twice: when the coordinator key is
// gone (its lease expired), the next term still follows every earlier one.
// 0 when another launcher reserved one at the same time (the next tick
// tries again).
int64_t Election::reserve_term(int64_t at_least) {
  using Cmp = comm::EtcdClient::Compare;
  const auto kv = c_.get(prefix_ + kTerms);
  const int64_t term = std::max(kv ? term_of(kv->value) + 1 : 1, at_least);
  const Cmp cond = kv ? Cmp{Cmp::ModRevision, prefix_ + kTerms, "", kv->mod_revision}
                      : Cmp{Cmp::CreateRevision, prefix_ + kTerms, "", 0};
  return c_.txn({cond}, {{prefix_ + kTerms, std::to_string(term)}}) ? term : 0;
}

bool Election::campaign(int64_t expected_mod_revision, int64_t term, const std::string& from) {
  ensure_lease();
  using Cmp = comm::EtcdClient::Compare;
  const std::string value = std::to_string(term) + " " + me_;
  const Cmp cond = expected_mod_revision == 0 ? Cmp{Cmp::CreateRevision, prefix_ + kKey, "", 0}
                                              : Cmp{Cmp::ModRevision, prefix_ + kKey, "", expected_mod_revision};
  if (!c_.txn({cond}, {{prefix_ + kKey, value}}, lease_)) return false;  // another launcher won
  value_ = value;
  leading_ = true;
  last_beat_ok_ = Clock::now();
  log_info("launch: this launcher coordinates the job now (term " + std::to_string(term) + ", after " + from + ")");
  lead_tick();
  return true;
}

// (Called on the election's thread, or by the launcher when a fenced write
// was refused: then the next tick sees the new holder.)
void Election::step_down(const std::string& why) {
  std::lock_guard<std::mutex> lock(mu_);
  step_down_locked(why);
}

void Election::step_down_locked(const std::string& why) {
  if (!leading_.exchange(false)) return;
  seen_change_ = Clock::now();
  log_warn("launch: no longer the coordinator: " + why);
}

}  // namespace limbo::elastic
