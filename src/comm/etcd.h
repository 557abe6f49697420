// etcd as the job's rendezvous: a client of etcd's v3 API through its JSON
// gateway (POST /v3/kv/range, /v3/kv/put, /v3/kv/txn, /v3/lease/*,
// /v3/watch), over cpp-httplib, with TLS (client certificates) and
// user/password authentication; and EtcdKvStore, the rendezvous interface
// (comm/kv_store.h) over it.
//
// One client talks to one endpoint at a time and moves on to the next when
// that one fails (refused, silent past the call's share of the timeout, or
// answering "unavailable": no leader, leader changed), so a killed or
// stopped etcd member costs a retry, not the call. Reads are linearizable
// (served through the leader), so a lagging member never shows old state.
//
// Every key of a job lives under "limbo/<job>/", so several jobs share one
// etcd cluster.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <map>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "comm/kv_store.h"
#include "common/error.h"

namespace limbo::comm {

struct EtcdOptions {
  std::vector<std::string> endpoints;  // HOST:PORT of each cluster member
  std::string job;                     // the job's name: its keys live under limbo/<job>/
  bool tls = false;                    // https (etcds://)
  std::string ca_file, cert_file, key_file;  // TLS: the CA to trust, this client's certificate and key
  std::string user, password;                // etcd's user/password authentication (empty: none)
  std::string prefix() const { return "limbo/" + job + "/"; }
  std::string url() const;  // etcd[s]://HOST:PORT,.../JOB
};

// True for "etcd://..." and "etcds://...".
bool is_etcd_url(const std::string& s);
// Parses "etcd://HOST:PORT[,HOST:PORT...]/JOB" ("etcds://" for TLS).
// Throws InvalidInput naming `flag` on anything else.
EtcdOptions parse_etcd_url(const std::string& url, const std::string& flag);
// The credentials and TLS files travel to workers in their environment
// (LIMBO_ETCD_USER, LIMBO_ETCD_PASSWORD, LIMBO_ETCD_CACERT, LIMBO_ETCD_CERT,
// LIMBO_ETCD_KEY), not on their command line, which `ps` shows.
void etcd_from_env(EtcdOptions* o);
void etcd_to_env(const EtcdOptions& o);

// A write of a fenced store (connect_etcd(..., fence)) found the fence key no
// longer holding its value: another launcher is coordinator now.
class FencedOut : public Error {
 public:
  using Error::Error;
};

class EtcdClient {
 public:
  struct KeyValue {
    std::string key, value;
    int64_t create_revision = 0, mod_revision = 0, lease = 0;
  };
  // One condition of a transaction.
  struct Compare {
    enum Target { Value, ModRevision, CreateRevision } target = Value;
    std::string key;
    std::string value;     // Value
    int64_t revision = 0;  // ModRevision / CreateRevision (0 = the key does not exist)
    bool not_equal = false;  // holds when the target differs instead
  };

  // Every call gives up after `timeout` (Timeout; PeerFailure when no
  // endpoint could be reached at all). Wrong credentials, a refused TLS
  // handshake or a missing permission are InvalidInput.
  EtcdClient(EtcdOptions opt, std::chrono::milliseconds timeout);
  ~EtcdClient();
  EtcdClient(const EtcdClient&) = delete;
  EtcdClient& operator=(const EtcdClient&) = delete;

  // `revision` (when given) receives the cluster's revision of the answer.
  void put(const std::string& key, const std::string& value, int64_t lease = 0, int64_t* revision = nullptr);
  std::optional<KeyValue> get(const std::string& key, int64_t* revision = nullptr);
  std::vector<KeyValue> list(const std::string& prefix, int64_t* revision = nullptr);
  // How many keys start with `prefix` and were created at or before
  // revision `max_create_revision` (0: any); the names come back, no values.
  int64_t count(const std::string& prefix, int64_t max_create_revision = 0);
  // The keys deleted. A single key is deleted in a transaction, so that a
  // retry after a lost answer still reports the deletion (below).
  int64_t erase(const std::string& key, bool whole_prefix = false);
  // Writes `puts` (with `lease`) when every condition holds; true when it did.
  // Exactly once, and told truly: when an answer was lost and the request
  // was sent again (to the next endpoint), the retry's conditions no longer
  // hold if the first attempt committed. Each transaction therefore also
  // writes one of this client's marker keys (`<job prefix>_txn/<client>/<slot>`)
  // with its own sequence number, and a refused retry reads it back: the
  // marker holding this transaction's number means the first attempt
  // committed.
  bool txn(const std::vector<Compare>& when, const std::vector<std::pair<std::string, std::string>>& puts,
           int64_t lease = 0, int64_t* revision = nullptr);
  int64_t grant_lease(int ttl_seconds);
  // Renews the lease; false when it no longer exists (expired or revoked).
  bool keep_alive(int64_t lease);
  void revoke_lease(int64_t lease);
  // Waits until `key` is written or deleted at a revision after `after`:
  // true; false when `timeout` passes first.
  bool watch(const std::string& key, int64_t after, std::chrono::milliseconds timeout);

  // A long-lived watch of every key under `prefix`, from revision `from`,
  // on a connection of its own (etcd's JSON gateway streams its answers):
  // `on_events` gets each answer's events in order, until `stop()` holds
  // (looked at whenever the connection is idle for `idle`; it is then
  // opened again from the revision after the last event delivered, so
  // nothing is lost or repeated). Returns false when etcd can no longer
  // serve the history from there (compacted, or the watch cancelled): the
  // caller lists the keys again.
  struct Event {
    std::string key, value;
    bool deleted = false;
    int64_t mod_revision = 0;
  };
  bool watch_stream(const std::string& prefix, int64_t from, std::chrono::milliseconds idle,
                    const std::function<bool()>& stop, const std::function<void(std::vector<Event>&&)>& on_events);

  // Ends every watch_stream of this client in progress at once (their
  // stop() is looked at next, and they open again if it does not hold).
  void interrupt_streams();

  std::chrono::milliseconds timeout() const { return timeout_; }
  std::string describe() const { return opt_.url(); }

 private:
  struct Conn;
  // `resent` (when given): true when an attempt that may have reached etcd
  // went unanswered and the answer returned is a later attempt's.
  std::string call(const std::string& path, const std::string& body, bool* resent = nullptr);
  std::string call_locked(const std::string& path, const std::string& body, bool authenticating,
                          bool* resent = nullptr);
  bool txn_ops(nlohmann::json compare, nlohmann::json success, int64_t* revision);
  void authenticate_locked();
  // Where a watch goes and the token it carries (authenticating first).
  std::pair<std::string, std::string> watch_target();

  EtcdOptions opt_;
  std::chrono::milliseconds timeout_;
  std::mutex mu_;
  size_t current_ = 0;  // the endpoint in use
  std::vector<std::unique_ptr<Conn>> conns_;
  std::string auth_token_;
  std::string txn_marker_;  // this client's marker key (txn)
  std::atomic<uint64_t> txn_seq_{0};
  // Streams in progress (watch_stream calls: their httplib client, and a
  // duplicate of their socket once made, -1 before), and interrupts so far.
  // An interrupt shuts down every socket it finds, and one made after it
  // (a stream is registered before its socket exists), so none is lost
  // between a stream's check of stop() and its socket. (Its own mutex: mu_
  // is held through whole calls.)
  std::mutex streams_mu_;
  std::map<void*, int> streams_;
  uint64_t interrupts_ = 0;
};

// The rendezvous interface over etcd, every key under the job's prefix.
// With a fence (key, value), every write is a transaction that holds only
// while the fence key holds that value, and throws FencedOut otherwise.
std::unique_ptr<KvStore> connect_etcd(const EtcdOptions& o, std::chrono::milliseconds timeout,
                                      std::optional<std::pair<std::string, std::string>> fence = std::nullopt);

}  // namespace limbo::comm
