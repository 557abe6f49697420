// Heartbeats of an elastic job, off the rendezvous store.
//
// A worker bumps its slot in a table of its host (LocalBeats: shared memory
// its launcher created, named to the worker in LIMBO_BEAT_SLOT); the
// launcher's BeatSender reads the whole table every heartbeat interval and
// sends it in one UDP datagram to the coordinating launcher's BeatListener,
// whose address the coordinator writes to `elastic/beat_addr`. So the store
// carries no beat at all (a few writes per membership change), and the
// coordinator gets one datagram per host and interval, not one write per
// worker.
//
// Each entry carries how long ago its worker beat (measured on the host's
// own monotonic clock), so the coordinator dates a beat to when the worker
// made it, not to when the launcher happened to relay it: a frozen worker is
// found silent as soon as before.
//
// The listener answers every datagram with an acknowledgement; a sender that
// misses them for a few intervals reads `elastic/beat_addr` again (the
// coordinator moved: an etcd take-over), and a worker whose beats have not
// been acknowledged for its cut-off time knows it is out of its round. A
// worker whose launcher stopped relaying (the launcher is gone, the worker
// is leaving) sends its own beats directly.
//
// With a job secret, datagrams and acknowledgements carry an HMAC-SHA256
// under it; each sender numbers its datagrams and the listener takes only
// increasing numbers per sender, and names itself with a random nonce that
// every datagram repeats, so a recorded datagram cannot be replayed to it
// or to a later coordinator. An acknowledgement names the listener too, and
// a sender counts each number once: a recorded one replayed never keeps a
// relay "acknowledged". A datagram that does not start with this
// listener's nonce, or is longer than a beat datagram can be, is dropped
// from its first bytes, before any MAC is computed, so a flood from a
// sender without it costs little.
//
// A slot of the host's table is read under a sequence lock: a reader never
// takes one worker's id with another's counter (a slot reused across a
// respawn).
#pragma once

#include <netinet/in.h>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <functional>
#include <list>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "comm/kv_store.h"

namespace limbo::elastic {

// CLOCK_MONOTONIC in nanoseconds (the clock of steady_clock here).
int64_t monotonic_ns();

// One host's table of beats: slot i = {worker id, counter, when it last beat}.
class LocalBeats {
 public:
  static constexpr int kSlots = 256;
  struct Entry {
    int64_t id = 0, counter = 0, beat_ns = 0;
  };
  // A new table in /dev/shm, removed when this object goes.
  static std::shared_ptr<LocalBeats> create();
  // A table only this process sees (a worker without a launcher's table, a
  // benchmark's synthetic host).
  static std::shared_ptr<LocalBeats> in_process();
  // Opens the table `name` (from LIMBO_BEAT_SLOT); throws Error when it
  // cannot.
  static std::shared_ptr<LocalBeats> open(const std::string& name);
  ~LocalBeats();
  LocalBeats(const LocalBeats&) = delete;
  LocalBeats& operator=(const LocalBeats&) = delete;

  const std::string& name() const { return name_; }
  // The creating process hands out slots: a free one (-1: none left), and
  // back when its worker exited (its entry is cleared).
  int acquire();
  void release(int slot);

  // A worker's beat: its id, the counter one up, the time now. One writer
  // at a time per slot (its worker; release() once it exited).
  void beat(int slot, int64_t id);
  // Testing aid: the first half of a beat, as a worker killed in the middle
  // of one leaves its slot (the version odd: the slot reads as empty).
  void testing_cut_beat(int slot);
  int64_t counter(int slot) const;
  Entry entry(int slot) const;
  std::vector<Entry> entries() const;  // the slots in use
  // The relay's marks: when it last sent the table, and when the
  // coordinator last acknowledged it (monotonic ns; 0: never).
  void mark_sent(int64_t ns);
  void mark_acked(int64_t ns);
  int64_t sent_ns() const;
  int64_t acked_ns() const;

  // The coordinator's events, relayed by the host's launcher (EventRelay):
  // its one watch of the store's event log stands for every worker's, and
  // a worker learns of a new round or abort from this table, woken at once
  // (a futex word in the shared memory).
  struct Events {
    int64_t round = 0, abort = 0;  // the newest of each in the event log
    bool done = false;             // `elastic/done` was seen
    int64_t read_ns = 0;           // when the relay last heard from the store (0: never)
    int64_t wait_ms = 0;           // the relay's longest wait between two store answers
    uint32_t seq = 0;              // bumped at every change
  };
  // The relay's side: raises round and abort to these (never lowers them),
  // notes that it heard from the store at `now_ns`, and wakes the waiters
  // when anything changed.
  void relay_events(int64_t round, int64_t abort, bool done, int64_t now_ns, int64_t wait_ms);
  Events events() const;
  // A worker's side: until the events change from `seq`, or `timeout`.
  void wait_events(uint32_t seq, std::chrono::milliseconds timeout) const;
  // The relay heard from the store within twice its wait (and half a
  // second): its view is current. Otherwise a worker watches the store
  // itself.
  bool events_current(int64_t now_ns) const;

 private:
  struct Shared;
  LocalBeats() = default;
  Shared* s_ = nullptr;
  size_t bytes_ = 0;
  std::string name_;
  bool owner_ = false, mapped_ = false;
  std::vector<bool> used_;
};

// One datagram of the beat protocol (the listener's nonce, the sender's
// nonce and number, each entry's id, counter and age at `now_ns`, sealed
// with `token`): what a BeatSender sends, at most 200 entries a datagram.
std::string beat_datagram(const std::string& token, const std::string& coord_nonce, const std::string& sender_nonce,
                          int64_t seq, const LocalBeats::Entry* entries, size_t count, int64_t now_ns);
inline constexpr int kBeatsPerDatagram = 200;

// The listener's view: each worker's highest counter and when that beat was
// made (on this process's steady clock).
//
// The coordinator polls every 20 ms; what a poll reads is what changed
// since the last (take_changes), so its cost grows with the beats that
// arrived, not with the members there are, and nothing is copied whole.
// A worker not heard from for forget_after is forgotten (oldest first, O(1)
// a beat): a later beat of it counts as new, and the coordinator keeps
// only counters higher than its own (a replayed old one changes nothing).
class BeatTable {
 public:
  using Time = std::chrono::steady_clock::time_point;
  struct Seen {
    int64_t counter = 0;
    Time at{};
  };
  explicit BeatTable(std::chrono::steady_clock::duration forget_after = std::chrono::minutes(10))
      : forget_after_(forget_after) {}
  // Keeps the beat if its counter is higher than the one held.
  void note(int64_t id, int64_t counter, Time at);
  struct Beat {
    int64_t id = 0, counter = 0;
    Time at{};
  };
  // note() for each, under one lock (a datagram's beats).
  void note_all(const std::vector<Beat>& beats);
  // The workers whose beat advanced since the last call, each once with
  // its latest beat (the coordinator's poll).
  std::vector<std::pair<int64_t, Seen>> take_changes();
  // Every worker held, copied (tests, tools; a poll uses take_changes).
  std::map<int64_t, Seen> read() const;
  size_t size() const;
  // When a beat last advanced a counter; Time{} before any.
  Time last_arrival() const;

 private:
  struct Held {
    Seen seen;
    Time arrived{};  // when it last advanced (on this process's clock)
    bool changed = false;
    std::list<int64_t>::iterator pos;  // in order_
  };
  void note_locked(int64_t id, int64_t counter, Time at, Time now);
  mutable std::mutex mu_;
  std::chrono::steady_clock::duration forget_after_;
  std::unordered_map<int64_t, Held> seen_;
  std::list<int64_t> order_;  // by last advance, the oldest first
  std::vector<int64_t> changed_;
  Time last_{};
};

// The coordinator's end: UDP sockets on `bind_host` (one port, any), each
// with a thread that takes datagrams into table().
//
// Beyond some 30,000 members one core cannot take every host's datagram
// (an HMAC each, and its acknowledgement): the listener has `lanes`
// sockets on the same port (SO_REUSEPORT), each read by a thread of its
// own; the kernel spreads datagrams over them by sender (address and
// port), so each lane keeps the replay numbers of its own senders and
// shares nothing with the others but the table. A lane takes what is
// queued a batch at a time (recvmmsg) and answers a batch at a time
// (sendmmsg): two system calls for up to 32 datagrams, not three each.
class BeatListener {
 public:
  // `advertise_host`: the address senders reach this machine by.
  // `lanes`: sockets and threads (0: one per core, at most 4).
  BeatListener(const std::string& bind_host, const std::string& advertise_host, std::string token,
               int lanes = 0);
  ~BeatListener();
  BeatListener(const BeatListener&) = delete;
  BeatListener& operator=(const BeatListener&) = delete;
  // The value of `elastic/beat_addr`: "HOST:PORT NONCE".
  const std::string& address() const { return address_; }
  std::shared_ptr<BeatTable> table() const { return table_; }
  // Datagrams refused (bad MAC, another coordinator's nonce, a replayed or
  // malformed one) since the start.
  int64_t refused() const { return refused_.load(); }
  // Senders whose last datagram number is held (for the replay check), in
  // all lanes.
  size_t senders() const;
  int lanes() const { return static_cast<int>(lanes_.size()); }
  // The senders each lane holds.
  std::vector<size_t> senders_by_lane() const;
  // Testing aid: forget senders silent for `after` once more than `cap`
  // are held in a lane (default: a minute, 4096).
  void testing_forget_senders(std::chrono::steady_clock::duration after, size_t cap) {
    forget_after_ = after;
    forget_cap_ = cap;
  }

 private:
  struct Lane;
  void loop(Lane& lane);
  // The acknowledgement to send back, or "" (refused).
  std::string take(Lane& lane, const char* data, size_t len);
  std::string token_, nonce_, address_;
  std::shared_ptr<BeatTable> table_ = std::make_shared<BeatTable>();
  std::vector<std::unique_ptr<Lane>> lanes_;
  std::atomic<std::chrono::steady_clock::duration> forget_after_{std::chrono::minutes(1)};
  std::atomic<size_t> forget_cap_{4096};
  std::atomic<int64_t> refused_{0};
  std::atomic<bool> stop_{false};
};

struct BeatSenderOptions {
  std::chrono::milliseconds interval{100};
  std::string token;
  // A store connection, for reading `elastic/beat_addr` (made when first
  // needed; again after a failure).
  std::function<std::shared_ptr<comm::KvStore>()> connect;
};

// Sends `table`'s entries (those `only_slot` names, or all when -1) every
// interval on a thread of its own, and marks the table's acknowledgement
// time when the listener answers. The listener's address is read from the
// store on a second thread, so that a store that answers slowly never holds
// up a send.
class BeatSender {
 public:
  BeatSender(std::shared_ptr<LocalBeats> table, BeatSenderOptions opt, int only_slot = -1);
  ~BeatSender();
  BeatSender(const BeatSender&) = delete;
  BeatSender& operator=(const BeatSender&) = delete;
  // When a datagram of this sender was last acknowledged (monotonic ns; 0:
  // never).
  int64_t acked_ns() const { return acked_ns_.load(); }

 private:
  void loop();
  void resolve_loop();
  void resolve();
  bool take_resolved();
  void send(const std::vector<LocalBeats::Entry>& entries, int64_t now);
  void receive_acks(std::chrono::milliseconds wait);
  std::shared_ptr<LocalBeats> table_;
  BeatSenderOptions opt_;
  int only_slot_;
  int fd_ = -1;
  std::shared_ptr<comm::KvStore> store_;         // (resolve thread only)
  std::string addr_text_, coord_nonce_, nonce_;  // (send thread only)
  int64_t seq_ = 0, asked_ns_ = 0, acked_seq_ = 0;
  // The resolve thread's answer: a new address, taken by the send thread.
  std::mutex mu_;
  std::condition_variable cv_;
  bool want_ = false, have_new_ = false;
  std::string new_text_, new_nonce_, resolved_text_;
  sockaddr_in new_addr_{};
  std::atomic<int64_t> acked_ns_{0};
  std::atomic<bool> stop_{false};
  std::thread thread_, resolver_;
};

}  // namespace limbo::elastic
