// Collectives handed over by the training thread and run one after another
// on a thread of their own, in the order they were handed over (fully
// sharded training, optim.shard_weights: the next unit's gather and a
// finished bucket's reduce-scatter run while the training thread computes).
// Every member hands its collectives over in the one order of its forward
// and backward, so the groups' collectives match.
//
// A job that throws fails the queue: the jobs after it are skipped (they
// would wait on a group that is gone) until reset(), and error() returns the
// failure. The thread runs no torch operation of its own; the jobs are
// plain copies and the group's collectives.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <exception>
#include <functional>
#include <mutex>
#include <thread>

namespace limbo::elastic {

class SerialQueue {
 public:
  SerialQueue() = default;
  ~SerialQueue();
  SerialQueue(const SerialQueue&) = delete;
  SerialQueue& operator=(const SerialQueue&) = delete;

  // Hands `job` over; returns its ticket (0, 1, ... since construction).
  int64_t push(std::function<void()> job);
  // Until the job of `ticket` and every one before it ran (or was skipped).
  void wait(int64_t ticket);
  // Until every job handed over ran.
  void drain();
  // The first failure since reset(), or none.
  std::exception_ptr error();
  // Forgets a failure: the next jobs run again (a new step, a new group).
  // Waits for the jobs handed over first.
  void reset();

 private:
  void loop();
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> jobs_;
  int64_t pushed_ = 0, finished_ = 0;
  std::exception_ptr error_;
  bool stop_ = false;
  std::thread thread_;
};

}  // namespace limbo::elastic
