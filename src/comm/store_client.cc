#include "comm/store.h"


#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <condition_variable>
#include <cerrno>
#include <cstring>
#include <algorithm>
#include <map>
#include <set>
#include <thread>

#include "comm/auth.h"
#include "common/error.h"
#include "common/log.h"
#include "common/throttled_log.h"

#include "comm/store_wire.h"

namespace limbo::comm {

using namespace store_wire;



// The connection many StoreClients may share. Every caller sends its
// request under `mu`; then one caller at a time reads the socket (`reading`)
// and hands each answer to the caller waiting for its id; the others wait
// on `cv`. The socket is closed only while no one reads it.
struct StoreClient::Connection {
  Connection(std::string h, int p, std::string t)
      : host(std::move(h)), port(p), address(host + ":" + std::to_string(port)), token(std::move(t)) {}
  ~Connection() {
    if (fd >= 0) ::close(fd);
  }

  struct Pending {
    bool done = false, failed = false;
    uint8_t status = 0;
    std::string field, error;
  };

  const std::string host;
  const int port;
  const std::string address;
  const std::string token;
  std::mutex mu;
  std::condition_variable cv;
  int fd = -1;
  bool reading = false;
  bool broken = false;  // to be closed once no one reads it
  uint32_t next_id = 1;
  std::map<uint32_t, Pending*> pending;
  std::string rbuf;  // the reader's bytes not yet a whole answer
  int64_t connects = 0;

  uint32_t new_id() {
    const uint32_t id = next_id++;
    if (next_id == 0) next_id = 1;
    return id;
  }

  // Every call in flight fails with `why`; the socket goes now, or when its
  // reader is out.
  void fail_all_locked(const std::string& why) {
    for (auto& [id, p] : pending) {
      p->done = p->failed = true;
      p->error = why;
    }
    pending.clear();
    broken = true;
    close_if_idle_locked();
    cv.notify_all();
  }

  void close_if_idle_locked() {
    if (!broken || reading) return;
    if (fd >= 0) ::close(fd);
    fd = -1;
    rbuf.clear();
    broken = false;
  }

  // A usable connection (waiting for a broken one's reader to leave it).
  void ready_locked(std::unique_lock<std::mutex>& lk, std::chrono::steady_clock::time_point deadline) {
    while (broken && reading) cv.wait_for(lk, std::chrono::milliseconds(5));
    close_if_idle_locked();
    if (fd < 0) connect_locked(deadline);
  }

  // The whole frame, or false at the deadline (PeerFailure on errors).
  bool send_locked(const std::string& req, std::chrono::steady_clock::time_point deadline) {
    for (size_t o = 0; o < req.size();) {
      ssize_t n = ::send(fd, req.data() + o, req.size() - o, MSG_NOSIGNAL);
      if (n > 0) {
        o += static_cast<size_t>(n);
        continue;
      }
      if (n < 0 && errno == EINTR) continue;
      if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
        pollfd p{fd, POLLOUT, 0};
        if (::poll(&p, 1, ms_until(deadline)) == 0) return false;
        continue;
      }
      throw PeerFailure("rendezvous store at " + address + ": send failed: " + std::strerror(errno));
    }
    return true;
  }

  // Withdraws parked request `id` (its answer, should it come, is dropped).
  void withdraw_locked(uint32_t id) {
    if (fd < 0 || broken) return;
    try {
      if (!send_locked(frame(kCancel, {id_field(new_id()), id_field(id)}),
                       std::chrono::steady_clock::now() + std::chrono::milliseconds(100)))
        fail_all_locked("rendezvous store at " + address + ": no room to withdraw a wait");
    } catch (const PeerFailure& e) {
      fail_all_locked(e.what());
    }
  }

  // Reads what arrives within `wait_ms` (without the lock: only the reader
  // touches the socket's input and `rbuf`); false with `why` when the
  // connection broke.
  bool read_some(int wait_ms, std::vector<std::string>* frames, std::string* why) {
    pollfd p{fd, POLLIN, 0};
    const int pr = ::poll(&p, 1, wait_ms);
    if (pr < 0 && errno != EINTR) {
      *why = std::string("poll failed: ") + std::strerror(errno);
      return false;
    }
    if (pr <= 0) return true;
    char buf[65536];
    for (;;) {
      ssize_t n = ::recv(fd, buf, sizeof buf, MSG_DONTWAIT);
      if (n > 0) {
        rbuf.append(buf, static_cast<size_t>(n));
        if (static_cast<size_t>(n) < sizeof buf) break;
        continue;
      }
      if (n == 0) {
        *why = "the store closed the connection";
        return false;
      }
      if (errno == EINTR) continue;
      if (errno == EAGAIN || errno == EWOULDBLOCK) break;
      *why = std::string("recv failed: ") + std::strerror(errno);
      return false;
    }
    size_t at = 0;
    while (rbuf.size() - at >= 4) {
      const size_t len = get_u32(rbuf.data() + at);
      if (len == 0 || len > kMaxFrame) {
        *why = "an answer of " + std::to_string(len) + " bytes";
        return false;
      }
      if (rbuf.size() - at < 4 + len) break;
      frames->push_back(rbuf.substr(at, 4 + len));
      at += 4 + len;
    }
    rbuf.erase(0, at);
    return true;
  }

  // Hands an answer to the call waiting for its id (none: a withdrawn wait's).
  void dispatch_locked(const std::string& fr) {
    std::vector<std::string> f;
    if (!parse_fields(fr.data() + 5, fr.size() - 5, &f) || f.empty() || f[0].size() != 4 || f.size() > 2) {
      fail_all_locked("rendezvous store at " + address + ": a malformed answer");
      return;
    }
    auto it = pending.find(get_u32(f[0].data()));
    if (it == pending.end()) return;
    Pending& p = *it->second;
    p.status = static_cast<uint8_t>(fr[4]);
    if (f.size() == 2) p.field = std::move(f[1]);
    p.done = true;
    pending.erase(it);
  }

  void connect_locked(std::chrono::steady_clock::time_point deadline);
  void handshake_locked(std::chrono::steady_clock::time_point deadline);
  // One whole frame (the handshake's; nothing else is in flight), or empty
  // at the deadline. Throws PeerFailure on errors.
  std::string read_one_frame_locked(std::chrono::steady_clock::time_point deadline);
};

StoreClient::StoreClient(const std::string& host, int port, std::chrono::milliseconds timeout,
                         std::string token)
    : conn_(std::make_shared<Connection>(host, port, std::move(token))), timeout_(timeout) {
  std::unique_lock<std::mutex> lock(conn_->mu);
  conn_->connect_locked(std::chrono::steady_clock::now() + timeout_);
}

StoreClient::StoreClient(const StoreClient& other, std::chrono::milliseconds timeout)
    : conn_(other.conn_), timeout_(timeout) {}

StoreClient::~StoreClient() = default;

const std::string& StoreClient::address() const { return conn_->address; }

int64_t StoreClient::connects() const {
  std::lock_guard<std::mutex> lock(conn_->mu);
  return conn_->connects;
}

void StoreClient::Connection::connect_locked(std::chrono::steady_clock::time_point deadline) {
  std::string why = "no answer";
  do {
    addrinfo* res = resolve(host, port, false);
    if (!res) throw PeerFailure("cannot resolve the rendezvous store host '" + host + "'");
    int s = ::socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    int rc = ::connect(s, res->ai_addr, res->ai_addrlen);
    ::freeaddrinfo(res);
    if (rc != 0 && errno == EINPROGRESS) {
      pollfd p{s, POLLOUT, 0};
      if (::poll(&p, 1, std::max(1, ms_until(deadline))) == 1) {
        int err = 0;
        socklen_t len = sizeof err;
        ::getsockopt(s, SOL_SOCKET, SO_ERROR, &err, &len);
        rc = err == 0 ? 0 : -1;
        errno = err;
      } else {
        errno = ETIMEDOUT;
      }
    }
    if (rc == 0) {
      set_nodelay(s);
      fd = s;  // used by the handshake; dropped again unless it succeeds
      rbuf.clear();
      try {
        handshake_locked(deadline);
        connects += 1;
        return;
      } catch (const PeerFailure& e) {  // e.g. the server closed a connection over its cap: try again
        ::close(fd);
        fd = -1;
        why = e.what();
      } catch (...) {  // a store that is not ours, or refused us: never used
        ::close(fd);
        fd = -1;
        throw;
      }
    } else {
      why = std::strerror(errno);
      ::close(s);
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  } while (std::chrono::steady_clock::now() < deadline);
  throw PeerFailure("cannot reach the rendezvous store at " + address + " (" + why + ")");
}

// The server's hello, then (when it asks) the challenge of comm/auth.h.
void StoreClient::Connection::handshake_locked(std::chrono::steady_clock::time_point deadline) {
  auto fields = [&](const std::string& fr, uint8_t* status) {
    std::vector<std::string> f;
    if (fr.size() < 5 || !parse_fields(fr.data() + 5, fr.size() - 5, &f))
      throw PeerFailure("rendezvous store at " + address + ": a malformed handshake");
    *status = static_cast<uint8_t>(fr[4]);
    return f;
  };
  uint8_t status = 0;
  const std::string hello_frame = read_one_frame_locked(deadline);
  if (hello_frame.empty()) throw PeerFailure("rendezvous store at " + address + ": no hello in time");
  auto hello = fields(hello_frame, &status);
  if (status != kHello || hello.size() != 2 || hello[0] != kProtocol)
    throw InvalidInput("the rendezvous store at " + address + " does not speak " + kProtocol +
                       " (another program, or another Limbo version, on that port?)");
  const std::string& nonce = hello[1];
  if (nonce.empty()) {
    if (!token.empty())
      throw InvalidInput("the rendezvous store at " + address + " does not ask for the job secret this "
                         "process was given; refusing to trust it (another job on that address?)");
    return;
  }
  if (token.empty())
    throw InvalidInput("the rendezvous store at " + address + " needs the job's secret: give --token-file "
                       "FILE or set LIMBO_JOB_TOKEN, as on the launcher that hosts it");
  const std::string mine = random_bytes(32);
  if (!send_locked(frame(kAuth, {mine, client_proof(token, nonce, mine)}), deadline))
    throw PeerFailure("rendezvous store at " + address + ": handshake timed out");
  // (A connection closed here is a PeerFailure, retried: the server may
  // have timed the handshake out on a starved machine. Only an explicit
  // "denied" is a wrong secret.)
  const std::string fr = read_one_frame_locked(deadline);
  if (fr.empty()) throw PeerFailure("rendezvous store at " + address + ": handshake timed out");
  auto ok = fields(fr, &status);
  if (status == kDenied)
    throw InvalidInput("the rendezvous store at " + address + " refused this process's job secret (a "
                       "different --token-file / LIMBO_JOB_TOKEN than the launcher that hosts it?)");
  if (status != kOk || ok.size() != 1 || !same_secret_bytes(ok[0], server_proof(token, nonce, mine)))
    throw InvalidInput("the rendezvous store at " + address + " could not prove it knows the job secret; "
                       "refusing to trust it");
}

std::string StoreClient::Connection::read_one_frame_locked(std::chrono::steady_clock::time_point deadline) {
  std::string in;
  size_t want = 4;
  char buf[65536];
  while (in.size() < want) {
    pollfd p{fd, POLLIN, 0};
    int pr = ::poll(&p, 1, ms_until(deadline));
    if (pr < 0 && errno == EINTR) continue;
    if (pr == 0) {
      if (std::chrono::steady_clock::now() >= deadline) return {};
      continue;
    }
    // Never read past it.
    ssize_t n = ::recv(fd, buf, std::min(sizeof buf, want - in.size()), 0);
    if (n == 0) throw PeerFailure("rendezvous store at " + address + ": the store closed the connection");
    if (n < 0) {
      if (errno == EINTR || errno == EAGAIN || errno == EWOULDBLOCK) continue;
      throw PeerFailure("rendezvous store at " + address + ": recv failed: " + std::strerror(errno));
    }
    in.append(buf, static_cast<size_t>(n));
    if (want == 4 && in.size() >= 4) {
      const size_t len = get_u32(in.data());
      if (len == 0 || len > kMaxFrame)
        throw PeerFailure("rendezvous store at " + address + ": an answer of " + std::to_string(len) + " bytes");
      want = 4 + len;
    }
  }
  return in;
}

std::pair<uint8_t, std::string> StoreClient::call(uint8_t op, const std::vector<std::string>& fields,
                                                  std::chrono::milliseconds timeout) {
  Connection& c = *conn_;
  std::unique_lock<std::mutex> lk(c.mu);
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  c.ready_locked(lk, deadline);
  const uint32_t id = c.new_id();
  std::vector<std::string> f{id_field(id)};
  f.insert(f.end(), fields.begin(), fields.end());
  Connection::Pending me;
  c.pending[id] = &me;
  const bool waits = op == kGet || op == kWait || op == kWaitFor;
  const bool cancellable = waits && static_cast<bool>(cancel_);
  auto give_up = [&](bool timed_out, const std::string& what) {
    c.pending.erase(id);
    if (timed_out && waits) {
      c.withdraw_locked(id);  // the others' calls go on
      throw Timeout("rendezvous store at " + c.address + ": no answer within " + std::to_string(timeout.count()) +
                    " ms (" + what + ")");
    }
    c.fail_all_locked("rendezvous store at " + c.address + ": " + what);
    if (timed_out)
      throw Timeout("rendezvous store at " + c.address + ": no answer within " + std::to_string(timeout.count()) +
                    " ms (" + what + ")");
    throw PeerFailure("rendezvous store at " + c.address + ": " + what);
  };
  try {
    if (!c.send_locked(frame(op, f), deadline)) give_up(true, "sending");
  } catch (const PeerFailure& e) {
    c.pending.erase(id);
    c.fail_all_locked(e.what());
    throw;
  }
  while (!me.done) {
    if (cancellable && cancel_()) {
      c.pending.erase(id);
      c.withdraw_locked(id);
      throw PeerFailure("rendezvous store at " + c.address + ": wait cancelled (superseded)");
    }
    const auto now = std::chrono::steady_clock::now();
    if (now >= deadline) give_up(true, "waiting for the answer");
    if (!c.reading) {
      c.reading = true;
      const int slice = std::max(1, std::min(ms_until(deadline), cancellable ? 5 : 50));
      std::vector<std::string> frames;
      std::string why;
      lk.unlock();
      const bool ok = c.read_some(slice, &frames, &why);
      lk.lock();
      c.reading = false;
      for (const auto& fr : frames) c.dispatch_locked(fr);
      if (!ok) c.fail_all_locked("rendezvous store at " + c.address + ": " + why);
      c.close_if_idle_locked();
      c.cv.notify_all();
    } else {
      c.cv.wait_for(lk, std::chrono::milliseconds(5));
    }
  }
  if (me.failed) throw PeerFailure(me.error);
  if (me.status == kBad)
    throw InvalidInput("rendezvous store at " + c.address + ": " + (me.field.empty() ? "bad request" : me.field));
  return {me.status, std::move(me.field)};
}

void StoreClient::set(const std::string& key, const std::string& value) { call(kSet, {key, value}, timeout_); }

std::optional<std::string> StoreClient::try_get(const std::string& key) {
  auto [status, v] = call(kTryGet, {key}, timeout_);
  if (status == kMissing) return std::nullopt;
  return v;
}

std::string StoreClient::get(const std::string& key, std::chrono::milliseconds timeout) {
  try {
    return call(kGet, {key}, timeout).second;
  } catch (const Timeout&) {
    throw Timeout("rendezvous store at " + address() + ": key '" + key + "' did not appear within " +
                  std::to_string(timeout.count()) + " ms");
  }
}

int64_t StoreClient::add(const std::string& key, int64_t delta) {
  return std::stoll(call(kAdd, {key, std::to_string(delta)}, timeout_).second);
}

std::string StoreClient::compare_set(const std::string& key, const std::string& expected,
                                     const std::string& desired) {
  return call(kCompareSet, {key, expected, desired}, timeout_).second;
}

bool StoreClient::erase(const std::string& key) { return call(kErase, {key}, timeout_).second == "1"; }

bool StoreClient::check(const std::vector<std::string>& keys) { return call(kCheck, keys, timeout_).second == "1"; }

std::vector<std::pair<std::string, std::string>> StoreClient::list(const std::string& prefix) {
  const std::string packed = call(kList, {prefix}, timeout_).second;
  std::vector<std::string> f;
  if (!parse_fields(packed.data(), packed.size(), &f) || f.size() % 2 != 0)
    throw PeerFailure("rendezvous store at " + address() + ": a malformed list answer");
  std::vector<std::pair<std::string, std::string>> out;
  for (size_t i = 0; i < f.size(); i += 2) out.emplace_back(std::move(f[i]), std::move(f[i + 1]));
  return out;
}

// Answer: revision, full (0/1), the count of written keys, the written
// keys and values, then the erased keys.
KvChanges StoreClient::changes_since(const std::vector<std::string>& prefixes, int64_t since) {
  std::vector<std::string> req{std::to_string(since)};
  req.insert(req.end(), prefixes.begin(), prefixes.end());
  const std::string packed = call(kChanges, req, timeout_).second;
  std::vector<std::string> f;
  KvChanges c;
  size_t written = 0;
  bool ok = parse_fields(packed.data(), packed.size(), &f) && f.size() >= 3;
  try {
    if (ok) {
      c.revision = std::stoll(f[0]);
      c.full = f[1] == "1";
      written = static_cast<size_t>(std::stoll(f[2]));
      ok = 3 + 2 * written <= f.size();
    }
  } catch (const std::exception&) {
    ok = false;
  }
  if (!ok) throw PeerFailure("rendezvous store at " + address() + ": a malformed answer of changes");
  for (size_t i = 0; i < written; ++i) c.written.emplace_back(std::move(f[3 + 2 * i]), std::move(f[4 + 2 * i]));
  for (size_t i = 3 + 2 * written; i < f.size(); ++i) c.erased.push_back(std::move(f[i]));
  return c;
}

int64_t StoreClient::num_keys() { return std::stoll(call(kNumKeys, {}, timeout_).second); }

void StoreClient::wait(const std::vector<std::string>& keys, std::chrono::milliseconds timeout) {
  if (keys.empty()) return;
  try {
    call(kWait, keys, timeout);
  } catch (const Timeout&) {
    std::string names;
    for (const auto& k : keys) names += (names.empty() ? "'" : ", '") + k + "'";
    throw Timeout("rendezvous store at " + address() + ": keys " + names + " did not all appear within " +
                  std::to_string(timeout.count()) + " ms");
  }
}

bool StoreClient::wait_for(const std::vector<std::string>& keys, std::chrono::milliseconds timeout) {
  if (keys.empty()) return true;
  std::vector<std::string> f = {std::to_string(timeout.count())};
  f.insert(f.end(), keys.begin(), keys.end());
  // The server answers at its deadline; the client allows its own timeout
  // on top for the network.
  return call(kWaitFor, f, timeout + timeout_).first == kOk;
}

}  // namespace limbo::comm
