// One worker's side of elastic membership.
//
// Registers in the store (an id, `join/<id>`), bumps its heartbeat `hb/<id>`
// from a background thread every `elastic/heartbeat_interval_ms` (set by the
// coordinator; heartbeat_interval when absent), waits for rounds that list
// it and forms a fresh Gloo group per round (prefix `elastic/round/<k>`;
// reusing a prefix finds stale peer addresses). The caller owns the group;
// destroying it closes its connections, which tells peers still blocked in
// a collective of that round at once.
//
// The same thread watches `elastic/abort`: when the coordinator aborts the
// round of this member's group (a member went silent), it aborts the group
// (Collective::abort), so a collective blocked on the silent member fails
// within one heartbeat interval instead of at the collective timeout.
#pragma once

#include <atomic>
#include <chrono>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "comm/collective.h"
#include "comm/kv_store.h"
#include "elastic/coordinator.h"

namespace limbo::elastic {

struct MemberOptions {
  comm::GroupOptions group;  // store address, timeouts, bind host
  std::chrono::milliseconds heartbeat_interval{100};
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
  void beat_and_watch(comm::KvStore& s);

  std::atomic<bool> stop_{false};
  std::mutex group_mu_;
  std::weak_ptr<comm::Collective> group_;  // the last group formed, and its round
  int64_t group_round_ = 0;
  std::thread heartbeat_;
};

}  // namespace limbo::elastic
