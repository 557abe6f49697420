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
#include <functional>
#include <mutex>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace limbo::comm {

// What changed in a store since a revision (KvStore::changes_since).
struct KvChanges {
  int64_t revision = 0;  // to pass to the next call
  // `written` is everything under the prefixes (what was known before is
  // to be forgotten): the first call, or a store that cannot tell changes.
  bool full = true;
  std::vector<std::pair<std::string, std::string>> written;  // keys written since, with their values
  std::vector<std::string> erased;                           // keys erased since
};

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
  // The keys under any of `prefixes` written or erased since `since` (a
  // revision an earlier call returned; 0 = everything), so a reader that
  // polls pays for what changed, not for every key. The default lists the
  // prefixes whole (full = true).
  virtual KvChanges changes_since(const std::vector<std::string>& prefixes, int64_t since);
  // Hands every key under `prefix` written from (about) now on to
  // `on_write`, in the order the store took them, over one stream the store
  // holds open, until `stop()` holds (looked at least every `idle`). A
  // write just before the call may come too. Returns false at once when
  // the store has no such stream (the caller waits with wait_for), or when
  // the stream broke and cannot go on without a gap (the caller reads the
  // state again and follows anew). Over etcd: a watch stream, where each
  // wait_for would be a new watch on a new connection.
  virtual bool follow(const std::string& prefix, std::chrono::milliseconds idle, const std::function<bool()>& stop,
                      const std::function<void(const std::string& key, const std::string& value)>& on_write) {
    return false;
  }
  // Ends a follow() in progress on another thread at once (its stop() is
  // looked at next), where it would wait out its idle period.
  virtual void interrupt_follow() {}
  // Where the store is, for messages ("HOST:PORT", "etcd://...").
  virtual std::string describe() const { return "the rendezvous store"; }
  // Another handle on this store's connection whose calls time out after
  // `timeout`: the embedded store's connection carries many threads' calls
  // at once, waits included (comm/store.h). Null where the store cannot
  // share one (the caller connects anew).
  virtual std::shared_ptr<KvStore> share(std::chrono::milliseconds timeout) { return nullptr; }
};

// Which key was written or erased last at which revision: the index behind
// changes_since() in the embedded store and MemoryKvStore. One entry per
// key ever written (an erased key stays as a tombstone).
class Revisions {
 public:
  void bump(const std::string& key);
  int64_t revision() const { return revision_; }
  // The changes since `since` under any of `prefixes`, `exists(key)` telling
  // written from erased keys and `value(key)` the value of a written one.
  template <typename Exists, typename Value>
  KvChanges since(const std::vector<std::string>& prefixes, int64_t since, Exists exists, Value value) const {
    KvChanges c;
    c.revision = revision_;
    c.full = since <= 0 || since > revision_;
    for (auto it = by_revision_.upper_bound(c.full ? 0 : since); it != by_revision_.end(); ++it) {
      const std::string& k = it->second;
      bool under = false;
      for (const auto& p : prefixes) under = under || k.compare(0, p.size(), p) == 0;
      if (!under) continue;
      if (exists(k)) c.written.emplace_back(k, value(k));
      else if (!c.full) c.erased.push_back(k);
    }
    return c;
  }

 private:
  int64_t revision_ = 0;
  std::map<std::string, int64_t> of_key_;
  std::map<int64_t, std::string> by_revision_;
};

// Connects a client to the rendezvous store at host:port (with the job
// secret `token`, if the store has one; comm/auth.h).
std::unique_ptr<KvStore> connect_kv_store(const std::string& host, int port,
                                          std::chrono::milliseconds timeout,
                                          const std::string& token = "");
class StoreClient;
// A KvStore on `client`'s connection (shared, comm/store.h), its calls
// timing out after `timeout`.
std::unique_ptr<KvStore> kv_store_on(const StoreClient& client, std::chrono::milliseconds timeout);

class MemoryKvStore : public KvStore {
 public:
  void set(const std::string& key, const std::string& value) override;
  std::optional<std::string> try_get(const std::string& key) override;
  int64_t add(const std::string& key, int64_t delta) override;
  bool wait_for(const std::string& key, std::chrono::milliseconds timeout) override;
  std::vector<std::pair<std::string, std::string>> list(const std::string& prefix) override;
  std::string compare_set(const std::string& key, const std::string& expected, const std::string& desired) override;
  bool erase(const std::string& key) override;
  KvChanges changes_since(const std::vector<std::string>& prefixes, int64_t since) override;

 private:
  void bump(const std::string& key);  // under mu_
  std::mutex mu_;
  std::condition_variable cv_;
  std::map<std::string, std::string> kv_;
  Revisions revisions_;
};

}  // namespace limbo::comm
