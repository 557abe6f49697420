// A learner's heartbeats, sent from a thread of their own on sockets of their
// own (one DEALER per shard) every `interval` for as long as the object
// lives: a step longer than ps.heartbeat_timeout (a big model, an overloaded
// host) is not taken for a crash. A stopped process sends none and is still
// dropped; a training thread that hangs inside a step is not seen this way
// (the shard's leases and ps.request_timeout on the learner's side bound it).
// Answers are read and dropped. The destructor stops and joins the thread;
// the Transport must outlive the object.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <string>
#include <thread>
#include <vector>

#include "ps/transport.h"

namespace limbo::ps {

class Heartbeats {
 public:
  Heartbeats(Transport& t, std::vector<std::string> endpoints, uint32_t learner, std::chrono::milliseconds interval);
  ~Heartbeats();
  Heartbeats(const Heartbeats&) = delete;
  Heartbeats& operator=(const Heartbeats&) = delete;

 private:
  void run(Transport& t, const std::vector<std::string>& endpoints, uint32_t learner,
           std::chrono::milliseconds interval);
  std::atomic<bool> stop_{false};
  std::thread thread_;
};

}  // namespace limbo::ps
