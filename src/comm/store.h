// The job's rendezvous store: a key-value server the launcher hosts, and a
// client for workers, the coordinator and Gloo's rendezvous.
//
// Why not c10d's TCPStore: its server reads each request with blocking
// receives, so a client stopped (SIGSTOP, a frozen host) in the middle of
// sending a request blocks the server for every other client, and with it
// the whole job. This server is one thread with non-blocking sockets and a
// buffer per connection: a half-sent request waits in its buffer and holds
// no one up; a client that does not read its answers only fills its own
// output buffer (bounded: the connection is closed beyond 64 MiB).
//
// Wire format (both directions): u32 length (little-endian) of the rest,
// then one op byte (requests) or status byte (answers), then the fields,
// each a u32 length and its bytes; after the handshake the first field of a
// request is its id (4 bytes), which its answer's first field repeats.
// Many requests may be in flight on one connection: `get` with waiting and
// `wait` are parked on the server until their keys exist (`wait_for` also
// until its own deadline; `cancel` withdraws one) while the requests behind
// them are answered. Requests and values are at most 64 MiB.
//
// Every connection starts with the server's hello; with a job secret the
// client must pass the HMAC challenge of comm/auth.h before any request is
// read, and a connection that fails it (or sends anything else first, or
// nothing within a second) is logged and closed.
//
// The server's thread cannot be stalled by one client: pipelined requests
// are parsed in linear time and served without recursion, parked requests
// are woken through an index of the keys they wait for, a turn of its loop
// (epoll) costs what is ready, not the number of connections, connections beyond
// StoreServerOptions::max_connections are closed at once, and when the
// process runs out of descriptors accepting pauses instead of spinning.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "comm/kv_store.h"

namespace limbo::comm {

struct StoreServerOptions {
  std::string token;              // the job secret; empty = no handshake check
  // More are closed as soon as they arrive; 0 = connections_allowed().
  size_t max_connections = 0;
  std::chrono::milliseconds handshake_timeout{1000};
};

// The connections a store in this process can hold: the descriptor limit
// (RLIMIT_NOFILE, whose soft value this raises to the hard one) less room
// for the process's other descriptors.
size_t connections_allowed();

class StoreServer {
 public:
  // Binds host:port (0 = a free port) and serves on its own thread until
  // destroyed. Throws InvalidInput when the address cannot be bound.
  StoreServer(const std::string& host, int port, StoreServerOptions opt = {});
  ~StoreServer();
  StoreServer(const StoreServer&) = delete;
  StoreServer& operator=(const StoreServer&) = delete;
  int port() const;
  size_t max_connections() const;
  // Connections open now (handshakes included).
  size_t connections() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// A client of a StoreServer over one connection that many threads share:
// each request carries an id and its answer comes back with it, so a call
// never waits behind another thread's (a parked get or wait included).
// Each call blocks for at most its timeout, whatever other threads do on
// the connection (a send, a reconnect): Timeout when the server does not
// answer in time, PeerFailure when it cannot be reached or the connection
// breaks (every call then in flight on it fails alike, and the next call
// connects again). A call that times out costs only itself: a wait is
// withdrawn from the server, any answer that comes late is dropped by its
// id. A request sent in part at its deadline ends the connection (the
// stream can no longer be read in step), and so does a call that times out
// on a connection silent for 2 s since before it was sent (a host cut off:
// the next calls fail at once on connecting, not each after its timeout). A request over the store's 64 MiB
// limit, and a wrong or missing job secret, are InvalidInput (not retried).
class StoreClient {
 public:
  // Connects, retrying until `timeout` (the server may still be starting).
  StoreClient(const std::string& host, int port, std::chrono::milliseconds timeout,
              std::string token = "");
  // Another client on `other`'s connection, its calls with `timeout`.
  StoreClient(const StoreClient& other, std::chrono::milliseconds timeout);
  ~StoreClient();
  StoreClient(const StoreClient&) = delete;
  StoreClient& operator=(const StoreClient&) = delete;

  void set(const std::string& key, const std::string& value);
  // The value, or nullopt when the key does not exist (never waits for it).
  std::optional<std::string> try_get(const std::string& key);
  // Waits until the key exists (at most `timeout`, else Timeout).
  std::string get(const std::string& key, std::chrono::milliseconds timeout);
  // Adds `delta` to an integer key (created at 0); returns the new value.
  int64_t add(const std::string& key, int64_t delta);
  // c10d's compare-and-set: when the key holds `expected` (or is missing and
  // `expected` is empty) it becomes `desired`; returns the value it holds
  // afterwards (for a missing key with a non-empty `expected`: `expected`).
  std::string compare_set(const std::string& key, const std::string& expected,
                          const std::string& desired);
  bool erase(const std::string& key);
  // Every key starting with `prefix` and its value, in key order.
  std::vector<std::pair<std::string, std::string>> list(const std::string& prefix);
  // KvStore::changes_since, answered from the server's revision index.
  KvChanges changes_since(const std::vector<std::string>& prefixes, int64_t since);
  bool check(const std::vector<std::string>& keys);
  int64_t num_keys();
  // Waits until every key exists (at most `timeout`, else Timeout).
  void wait(const std::vector<std::string>& keys, std::chrono::milliseconds timeout);
  // Waits on the server until every key exists (true) or `timeout` passes
  // (false). The connection stays up either way.
  bool wait_for(const std::vector<std::string>& keys, std::chrono::milliseconds timeout);
  // Blocking get / wait / wait_for of this client check `cancelled` every
  // few milliseconds and throw PeerFailure when it returns true (e.g. the
  // group being formed was replaced by a newer round). Set before the waits
  // start.
  void set_cancel(std::function<bool()> cancelled) { cancel_ = std::move(cancelled); }
  std::chrono::milliseconds timeout() const { return timeout_; }
  const std::string& address() const;
  // Connections made so far by this client's connection object (1 until it
  // broke and was made again), for tests.
  int64_t connects() const;

 private:
  struct Connection;
  // Sends one request (op code, store_wire.h) and returns the answer's status
  // byte and field.
  std::pair<uint8_t, std::string> call(uint8_t op, const std::vector<std::string>& fields,
                                       std::chrono::milliseconds timeout);

  std::shared_ptr<Connection> conn_;
  std::chrono::milliseconds timeout_;
  std::function<bool()> cancel_;
};

}  // namespace limbo::comm
