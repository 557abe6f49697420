// One worker's side of elastic membership.
//
// Registers in the store (an id, `join/<id>`), bumps its heartbeat `hb/<id>`
// from a background thread every `heartbeat_interval`, waits for rounds that
// list it and forms a fresh Gloo group per round (prefix
// `elastic/round/<k>`; reusing a prefix finds stale peer addresses). The
// caller owns the group; destroying it closes its connections, which tells
// peers still blocked in a collective of that round at once.
#pragma once

#include <atomic>
#include <chrono>
#include <memory>
#include <thread>
#include <vector>

#include "comm/collective.h"
#include "comm/kv_store.h"
#include "elastic/coordinator.h"

namespace limbo::elastic {

struct MemberOptions {
  comm::GroupOptions group;  // store address, timeouts, bind host
  std::chrono::milliseconds heartbeat_interval{500};
  std::chrono::milliseconds round_timeout{120000};
};

class Member {
 public:
  Member(std::shared_ptr<comm::KvStore> store, MemberOptions opt);
  ~Member();

  int64_t id() const { return id_; }
  // Blocks until a round newer than `after` lists this member. Throws
  // Timeout after round_timeout.
  Round wait_round(int64_t after);
  // True when the store holds a round newer than `current` (cheap).
  bool newer_round(int64_t current);
  // Asks the coordinator for a round after `current`.
  void request_round(int64_t current);
  void leave();
  // Sets `elastic/progress` (fractional epochs), read by the launcher's
  // --elastic-schedule.
  void publish_progress(double epoch);
  // Sets `elastic/done`: training completed (every member reaches the same
  // last step). The launcher ends the job then, whatever else happened.
  void publish_done();
  // Forms the Gloo group of `round` (blocks until every member joined).
  std::shared_ptr<comm::Collective> form_group(const Round& round);
  int rank_in(const Round& round) const;

 private:
  std::shared_ptr<comm::KvStore> store_;
  MemberOptions opt_;
  int64_t id_ = 0;
  std::atomic<bool> stop_{false};
  std::thread heartbeat_;
};

}  // namespace limbo::elastic
