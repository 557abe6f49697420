// Chooses the one launcher that coordinates a job whose rendezvous is etcd.
//
// The coordinator holds the key `elastic/coordinator` = "<term> <launcher>",
// attached to its etcd lease, and bumps `elastic/coordinator_beat` every
// heartbeat interval. Every other launcher reads both each interval (one
// range call); when the beat has not moved for the heartbeat timeout while
// its own reads went through, or the key is gone (its lease expired), it
// campaigns: a transaction that writes the key with the next term only if
// the key is still what it saw (its mod revision, or absent). Exactly one
// campaign wins.
//
// The coordinator's writes are fenced on the key's value (comm/etcd.h):
// a launcher that was only slow, not lost, finds its writes refused
// (FencedOut) once another has taken over, and steps down. Detection is the
// heartbeat timeout (0.4 s by default), not the lease's TTL (etcd's
// minimum is about 2 s), which is only the fallback.
//
// The election runs on a thread of its own with its own etcd connection, so
// that a slow call of the launcher's loop (a coordinator poll) cannot
// delay the beat and cost a needless takeover.
#pragma once

#include <atomic>
#include <chrono>
#include <mutex>
#include <thread>
#include <memory>
#include <string>

#include "comm/etcd.h"

namespace limbo::elastic {

class Election {
 public:
  // `me` names this launcher in the key ("launcher 3 on host-a").
  Election(const comm::EtcdOptions& o, std::string me, std::chrono::milliseconds heartbeat_timeout);
  // Resigns (revokes the lease, deleting the key) when it leads.
  ~Election();
  Election(const Election&) = delete;
  Election& operator=(const Election&) = delete;

  // True while this launcher coordinates.
  bool leading() const { return leading_.load(); }
  // The key and the value this launcher holds in it: the fence of its writes.
  static constexpr const char* kKey = "elastic/coordinator";
  std::string fence_value() const;
  // A fenced write was refused: another launcher coordinates now.
  void step_down(const std::string& why);
  // Gives up coordinating (the job is over): the lease is revoked.
  void resign();

 private:
  void loop();
  void step_down_locked(const std::string& why);
  void tick();
  void lead_tick();
  void follow_tick();
  bool campaign(int64_t expected_mod_revision, int64_t term, const std::string& from);
  int64_t reserve_term(int64_t at_least);
  void ensure_lease();

  using Clock = std::chrono::steady_clock;
  comm::EtcdClient c_;
  std::string prefix_, me_;
  std::chrono::milliseconds timeout_, interval_;
  std::atomic<bool> leading_{false};
  std::atomic<bool> stop_{false};
  mutable std::mutex mu_;  // guards value_, and the client against resign() from another thread
  std::string value_;
  int64_t lease_ = 0;
  int lease_ttl_s_ = 3;
  int64_t beats_ = 0;
  Clock::time_point next_{}, last_keepalive_{}, last_beat_ok_{};
  // Following: the coordinator's key and beat as last seen, and when the
  // beat last moved (on this launcher's clock).
  std::string seen_value_, seen_beat_;
  Clock::time_point seen_change_{};
  bool read_failed_ = true;
  std::thread thread_;
};

}  // namespace limbo::elastic
