// The launcher's relay of the coordinator's events to its workers.
//
// Every worker of an elastic job must learn of a new round or an abort at
// once (members/elastic.md). Watching the store's event log from each
// worker costs the store one parked wait per worker, renewed every
// watch_wait: at 10,000 members, 50,000 calls a second on the embedded
// store and 10,000 new watches a second on etcd. The launcher of a host
// watches it once instead, and writes the newest round, abort and
// `elastic/done` into its host's heartbeat table (LocalBeats::relay_events),
// where its workers wait on a futex word: woken the moment the relay writes,
// with no store call of their own. The relay marks each store answer in the
// table; a worker that finds it not current (the launcher gone, its store
// connection failing) watches the store itself until it is again.
#pragma once

#include <atomic>
#include <condition_variable>
#include <chrono>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>

#include "comm/kv_store.h"
#include "elastic/beats.h"

namespace limbo::elastic {

class EventRelay {
 public:
  // `connect`: a store connection (made on the relay's thread, and on its
  // checker's; again after a failure). `wait`: the longest parked wait for
  // the next event (an event ends it at once). After each quiet wait the
  // relay reads `elastic/done`, the round and the abort keys: the table is
  // current as of that read. Following a stream (etcd), the checker reads
  // the log's count every wait instead and reopens a stream that fell
  // behind it.
  EventRelay(std::shared_ptr<LocalBeats> table, std::function<std::shared_ptr<comm::KvStore>()> connect,
             std::chrono::milliseconds wait);
  // Ends the relay's thread: at once while it follows a stream, else when
  // its store call in progress returns.
  ~EventRelay();
  EventRelay(const EventRelay&) = delete;
  EventRelay& operator=(const EventRelay&) = delete;
  // Asks the thread to end, without waiting (a launcher cut off from its
  // job: its call in progress returns meanwhile, not in the destructor).
  void request_stop();

 private:
  void loop();
  bool follow(comm::KvStore& s);
  void check_loop();
  void verify(comm::KvStore& c, int64_t* behind_at);
  std::shared_ptr<LocalBeats> table_;
  std::function<std::shared_ptr<comm::KvStore>()> connect_;
  std::chrono::milliseconds wait_;
  std::atomic<bool> stop_{false};
  std::mutex mu_;
  std::shared_ptr<comm::KvStore> current_;  // the thread's connection (interrupted on stop)
  std::atomic<int64_t> streamed_{-1};  // the newest event a stream delivered (-1: none followed)
  std::mutex check_mu_;
  std::condition_variable check_cv_;
  std::thread thread_, checker_;
};

// "round 7" / "abort 7" -> (kind, 7); kind "" when malformed.
std::pair<std::string, int64_t> parse_event(const std::string& event);

}  // namespace limbo::elastic
