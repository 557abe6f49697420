// One worker's side of elastic membership.
//
// Registers in the store (an id, `join/<id>`), and runs three threads of
// its own:
// * the heartbeat thread beats every `elastic/heartbeat_interval_ms` (set by
//   the coordinator) into this worker's slot of its host's heartbeat table
//   (elastic/beats.h), which its launcher relays to the coordinator; a
//   worker without a launcher's table (or whose launcher stopped relaying)
//   sends its beats itself. When no beat of it has been acknowledged by the
//   coordinator for MemberOptions::cut_off_after, this member is cut off;
//   once a collective of its group is stuck as long too, the coordinator
//   has dropped it, so it aborts its own group (its training thread stops
//   waiting on peers it cannot rejoin) and waits for a round again. While
//   its peers answer, a silent coordinator costs nothing: its host may be
//   paused (steal time, a live migration, a debugger); should it have
//   dropped this member, the others abort the round and its next
//   collective fails. This thread makes no store call.
// * the publish thread writes the progress and status records to the
//   store, once a heartbeat interval, on a connection of its own.
// * the watch thread waits in the store for the coordinator's next event
//   (`event/<n>`: "round k" or "abort k"). A new round makes newer_round()
//   true and wakes wait_round(); "abort k" aborts this member's group when it
//   belongs to round k or an older one (Collective::abort), so a collective
//   blocked on a silent peer fails at once; and either one stops the
//   formation of a group whose round was replaced, in the store's waits
//   and in Gloo's connection set-up (GroupOptions::cancelled).
//
// Groups are fresh per round (prefix `elastic/round/<k>`; reusing a prefix
// finds stale peer addresses). The caller owns the group; destroying it
// closes its connections, which tells peers still blocked in a collective
// of that round at once.
#pragma once

#include <sys/types.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "comm/collective.h"
#include "comm/kv_store.h"
#include "elastic/beats.h"
#include "elastic/coordinator.h"
#include "elastic/watched_group.h"

namespace limbo::elastic {

struct MemberOptions {
  comm::GroupOptions group;  // store address, secret, timeouts, bind host
  std::chrono::milliseconds heartbeat_interval{100};  // until the coordinator's value is read
  std::chrono::milliseconds round_timeout{120000};
  // Polled while waiting for a round (may be null): once true and the wait
  // has lasted a second (a formation under way normally ends sooner, and
  // the member then leaves after its next step, checkpointed), the wait
  // throws train::Interrupted.
  std::function<bool()> interrupted;
  // Opens another store connection (the heartbeat and watch threads');
  // default: comm::connect_kv_store to the group's store, timing out
  // after the heartbeat timeout.
  std::function<std::shared_ptr<comm::KvStore>()> connect;
  // No beat acknowledged by the coordinator for this long means this member
  // is cut off (0: the heartbeat timeout). Under etcd the coordinator may
  // move (a take-over takes up to about 2 s), so the wait is longer there.
  std::chrono::milliseconds cut_off_after{0};
  // The host's heartbeat table and this worker's slot in it (from
  // LIMBO_BEAT_SLOT, set by the launcher); none: the member sends its own.
  std::shared_ptr<LocalBeats> beats;
  int beat_slot = -1;
  // How long one wait of the watch thread lasts (events end it at once;
  // this bounds how soon a destroyed Member's thread ends, and each wait
  // is a new watch on etcd).
  std::chrono::milliseconds watch_wait{200};
};

// The ring of status records in the store: record n is `elastic/record/<n % kRecordRing>`,
// its value "<n> <json>".
constexpr int64_t kRecordRing = 256;

// How the store names process `pid` of this machine and pid namespace
// (elastic/host_pid/<id>): a launcher finds its dead worker's id by it.
std::string process_key(pid_t pid);

class Member {
 public:
  Member(std::shared_ptr<comm::KvStore> store, MemberOptions opt);
  ~Member();

  int64_t id() const { return id_; }
  // A random tag drawn once per job in the store (the first caller draws
  // it): names of this job's files outside the store (shard homes) carry it.
  std::string job_tag();
  // Blocks until a round newer than `after` lists this member. Store errors
  // are retried (the store may be out of reach for a while). Throws Timeout
  // after round_timeout.
  Round wait_round(int64_t after);
  // True when the coordinator has written a round newer than `current` (no
  // store call: the watch thread keeps it).
  bool newer_round(int64_t current) const { return latest_round_.load() > current; }
  // Asks the coordinator for a round after `current` (best effort: when the
  // store is out of reach, the coordinator sees this member's silence).
  void request_round(int64_t current);
  void leave();
  // Sets `elastic/progress` (fractional epochs), read by the launcher's
  // --elastic-schedule: written by the publish thread within a heartbeat
  // interval, so it never blocks the caller. Best effort.
  void publish_progress(double epoch);
  // Queues one metrics record (JSON) for the job's status pages; the
  // publish thread writes it to `elastic/record/<n mod 256>` within a
  // heartbeat interval (n from `elastic/records`). Never blocks; at most 64 wait, the
  // oldest are dropped beyond that.
  void publish_record(std::string record);
  // Sets `elastic/done`: training completed (every member reaches the same
  // last step). The launcher ends the job then, whatever else happened.
  void publish_done();
  // `elastic/done` is set (false when the store does not answer). The watch
  // thread also looks for it every few quiet waits: then wait_round throws
  // train::CompletedElsewhere and a group's formation is cancelled.
  bool completed();
  // The ending (docs/elastic.md, "How a job ends"). publish_final sets
  // `elastic/final/<storage>`: the final checkpoint and summary of that
  // storage are written. wait_final blocks until that key exists (true), or
  // until every member in `earlier` (the members before this one on the
  // same storage, the writer first) is gone without it: its worker exited
  // (`elastic/dead/<id>`, set by its launcher) or the coordinator found it
  // silent (`elastic/silent/<id>`) (false: this member writes them). A store out
  // of reach for the round timeout also gives false (a second copy of the
  // same final files is harmless; none is not).
  void publish_final(int64_t storage);
  bool wait_final(int64_t storage, const std::vector<int64_t>& earlier);
  // Forms the Gloo group of `round` (blocks until every member joined);
  // PeerFailure when the round is replaced meanwhile.
  std::shared_ptr<comm::Collective> form_group(const Round& round);
  int rank_in(const Round& round) const;
  // No beat of this member was acknowledged for longer than its cut-off time.
  bool cut_off() const { return cut_off_.load(); }

 private:
  void beat_loop();
  void publish_loop(std::shared_ptr<comm::KvStore> s);
  void check_cut_off();
  void watch_loop(std::shared_ptr<comm::KvStore> s, int64_t seen);
  void on_event(const std::string& event);
  void publish_records(comm::KvStore& s);
  // Aborts the current group if it belongs to round `k` or older.
  void abort_group_upto(int64_t k, const std::string& why);
  // Runs `f` on the training thread's connection, retrying store errors a
  // few times; false when it never went through.
  bool best_effort(const std::string& what, const std::function<void()>& f);
  void sleep_while_running(std::chrono::milliseconds d);

  std::shared_ptr<comm::KvStore> store_;
  MemberOptions opt_;
  int64_t id_ = 0;
  std::chrono::milliseconds heartbeat_timeout_{400};
  std::chrono::milliseconds cut_off_after_{400};

  std::atomic<bool> stop_{false};
  // The service threads sleep on this until their next turn or stop_: no
  // wake-ups in between (each one takes a core from a training thread where
  // members share cores).
  std::mutex sleep_mu_;
  std::condition_variable sleep_cv_;
  std::atomic<int64_t> latest_round_{0};
  std::atomic<int64_t> latest_abort_{0};
  std::atomic<bool> cut_off_{false};
  std::atomic<bool> completed_{false};  // `elastic/done` seen (watch thread, completed())
  std::atomic<double> progress_{-1};
  double published_progress_ = -1;  // (publish thread only)
  std::mutex records_mu_;
  std::deque<std::string> records_;
  std::mutex mu_;  // guards group_, group_round_; with cv_, wakes wait_round
  std::condition_variable cv_;
  std::weak_ptr<comm::Collective> group_;  // the last group formed, and its round
  // Its collectives, as they pass (WatchedGroup): whether the peers answer.
  std::shared_ptr<GroupActivity> activity_ = std::make_shared<GroupActivity>();
  bool aborted_cut_off_ = false;  // (heartbeat thread only) the group aborted for this silence
  int64_t group_round_ = 0;
  std::shared_ptr<LocalBeats> beats_;  // this host's table (or one of this member's own)
  int slot_ = -1;
  std::unique_ptr<BeatSender> own_sender_;  // this member's beats, when no launcher relays them
  int64_t started_ns_ = 0;
  std::thread heartbeat_, publish_, watch_;
};

}  // namespace limbo::elastic
