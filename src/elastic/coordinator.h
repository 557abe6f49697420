// The membership coordinator of an elastic job (a thread of the launcher).
//
// Workers register in the store (an id from `next_id`, `join/<id>`), beat
// to the coordinator outside the store (elastic/beats.h: their launcher
// relays them to a BeatListener, whose table this coordinator reads; the
// listener's address is `elastic/beat_addr`, written by the constructor),
// may leave (`left/<id>`), are marked dead by their launcher when their
// process exits (`dead/<id>`), and may ask for a new round (`want/<k>`: a
// member of round k failed or wants a change). poll() reads what changed
// under the member keys since its last poll (KvStore::changes_since: over
// the embedded store only the changed keys) and writes a new round
// `round/<k>` (sorted member ids) and `round` = k when the alive set differs
// from the current round's members or a member asked. Alive = joined, not
// left, not marked dead, and beat within heartbeat_timeout (each beat dated
// to when its worker made it, on the coordinator's own clock, so worker
// clocks need not agree). A member found silent is marked `silent/<id>`
// (erased when it beats again): members waiting for a final checkpoint
// read it. When a member of the current round goes silent without leaving,
// poll() sets `elastic/abort` = that round: members abort its collectives at
// once (a stopped peer keeps its connections open, so they would otherwise
// wait for the collective timeout). Members beat every heartbeat_timeout / 4
// (`elastic/heartbeat_interval_ms`, written by the constructor).
// Below min_workers no round is written; after rendezvous_timeout below the
// minimum, poll() reports it so the launcher can stop the job.
// Every round and abort is also appended to an event log (`events` = n,
// `event/<n>` = "round k" | "abort k"), which members wait on in the store
// (a parked wait answered the moment the key is written), so they learn of
// a replaced round at once instead of at their next poll.
// A coordinator started while a job runs (a launcher that took over from
// one that was lost) resumes from the store's round, abort and event log;
// it gives every member a full heartbeat timeout from its first poll, and
// writes no round until each member of the current round has beaten or
// that timeout has passed (so its first round does not list members lost
// with the old coordinator's host).
#pragma once

#include <chrono>
#include <functional>
#include <map>
#include <memory>
#include <queue>
#include <set>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "comm/kv_store.h"
#include "elastic/beats.h"

namespace limbo::elastic {

// After a take-over, a member not yet heard from by the new coordinator
// is evicted only after this many heartbeat timeouts (its relay looks the
// new address up once acknowledgements stop; see BeatSender).
inline constexpr int kTakeOverGraceTimeouts = 3;

struct CoordinatorOptions {
  int min_workers = 1;
  int max_workers = 1 << 20;
  int initial_workers = 0;  // the first round waits for this many (the launcher's nproc)
  std::chrono::milliseconds heartbeat_timeout{3000};
  std::chrono::milliseconds rendezvous_timeout{120000};
  // Written to `elastic/beat_addr` (BeatListener::address()); empty: not
  // written (the beats reach the table otherwise, as in tests).
  std::string beat_address;
};

struct Round {
  int64_t number = 0;
  std::vector<int64_t> members;  // sorted worker ids; rank = index
};

// Parses / formats the value of `round/<k>`.
std::string format_members(const std::vector<int64_t>& ids);
std::vector<int64_t> parse_members(const std::string& s);

class Coordinator {
 public:
  using Clock = std::function<std::chrono::steady_clock::time_point()>;
  // `beats`: the members' heartbeats (a BeatListener's table).
  Coordinator(std::shared_ptr<comm::KvStore> store, CoordinatorOptions opt, std::shared_ptr<BeatTable> beats,
              Clock clock = [] { return std::chrono::steady_clock::now(); });

  struct Result {
    bool new_round = false;
    Round round;          // the current round after this poll
    std::string reason;   // why the new round was written
    bool below_minimum_timed_out = false;
    bool fell_below = false;  // this poll found too few workers, for the first time
    int alive = 0;
    std::vector<int64_t> aborted;  // silent members for which this poll aborted the round
    std::vector<int64_t> lost;     // members the new round dropped without their leaving
    std::vector<int64_t> crashed;  // those of them whose process the launcher saw exit
  };
  Result poll();
  // After training completed no round is written any more, but the
  // members that left still write the final evaluation, checkpoint and
  // summary: one whose beats stop (frozen, its host lost or frozen) is
  // marked `silent/<id>` like a member in training, so the next member of
  // its storage takes over; the mark of one that beats again is erased.
  void poll_ending();
  // The launcher saw worker `id`'s process exit.
  void mark_dead(int64_t id) {
    dead_.insert(id);
    pending_.push_back(id);
  }
  // The job stops (its hosting launcher got a signal): the members still
  // in it leave one change after another as their signals come, and the
  // writer checkpoints in the last; a round of fewer than min_workers is
  // written so that none is left without a round to leave in.
  void stopping() { stopping_ = true; }
  const Round& current() const { return current_; }
  // Testing aid: every poll looks at every member, as polls did before
  // silence was found by deadline (the two must agree).
  void testing_look_at_everyone(bool on) { look_at_everyone_ = on; }

 private:
  using Time = std::chrono::steady_clock::time_point;
  struct Liveness {
    std::vector<int64_t> alive;  // sorted
    std::set<int64_t> left;
    std::set<int64_t> silent;  // joined, neither left nor dead, and not beating
  };
  void resume();
  Result poll_once();
  void read_members();
  void note_key(const std::string& key, const std::string* value);
  // `ending`: members that left are watched for silence too.
  Liveness liveness(Time now, bool ending = false);
  enum class State : uint8_t { Out, Left, Silent, Alive };
  struct Looked {
    Time now{}, real_now{};
    bool ending = false, gap = false, everyone_quiet = false;
  };
  State look_at(int64_t id, const Looked& at);
  void set_state(int64_t id, State s);
  void abort_silent(const Liveness& l, Result& r);
  void mark_silent(const Liveness& l);
  bool below_minimum(size_t alive, Time now, Result& r);
  bool settling(const std::vector<int64_t>& alive, Time now);
  void write_round(const Liveness& l, Result& r);
  void publish_event(const std::string& what);
  std::shared_ptr<comm::KvStore> store_;
  CoordinatorOptions opt_;
  Clock clock_;
  Round current_;
  // The member keys as the last poll left them (read_members), and the
  // store revision they are at.
  int64_t revision_ = 0;
  std::unordered_set<int64_t> joined_, left_keys_, dead_keys_;
  std::set<int64_t> wanted_;  // rounds with a `want/<k>` key
  std::shared_ptr<BeatTable> beats_;
  // Each worker's latest beat in the table, kept up from its changes at
  // each poll (BeatTable::take_changes: no copy of the whole table).
  std::unordered_map<int64_t, BeatTable::Seen> seen_;
  // Each member's last beat as this coordinator dated it, and when it
  // falls silent unless it beats again (its entry in due_; Time{}: none).
  struct Heard {
    int64_t counter = 0;
    Time date{}, due{};
  };
  std::unordered_map<int64_t, Heard> heartbeats_;
  // Silence by deadline: a poll looks only at the members whose beat or
  // keys changed since the last (pending_) and those whose deadline passed
  // (due_, the earliest first; an entry whose member beat since is looked
  // at and queued again for its new deadline). Everyone is looked at only
  // when something changes for all (a gap, the ending, a take-over).
  std::vector<int64_t> pending_;
  std::priority_queue<std::pair<Time, int64_t>, std::vector<std::pair<Time, int64_t>>, std::greater<>> due_;
  std::unordered_map<int64_t, State> state_;  // members not Out
  std::set<int64_t> alive_, left_, silent_;
  std::vector<int64_t> alive_list_;  // alive_, sorted, rebuilt when it changed
  bool alive_changed_ = false;
  bool look_at_everyone_ = false, everyone_next_ = true;
  bool last_quiet_ = false, last_ending_ = false, last_grace_ = false;
  std::set<int64_t> marked_silent_;  // `silent/<id>` written
  std::set<int64_t> dead_;
  int64_t aborted_round_ = 0;
  int64_t events_ = 0;  // the last event written
  std::chrono::steady_clock::time_point below_since_{};
  bool below_ = false;
  bool stopping_ = false;
  bool failed_ = false;  // a poll failed since the last one that went through
  bool resumed_ = false;  // took over a running job; settling (see poll)
  std::chrono::steady_clock::time_point resumed_at_{};
  std::unordered_set<int64_t> beat_since_resume_;
  std::chrono::steady_clock::time_point last_poll_{};
  // When any member's heartbeat last advanced (0: none yet).
  std::chrono::steady_clock::time_point last_any_beat_{};
};

}  // namespace limbo::elastic
