// A small key-value store interface over the job's rendezvous store, for
// membership bookkeeping (heartbeats, rounds). TcpKvStore wraps a
// StoreClient (comm/store.h); MemoryKvStore is an in-process fake for tests. All calls
// are thread-safe and block for at most the store's timeout (Timeout) or
// throw PeerFailure when the store is unreachable.
#pragma once

#include <chrono>
#include <condition_variable>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>

namespace limbo::comm {

class KvStore {
 public:
  virtual ~KvStore() = default;
  virtual void set(const std::string& key, const std::string& value) = 0;
  // The value, or nullopt when the key does not exist (never blocks).
  virtual std::optional<std::string> try_get(const std::string& key) = 0;
  // Atomically adds `delta` to an integer key (created at 0); returns the sum.
  virtual int64_t add(const std::string& key, int64_t delta) = 0;
  // Blocks until `key` exists (true) or `timeout` passes (false).
  virtual bool wait_for(const std::string& key, std::chrono::milliseconds timeout) = 0;
};

// Connects a client to the rendezvous store at host:port (with the job
// secret `token`, if the store has one; comm/auth.h).
std::unique_ptr<KvStore> connect_kv_store(const std::string& host, int port,
                                          std::chrono::milliseconds timeout,
                                          const std::string& token = "");

class MemoryKvStore : public KvStore {
 public:
  void set(const std::string& key, const std::string& value) override;
  std::optional<std::string> try_get(const std::string& key) override;
  int64_t add(const std::string& key, int64_t delta) override;
  bool wait_for(const std::string& key, std::chrono::milliseconds timeout) override;

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  std::map<std::string, std::string> kv_;
};

}  // namespace limbo::comm
