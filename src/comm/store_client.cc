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

namespace {
// See StoreClient::call: a connection silent this long while a request
// waits for its answer is dropped.
constexpr std::chrono::milliseconds kSilentDrop{2000};
}  // namespace



// The connection many StoreClients may share. One caller at a time holds
// the right to write (`writing`: connect, handshake, send), taken within its
// own deadline and used without `mu`; one caller at a time reads the socket
// (`reading`) and hands each answer to the caller waiting for its id; the
// others wait on `cv`. The socket is closed only while no one reads or
// writes it. A call that times out costs only itself: its answer, should it
// come, is dropped by its id; only a request sent in part (the stream can
// no longer be read in step) or a broken socket ends the connection.
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
  bool writing = false;
  std::vector<uint32_t> withdrawals;  // given-up waits, withdrawn by the next send
  bool broken = false;  // to be closed once no one reads it
  uint32_t next_id = 1;
  std::map<uint32_t, Pending*> pending;
  std::string rbuf;  // the reader's bytes not yet a whole answer
  int64_t connects = 0;
  std::chrono::steady_clock::time_point heard{};  // the last bytes read (or the connection made)

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

  // (`by_writer`: called by the holder of the right to write.)
  void close_if_idle_locked(bool by_writer = false) {
    if (!broken || reading || (writing && !by_writer)) return;
    if (fd >= 0) ::close(fd);
    fd = -1;
    rbuf.clear();
    broken = false;
  }

  // The right to write, within `deadline` (false: another call holds it).
  bool acquire_writer_locked(std::unique_lock<std::mutex>& lk, std::chrono::steady_clock::time_point deadline) {
    while (writing)
      if (cv.wait_until(lk, deadline) == std::cv_status::timeout && writing) return false;
    writing = true;
    return true;
  }
  void release_writer_locked() {
    writing = false;
    close_if_idle_locked();
    cv.notify_all();
  }

  // With the right to write: a usable connection (a broken one closed once
  // its reader left it; connecting without `mu`).
  void ready_locked(std::unique_lock<std::mutex>& lk, std::chrono::steady_clock::time_point deadline) {
    while (broken && reading && std::chrono::steady_clock::now() < deadline)
      cv.wait_for(lk, std::chrono::milliseconds(5));
    close_if_idle_locked(/*by_writer=*/true);
    if (fd >= 0) return;
    if (broken) throw PeerFailure("rendezvous store at " + address + ": the connection is still being read");
    lk.unlock();
    int s = -1;
    try {
      s = connect_socket(deadline);
    } catch (...) {
      lk.lock();
      throw;
    }
    lk.lock();
    fd = s;
    rbuf.clear();
    connects += 1;
    heard = std::chrono::steady_clock::now();
  }

  // The frames queued to withdraw given-up waits (taken: the caller sends
  // them; `ids` says which, to queue again what was not sent).
  std::string take_withdrawals_locked(std::vector<uint32_t>* ids) {
    std::string out;
    for (uint32_t id : withdrawals) out += frame(kCancel, {id_field(new_id()), id_field(id)});
    *ids = std::move(withdrawals);
    withdrawals.clear();
    return out;
  }
  // After a send of `sent` bytes of which the first `queued` were
  // withdrawals (`ids`): true when the stream is still in step (whole
  // frames or nothing), the unsent withdrawals queued again.
  bool in_step_after_locked(size_t sent, size_t queued, const std::vector<uint32_t>& ids) {
    const size_t one = frame(kCancel, {id_field(0), id_field(0)}).size();
    if (sent > queued || sent % one != 0) return false;
    withdrawals.insert(withdrawals.end(), ids.begin() + static_cast<std::ptrdiff_t>(sent / one), ids.end());
    return true;
  }

  // Withdraws parked request `id` (its answer, should it come, is dropped):
  // now when no one is writing, else with the next request.
  void withdraw_locked(std::unique_lock<std::mutex>& lk, uint32_t id) {
    if (fd < 0 || broken) return;
    withdrawals.push_back(id);
    if (writing) return;
    writing = true;
    const int s = fd;
    std::vector<uint32_t> ids;
    const std::string out = take_withdrawals_locked(&ids);
    lk.unlock();
    size_t sent = 0;
    std::string why;
    try {
      sent = send_some(s, out, std::chrono::steady_clock::now() + std::chrono::milliseconds(100));
    } catch (const PeerFailure& e) {
      why = e.what();
    }
    lk.lock();
    if (!why.empty()) fail_all_locked(why);
    else if (!in_step_after_locked(sent, out.size(), ids))  // (unsent ones go with the next request)
      fail_all_locked("rendezvous store at " + address + ": a withdrawal sent in part");
    release_writer_locked();
  }

  // Sends `out` on socket `s` (without `mu`): the bytes sent, all of them or
  // fewer at the deadline. PeerFailure on errors.
  size_t send_some(int s, const std::string& out, std::chrono::steady_clock::time_point deadline) {
    size_t o = 0;
    while (o < out.size()) {
      ssize_t n = ::send(s, out.data() + o, out.size() - o, MSG_NOSIGNAL);
      if (n > 0) {
        o += static_cast<size_t>(n);
        continue;
      }
      if (n < 0 && errno == EINTR) continue;
      if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
        const int ms = ms_until(deadline);
        if (ms <= 0) break;
        pollfd p{s, POLLOUT, 0};
        ::poll(&p, 1, ms);
        continue;
      }
      throw PeerFailure("rendezvous store at " + address + ": send failed: " + std::strerror(errno));
    }
    return o;
  }

  // Reads what arrives on `s` within `wait_ms` (without the lock: only the
  // reader touches the socket's input and `rbuf`); false with `why` when
  // the connection broke.
  bool read_some(int s, int wait_ms, std::vector<std::string>* frames, std::string* why) {
    pollfd p{s, POLLIN, 0};
    const int pr = ::poll(&p, 1, wait_ms);
    if (pr < 0 && errno != EINTR) {
      *why = std::string("poll failed: ") + std::strerror(errno);
      return false;
    }
    if (pr <= 0) return true;
    char buf[65536];
    for (;;) {
      ssize_t n = ::recv(s, buf, sizeof buf, MSG_DONTWAIT);
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

  // A connected, authenticated socket (retrying until the deadline), made
  // without `mu` by the holder of the right to write.
  int connect_socket(std::chrono::steady_clock::time_point deadline);
  void handshake(int s, std::chrono::steady_clock::time_point deadline);
  // One whole frame (the handshake's; nothing else is in flight), or empty
  // at the deadline. Throws PeerFailure on errors.
  std::string read_one_frame(int s, std::chrono::steady_clock::time_point deadline);
};

StoreClient::StoreClient(const std::string& host, int port, std::chrono::milliseconds timeout,
                         std::string token)
    : conn_(std::make_shared<Connection>(host, port, std::move(token))), timeout_(timeout) {
  Connection& c = *conn_;
  const auto deadline = std::chrono::steady_clock::now() + timeout_;
  std::unique_lock<std::mutex> lk(c.mu);
  c.acquire_writer_locked(lk, deadline);  // a new connection: no one else writes
  try {
    c.ready_locked(lk, deadline);
  } catch (...) {
    c.release_writer_locked();
    throw;
  }
  c.release_writer_locked();
}

StoreClient::StoreClient(const StoreClient& other, std::chrono::milliseconds timeout)
    : conn_(other.conn_), timeout_(timeout) {}

StoreClient::~StoreClient() = default;

const std::string& StoreClient::address() const { return conn_->address; }

int64_t StoreClient::connects() const {
  std::lock_guard<std::mutex> lock(conn_->mu);
  return conn_->connects;
}

int StoreClient::Connection::connect_socket(std::chrono::steady_clock::time_point deadline) {
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
      try {
        handshake(s, deadline);
        return s;
      } catch (const PeerFailure& e) {  // e.g. the server closed a connection over its cap: try again
        ::close(s);
        why = e.what();
      } catch (...) {  // a store that is not ours, or refused us: never used
        ::close(s);
        throw;
      }
    } else {
      why = std::strerror(errno);
      ::close(s);
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(std::clamp(ms_until(deadline), 0, 20)));
  } while (std::chrono::steady_clock::now() < deadline);
  throw PeerFailure("cannot reach the rendezvous store at " + address + " (" + why + ")");
}

// The server's hello, then (when it asks) the challenge of comm/auth.h.
void StoreClient::Connection::handshake(int s, std::chrono::steady_clock::time_point deadline) {
  auto fields = [&](const std::string& fr, uint8_t* status) {
    std::vector<std::string> f;
    if (fr.size() < 5 || !parse_fields(fr.data() + 5, fr.size() - 5, &f))
      throw PeerFailure("rendezvous store at " + address + ": a malformed handshake");
    *status = static_cast<uint8_t>(fr[4]);
    return f;
  };
  uint8_t status = 0;
  const std::string hello_frame = read_one_frame(s, deadline);
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
  const std::string auth = frame(kAuth, {mine, client_proof(token, nonce, mine)});
  if (send_some(s, auth, deadline) != auth.size())
    throw PeerFailure("rendezvous store at " + address + ": handshake timed out");
  // (A connection closed here is a PeerFailure, retried: the server may
  // have timed the handshake out on a starved machine. Only an explicit
  // "denied" is a wrong secret.)
  const std::string fr = read_one_frame(s, deadline);
  if (fr.empty()) throw PeerFailure("rendezvous store at " + address + ": handshake timed out");
  auto ok = fields(fr, &status);
  if (status == kDenied)
    throw InvalidInput("the rendezvous store at " + address + " refused this process's job secret (a "
                       "different --token-file / LIMBO_JOB_TOKEN than the launcher that hosts it?)");
  if (status != kOk || ok.size() != 1 || !same_secret_bytes(ok[0], server_proof(token, nonce, mine)))
    throw InvalidInput("the rendezvous store at " + address + " could not prove it knows the job secret; "
                       "refusing to trust it");
}

std::string StoreClient::Connection::read_one_frame(int s, std::chrono::steady_clock::time_point deadline) {
  std::string in;
  size_t want = 4;
  char buf[65536];
  while (in.size() < want) {
    pollfd p{s, POLLIN, 0};
    int pr = ::poll(&p, 1, ms_until(deadline));
    if (pr < 0 && errno == EINTR) continue;
    if (pr == 0) {
      if (std::chrono::steady_clock::now() >= deadline) return {};
      continue;
    }
    // Never read past it.
    ssize_t n = ::recv(s, buf, std::min(sizeof buf, want - in.size()), 0);
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
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  std::vector<std::string> f{id_field(0)};  // the id, set once known
  f.insert(f.end(), fields.begin(), fields.end());
  std::string req = frame(op, f);
  // The server closes a connection that sends more (every call on it would fail).
  if (req.size() - 4 > kMaxFrame)
    throw InvalidInput("rendezvous store at " + c.address + ": a request of " + std::to_string(req.size() >> 20) +
                       " MiB; the store takes at most " + std::to_string(kMaxFrame >> 20) + " MiB a request");
  const bool waits = op == kGet || op == kWait || op == kWaitFor;
  const bool cancellable = waits && static_cast<bool>(cancel_);
  auto timed_out = [&](const std::string& what) {
    return Timeout("rendezvous store at " + c.address + ": no answer within " + std::to_string(timeout.count()) +
                   " ms (" + what + ")");
  };
  std::unique_lock<std::mutex> lk(c.mu);
  if (!c.acquire_writer_locked(lk, deadline)) throw timed_out("another call was sending or connecting");
  Connection::Pending me;
  uint32_t id = 0;
  auto sent_at = std::chrono::steady_clock::now();
  try {
    c.ready_locked(lk, deadline);
    id = c.new_id();
    const std::string idf = id_field(id);
    req.replace(9, 4, idf);  // after the length, the op and the id field's length
    c.pending[id] = &me;
    std::vector<uint32_t> withdrawn;
    const std::string before = c.take_withdrawals_locked(&withdrawn);
    const std::string out = before.empty() ? std::string() : before + req;
    const std::string& bytes = before.empty() ? req : out;
    const int s = c.fd;
    lk.unlock();
    size_t sent = 0;
    try {
      sent = c.send_some(s, bytes, deadline);
    } catch (...) {
      lk.lock();
      throw;
    }
    lk.lock();
    sent_at = std::chrono::steady_clock::now();
    if (sent < bytes.size()) {
      c.pending.erase(id);
      // Nothing of this request went: only this call fails. Part of it (or
      // of a withdrawal): the rest would be read as the next request's start.
      if (!c.in_step_after_locked(sent, before.size(), withdrawn))
        c.fail_all_locked("rendezvous store at " + c.address + ": a request sent in part at its deadline");
      c.release_writer_locked();
      throw timed_out("sending");
    }
  } catch (const PeerFailure& e) {
    if (id != 0) c.pending.erase(id);
    if (id != 0) c.fail_all_locked(e.what());
    c.release_writer_locked();
    throw;
  } catch (...) {
    if (id != 0) c.pending.erase(id);
    c.release_writer_locked();
    throw;
  }
  c.release_writer_locked();
  // A wait given up is withdrawn from the server; any call given up is only
  // forgotten here (its answer, should it come, is dropped by id).
  auto give_up = [&]() {
    c.pending.erase(id);
    if (waits) c.withdraw_locked(lk, id);
  };
  while (!me.done) {
    if (cancellable && cancel_()) {
      give_up();
      throw PeerFailure("rendezvous store at " + c.address + ": wait cancelled (superseded)");
    }
    if (std::chrono::steady_clock::now() >= deadline) {
      give_up();
      // A connection that has carried nothing since this request went, and
      // nothing for kSilentDrop, is taken for dead (a host cut off: its
      // calls then fail at once on connecting, not each after its timeout).
      // A store that is only slow answers something within that.
      if (!waits && c.heard < sent_at && std::chrono::steady_clock::now() - c.heard > kSilentDrop)
        c.fail_all_locked("rendezvous store at " + c.address + ": nothing heard on the connection for " +
                          std::to_string(std::chrono::duration_cast<std::chrono::milliseconds>(
                                             std::chrono::steady_clock::now() - c.heard)
                                             .count()) +
                          " ms");
      throw timed_out("waiting for the answer");
    }
    if (!c.reading && c.fd >= 0) {
      c.reading = true;
      const int s = c.fd;
      const int slice = std::max(1, std::min(ms_until(deadline), cancellable ? 5 : 50));
      std::vector<std::string> frames;
      std::string why;
      lk.unlock();
      const bool ok = c.read_some(s, slice, &frames, &why);
      lk.lock();
      c.reading = false;
      if (!frames.empty()) c.heard = std::chrono::steady_clock::now();
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
