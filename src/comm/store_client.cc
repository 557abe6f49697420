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



StoreClient::StoreClient(const std::string& host, int port, std::chrono::milliseconds timeout,
                         std::string token)
    : host_(host),
      port_(port),
      address_(host + ":" + std::to_string(port)),
      timeout_(timeout),
      token_(std::move(token)) {
  std::lock_guard<std::mutex> lock(mu_);
  connect_locked(std::chrono::steady_clock::now() + timeout_);
}

StoreClient::~StoreClient() {
  std::lock_guard<std::mutex> lock(mu_);
  drop_locked();
}

void StoreClient::drop_locked() {
  if (fd_ >= 0) ::close(fd_);
  fd_ = -1;
}

void StoreClient::connect_locked(std::chrono::steady_clock::time_point deadline) {
  std::string why = "no answer";
  do {
    addrinfo* res = resolve(host_, port_, false);
    if (!res) throw PeerFailure("cannot resolve the rendezvous store host '" + host_ + "'");
    int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    int rc = ::connect(fd, res->ai_addr, res->ai_addrlen);
    ::freeaddrinfo(res);
    if (rc != 0 && errno == EINPROGRESS) {
      pollfd p{fd, POLLOUT, 0};
      if (::poll(&p, 1, std::max(1, ms_until(deadline))) == 1) {
        int err = 0;
        socklen_t len = sizeof err;
        ::getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len);
        rc = err == 0 ? 0 : -1;
        errno = err;
      } else {
        errno = ETIMEDOUT;
      }
    }
    if (rc == 0) {
      set_nodelay(fd);
      fd_ = fd;  // used by the handshake; dropped again unless it succeeds
      try {
        handshake_locked(deadline);
        return;
      } catch (const PeerFailure& e) {  // e.g. the server closed a connection over its cap: try again
        drop_locked();
        why = e.what();
      } catch (...) {  // a store that is not ours, or refused us: never used
        drop_locked();
        throw;
      }
    } else {
      why = std::strerror(errno);
      ::close(fd);
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  } while (std::chrono::steady_clock::now() < deadline);
  throw PeerFailure("cannot reach the rendezvous store at " + address_ + " (" + why + ")");
}

// The server's hello, then (when it asks) the challenge of comm/auth.h.
void StoreClient::handshake_locked(std::chrono::steady_clock::time_point deadline) {
  auto fields = [&](const std::string& fr, uint8_t* status) {
    std::vector<std::string> f;
    if (fr.size() < 5 || !parse_fields(fr.data() + 5, fr.size() - 5, &f))
      throw PeerFailure("rendezvous store at " + address_ + ": a malformed handshake");
    *status = static_cast<uint8_t>(fr[4]);
    return f;
  };
  uint8_t status = 0;
  const std::string hello_frame = read_frame_locked(deadline, false);
  if (hello_frame.empty()) throw PeerFailure("rendezvous store at " + address_ + ": no hello in time");
  auto hello = fields(hello_frame, &status);
  if (status != kHello || hello.size() != 2 || hello[0] != kProtocol)
    throw InvalidInput("the rendezvous store at " + address_ + " does not speak " + kProtocol +
                       " (another program, or another Limbo version, on that port?)");
  const std::string& nonce = hello[1];
  if (nonce.empty()) {
    if (!token_.empty())
      throw InvalidInput("the rendezvous store at " + address_ + " does not ask for the job secret this "
                         "process was given; refusing to trust it (another job on that address?)");
    return;
  }
  if (token_.empty())
    throw InvalidInput("the rendezvous store at " + address_ + " needs the job's secret: give --token-file "
                       "FILE or set LIMBO_JOB_TOKEN, as on the launcher that hosts it");
  const std::string mine = random_bytes(32);
  const std::string req = frame(kAuth, {mine, client_proof(token_, nonce, mine)});
  for (size_t o = 0; o < req.size();) {
    ssize_t n = ::send(fd_, req.data() + o, req.size() - o, MSG_NOSIGNAL);
    if (n > 0) o += static_cast<size_t>(n);
    else if (n < 0 && (errno == EINTR || errno == EAGAIN || errno == EWOULDBLOCK)) {
      pollfd p{fd_, POLLOUT, 0};
      if (::poll(&p, 1, ms_until(deadline)) == 0) throw PeerFailure("rendezvous store at " + address_ + ": handshake timed out");
    } else {
      throw PeerFailure("rendezvous store at " + address_ + ": " + std::strerror(errno));
    }
  }
  // (A connection closed here is a PeerFailure, retried: the server may
  // have timed the handshake out on a starved machine. Only an explicit
  // "denied" is a wrong secret.)
  const std::string fr = read_frame_locked(deadline, false);
  if (fr.empty()) throw PeerFailure("rendezvous store at " + address_ + ": handshake timed out");
  auto ok = fields(fr, &status);
  if (status == kDenied)
    throw InvalidInput("the rendezvous store at " + address_ + " refused this process's job secret (a "
                       "different --token-file / LIMBO_JOB_TOKEN than the launcher that hosts it?)");
  if (status != kOk || ok.size() != 1 || !same_secret_bytes(ok[0], server_proof(token_, nonce, mine)))
    throw InvalidInput("the rendezvous store at " + address_ + " could not prove it knows the job secret; "
                       "refusing to trust it");
}

std::string StoreClient::read_frame_locked(std::chrono::steady_clock::time_point deadline, bool cancellable) {
  std::string in;
  size_t want = 4;
  char buf[65536];
  const bool check = cancellable && cancel_;
  while (in.size() < want) {
    pollfd p{fd_, POLLIN, 0};
    const int wait_ms = check ? std::min(ms_until(deadline), 5) : ms_until(deadline);
    int pr = ::poll(&p, 1, wait_ms);
    if (pr < 0 && errno == EINTR) continue;
    if (pr == 0) {
      if (check && cancel_()) throw PeerFailure("rendezvous store at " + address_ + ": wait cancelled (superseded)");
      if (std::chrono::steady_clock::now() >= deadline) return {};
      continue;
    }
    // One answer at a time: never read past it.
    ssize_t n = ::recv(fd_, buf, std::min(sizeof buf, want - in.size()), 0);
    if (n == 0) throw PeerFailure("rendezvous store at " + address_ + ": the store closed the connection");
    if (n < 0) {
      if (errno == EINTR || errno == EAGAIN || errno == EWOULDBLOCK) continue;
      throw PeerFailure("rendezvous store at " + address_ + ": recv failed: " + std::strerror(errno));
    }
    in.append(buf, static_cast<size_t>(n));
    if (want == 4 && in.size() >= 4) {
      const size_t len = get_u32(in.data());
      if (len == 0 || len > kMaxFrame)
        throw PeerFailure("rendezvous store at " + address_ + ": an answer of " + std::to_string(len) + " bytes");
      want = 4 + len;
    }
  }
  return in;
}

std::pair<uint8_t, std::string> StoreClient::call(uint8_t op, const std::vector<std::string>& fields,
                                                  std::chrono::milliseconds timeout) {
  std::lock_guard<std::mutex> lock(mu_);
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  if (fd_ < 0) connect_locked(deadline);
  const std::string req = frame(op, fields);
  auto fail = [&](bool timed_out, const std::string& what) {
    drop_locked();
    if (timed_out)
      throw Timeout("rendezvous store at " + address_ + ": no answer within " +
                    std::to_string(timeout.count()) + " ms (" + what + ")");
    throw PeerFailure("rendezvous store at " + address_ + ": " + what);
  };
  for (size_t o = 0; o < req.size();) {
    ssize_t n = ::send(fd_, req.data() + o, req.size() - o, MSG_NOSIGNAL);
    if (n > 0) {
      o += static_cast<size_t>(n);
      continue;
    }
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
      pollfd p{fd_, POLLOUT, 0};
      if (::poll(&p, 1, ms_until(deadline)) == 0) fail(true, "sending");
      continue;
    }
    fail(false, std::string("send failed: ") + std::strerror(errno));
  }
  const bool waits = op == kGet || op == kWait || op == kWaitFor;
  std::string in;
  try {
    in = read_frame_locked(deadline, waits);
  } catch (const PeerFailure&) {
    drop_locked();  // an answer may still be on its way: this connection is out of step
    throw;
  }
  if (in.empty()) fail(true, "waiting for the answer");
  std::vector<std::string> f;
  if (!parse_fields(in.data() + 5, in.size() - 5, &f) || f.size() > 1) fail(false, "a malformed answer");
  const uint8_t status = static_cast<uint8_t>(in[4]);
  if (status == kBad) throw InvalidInput("rendezvous store at " + address_ + ": " + (f.empty() ? "bad request" : f[0]));
  return {status, f.empty() ? std::string() : f[0]};
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
    throw Timeout("rendezvous store at " + address_ + ": key '" + key + "' did not appear within " +
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
    throw PeerFailure("rendezvous store at " + address_ + ": a malformed list answer");
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
  if (!ok) throw PeerFailure("rendezvous store at " + address_ + ": a malformed answer of changes");
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
    throw Timeout("rendezvous store at " + address_ + ": keys " + names + " did not all appear within " +
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
