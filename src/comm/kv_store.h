// The rendezvous interface: a small key-value store over the job's
// rendezvous, for membership (heartbeats, rounds, the event log, done and
// abort) and for Gloo's address exchange. Two implementations: the embedded
// store (comm/store.h, through connect_kv_store) and etcd (comm/etcd.h,
// through connect_etcd); MemoryKvStore is an in-process fake for tests. The
// coordinator's rule (elastic/coordinator.h) is written once, above it.
// All calls are thread-safe and block for at most the store's timeout
// (Timeout) or throw PeerFailure when the store is unreachable.
#pragma once

#include <chrono>
#include <condition_variable>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <utility>
#include <vector>

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
  // Every key starting with `prefix` and its value, in key order (one call).
  virtual std::vector<std::pair<std::string, std::string>> list(const std::string& prefix) = 0;
  // When `key` holds `expected` (or is missing and `expected` is empty) it
  // becomes `desired`. Returns the value it holds afterwards (c10d's rule).
  virtual std::string compare_set(const std::string& key, const std::string& expected,
                                  const std::string& desired) = 0;
  // A number for this call alone among all calls of ticket(key): 1, 2, 3,
  // ... in the order the store took them (no gaps, no repeats), for ids
  // that many clients draw at once. Default: add(key, 1). Over etcd, which
  // has no increment, a compare-and-swap counter makes every contender but
  // one retry: EtcdKvStore draws without retries instead.
  virtual int64_t ticket(const std::string& key) { return add(key, 1); }
  // Deletes `key`; false when it did not exist.
  virtual bool erase(const std::string& key) = 0;
  // Where the store is, for messages ("HOST:PORT", "etcd://...").
  virtual std::string describe() const { return "the rendezvous store"; }
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
  std::vector<std::pair<std::string, std::string>> list(const std::string& prefix) override;
  std::string compare_set(const std::string& key, const std::string& expected, const std::string& desired) override;
  bool erase(const std::string& key) override;

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  std::map<std::string, std::string> kv_;
};

}  // namespace limbo::comm
