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

namespace limbo::comm {

namespace {

// Request op codes, shared by the server and the client.
using Code = uint8_t;
constexpr Code kSet = 1, kGet = 2, kTryGet = 3, kAdd = 4, kCompareSet = 5, kErase = 6, kCheck = 7,
             kNumKeys = 8, kWait = 9, kWaitFor = 10, kAuth = 11;
// Answer status codes; kHello opens every connection (comm/auth.h).
constexpr uint8_t kOk = 0, kMissing = 1, kBad = 2, kDenied = 3, kHello = 4;
constexpr const char* kProtocol = "limbo-store/2";
constexpr size_t kMaxFrame = size_t{64} << 20;
constexpr size_t kMaxOut = size_t{64} << 20;

void put_u32(std::string& s, uint32_t v) {
  for (int i = 0; i < 4; ++i) s.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
}
uint32_t get_u32(const char* p) {
  uint32_t v = 0;
  for (int i = 0; i < 4; ++i) v |= static_cast<uint32_t>(static_cast<uint8_t>(p[i])) << (8 * i);
  return v;
}

std::string frame(uint8_t head, const std::vector<std::string>& fields) {
  std::string body(1, static_cast<char>(head));
  for (const auto& f : fields) {
    put_u32(body, static_cast<uint32_t>(f.size()));
    body += f;
  }
  std::string out;
  put_u32(out, static_cast<uint32_t>(body.size()));
  return out + body;
}

// The fields after the head byte; false when they do not add up.
bool parse_fields(const char* p, size_t n, std::vector<std::string>* out) {
  size_t o = 0;
  while (o < n) {
    if (n - o < 4) return false;
    const size_t len = get_u32(p + o);
    o += 4;
    if (len > n - o) return false;
    out->emplace_back(p + o, len);
    o += len;
  }
  return true;
}

void set_nodelay(int fd) {
  int one = 1;
  ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
}

addrinfo* resolve(const std::string& host, int port, bool passive) {
  addrinfo hints{};
  hints.ai_family = AF_INET;
  hints.ai_socktype = SOCK_STREAM;
  if (passive) hints.ai_flags = AI_PASSIVE;
  addrinfo* res = nullptr;
  if (::getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &res) != 0 || !res) return nullptr;
  return res;
}

int ms_until(std::chrono::steady_clock::time_point deadline) {
  auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
  return static_cast<int>(std::max<int64_t>(0, std::min<int64_t>(left.count(), 1 << 30)));
}

}  // namespace

// ---- server ------------------------------------------------------------------

namespace {

using SteadyClock = std::chrono::steady_clock;

std::string peer_name(int fd) {
  sockaddr_in a{};
  socklen_t len = sizeof a;
  if (::getpeername(fd, reinterpret_cast<sockaddr*>(&a), &len) != 0 || a.sin_family != AF_INET) return "?";
  char buf[INET_ADDRSTRLEN] = {0};
  ::inet_ntop(AF_INET, &a.sin_addr, buf, sizeof buf);
  return std::string(buf) + ":" + std::to_string(ntohs(a.sin_port));
}

constexpr size_t kMaxHandshake = 4096;  // bytes a connection may send before it is authenticated
// Connections in their handshake at once: a flood without the secret
// cannot fill the connection cap and keep members out.
constexpr size_t kMaxPendingHandshakes = 256;
// Fairness: one connection's turn reads at most kReadBudget bytes and
// answers at most kServeBudget requests; a connection with kBacklog bytes
// of complete requests waiting is not read from until they are served (its
// sender is held back by TCP). Every other connection gets its turn in
// between, so a pipelining client cannot delay a heartbeat.
constexpr size_t kReadBudget = size_t{256} << 10;
constexpr int kServeBudget = 256;
constexpr size_t kBacklog = size_t{1} << 20;

}  // namespace

struct StoreServer::Impl {
  struct Conn {
    std::string in;
    size_t in_off = 0;     // bytes of `in` already parsed (compacted now and then: linear time)
    std::string out;
    size_t out_sent = 0;   // bytes of `out` already sent
    bool parked = false;   // a get / wait waiting for its keys
    Code parked_op = 0;
    std::vector<std::string> parked_keys;
    std::string waiting_on;  // the key it is indexed under in `waiters`
    SteadyClock::time_point parked_until = SteadyClock::time_point::max();
    bool authed = false;
    std::string nonce;     // this connection's challenge
    SteadyClock::time_point auth_deadline = SteadyClock::time_point::max();
    std::string peer;
    bool closing = false;
  };

  StoreServerOptions opt;
  int listen_fd = -1;
  int wake[2] = {-1, -1};
  int port = 0;
  std::atomic<bool> stop{false};
  std::map<std::string, std::string> kv;
  std::map<int, Conn> conns;
  // Parked connections by a key they still wait for; a write of that key
  // wakes only them (not every parked connection).
  std::map<std::string, std::set<int>> waiters;
  std::vector<int> woken;      // connections whose key was written
  std::vector<int> to_serve;   // connections with requests left to parse
  std::vector<int> busy;       // connections whose turn ended with requests left
  SteadyClock::time_point accept_paused_until{};
  ThrottledLog over_cap_log{"rendezvous store: "}, emfile_log{"rendezvous store: "},
      auth_log{"rendezvous store: "};
  std::thread thread;

  void run() {
    std::vector<pollfd> fds;
    while (!stop) {
      const auto now = SteadyClock::now();
      const bool accepting = now >= accept_paused_until;
      fds.clear();
      fds.push_back({accepting ? listen_fd : -1, POLLIN, 0});
      fds.push_back({wake[0], POLLIN, 0});
      for (auto& [fd, c] : conns)
        fds.push_back({fd, static_cast<short>((wants_input(c) ? POLLIN : 0) | POLLRDHUP |
                                              (c.out_sent < c.out.size() ? POLLOUT : 0)), 0});
      to_serve.swap(busy);  // their next turn
      busy.clear();
      if (::poll(fds.data(), fds.size(), to_serve.empty() ? poll_timeout_ms(now) : 0) < 0) {
        if (errno == EINTR) continue;
        log_warn(std::string("rendezvous store: poll failed: ") + std::strerror(errno));
        std::this_thread::sleep_for(std::chrono::milliseconds(10));
        continue;
      }
      if (stop) break;
      if (fds[0].revents & POLLIN) accept_all();
      for (size_t i = 2; i < fds.size(); ++i) {
        auto it = conns.find(fds[i].fd);
        if (it == conns.end()) continue;
        Conn& c = it->second;
        if (fds[i].revents & POLLIN) read_from(fds[i].fd, c);
        else if (fds[i].revents & (POLLERR | POLLHUP | POLLNVAL | POLLRDHUP)) c.closing = true;
        if (!c.closing && (fds[i].revents & POLLOUT)) flush(fds[i].fd, c);
      }
      expire(SteadyClock::now());
      drain();
      for (auto it = conns.begin(); it != conns.end();) {
        if (it->second.closing) {
          unindex(it->first, it->second);
          ::close(it->first);
          it = conns.erase(it);
        } else {
          ++it;
        }
      }
    }
  }

  // Reads only while the connection has no backlog of complete requests
  // (or needs the rest of a large one).
  static bool wants_input(const Conn& c) {
    const size_t pending = c.in.size() - c.in_off;
    if (pending < 4) return true;
    const size_t len = get_u32(c.in.data() + c.in_off);
    if (pending < 4 + static_cast<size_t>(std::min<size_t>(len, kMaxFrame))) return true;
    return pending < kBacklog && !c.parked;
  }

  size_t pending_handshakes() const {
    size_t n = 0;
    for (const auto& [fd, c] : conns) n += !c.authed;
    return n;
  }

  int poll_timeout_ms(SteadyClock::time_point now) const {
    auto next = SteadyClock::time_point::max();
    if (now < accept_paused_until) next = accept_paused_until;
    for (const auto& [fd, c] : conns) next = std::min({next, c.parked_until, c.auth_deadline});
    if (next == SteadyClock::time_point::max()) return -1;
    return ms_until(next) + 1;
  }

  void accept_all() {
    for (int accepted = 0; accepted < 256; ++accepted) {  // then the other connections get their turn
      int fd = ::accept4(listen_fd, nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
      if (fd < 0) {
        if (errno == EMFILE || errno == ENFILE || errno == ENOBUFS || errno == ENOMEM) {
          // The connection stays queued and the listening socket readable:
          // stop polling it for a while instead of spinning on it.
          accept_paused_until = SteadyClock::now() + std::chrono::milliseconds(100);
          emfile_log.warn(std::string("cannot accept connections: ") + std::strerror(errno) +
                          "; pausing accepts for 100 ms");
        }
        return;  // EAGAIN, or an error to try again on the next poll
      }
      if (!opt.token.empty() && pending_handshakes() >= kMaxPendingHandshakes) {
        over_cap_log.warn("closed a connection from " + peer_name(fd) + ": " +
                          std::to_string(kMaxPendingHandshakes) + " connections are in their handshake already");
        ::close(fd);
        continue;
      }
      if (conns.size() >= opt.max_connections) {
        over_cap_log.warn("closed a connection from " + peer_name(fd) + ": " + std::to_string(conns.size()) +
                          " connections open, the most it takes");
        ::close(fd);
        continue;
      }
      set_nodelay(fd);
      Conn& c = conns[fd];
      c.peer = peer_name(fd);
      if (!opt.token.empty()) {
        c.nonce = random_bytes(32);
        c.auth_deadline = SteadyClock::now() + opt.handshake_timeout;
      } else {
        c.authed = true;
      }
      answer(fd, c, kHello, {kProtocol, c.nonce});
    }
  }

  void read_from(int fd, Conn& c) {
    char buf[65536];
    for (size_t got = 0; got < kReadBudget;) {
      ssize_t n = ::recv(fd, buf, sizeof buf, 0);
      if (n > 0) {
        got += static_cast<size_t>(n);
        c.in.append(buf, static_cast<size_t>(n));
        const size_t pending = c.in.size() - c.in_off;
        if (!c.authed && pending > kMaxHandshake) {
          auth_log.warn("refused " + c.peer + ": " + std::to_string(pending) + " bytes before the handshake");
          c.closing = true;
          return;
        }
        if (pending > 2 * kMaxFrame) {  // requests behind a parked one, without end
          c.closing = true;
          return;
        }
        continue;
      }
      if (n < 0 && errno == EINTR) continue;
      if (n == 0 || (errno != EAGAIN && errno != EWOULDBLOCK)) c.closing = true;
      break;
    }
    serve(fd, c);
  }

  // Answers the complete requests in the buffer (one at a time: a parked
  // request holds back the ones behind it). Never recurses: writes that
  // wake parked requests queue them for drain().
  void serve(int fd, Conn& c) {
    for (int served = 0; !c.closing && !c.parked && c.in.size() - c.in_off >= 4; ++served) {
      if (served == kServeBudget) {
        busy.push_back(fd);
        break;
      }
      const char* p = c.in.data() + c.in_off;
      const size_t len = get_u32(p);
      if (len == 0 || len > kMaxFrame || (!c.authed && len > kMaxHandshake)) {
        auth_log.warn("closed the connection from " + c.peer + ": it sent a request of " + std::to_string(len) +
                      " bytes");
        c.closing = true;
        return;
      }
      if (c.in.size() - c.in_off < 4 + len) break;  // the rest is still in transit (or its sender is stopped)
      const Code op = static_cast<Code>(p[4]);
      std::vector<std::string> f;
      const bool ok = parse_fields(p + 5, len - 1, &f);
      c.in_off += 4 + len;
      if (!c.authed) {
        authenticate(fd, c, op, ok ? std::move(f) : std::vector<std::string>{});
        continue;
      }
      if (!ok) {
        answer(fd, c, kBad, {"malformed request"});
        continue;
      }
      handle(fd, c, op, std::move(f));
    }
    if (c.in_off == c.in.size()) {
      c.in.clear();
      c.in_off = 0;
    } else if (c.in_off > (size_t{1} << 16) && c.in_off > c.in.size() / 2) {
      c.in.erase(0, c.in_off);
      c.in_off = 0;
    }
  }

  void authenticate(int fd, Conn& c, Code op, std::vector<std::string> f) {
    if (op != kAuth || f.size() != 2 || f[0].size() != 32 ||
        !same_secret_bytes(f[1], client_proof(opt.token, c.nonce, f[0]))) {
      auth_log.warn("refused a connection from " + c.peer + ": " +
                    (op != kAuth || f.size() != 2 ? std::string("no handshake (garbage or an old client)")
                                                  : std::string("wrong job secret")));
      answer(fd, c, kDenied, {"this store needs the job's secret (--token-file / LIMBO_JOB_TOKEN)"});
      c.closing = true;
      return;
    }
    c.authed = true;
    c.auth_deadline = SteadyClock::time_point::max();
    answer(fd, c, kOk, {server_proof(opt.token, c.nonce, f[0])});
  }

  void wrote(const std::string& key) {
    auto it = waiters.find(key);
    if (it == waiters.end()) return;
    woken.insert(woken.end(), it->second.begin(), it->second.end());
    waiters.erase(it);
  }

  void handle(int fd, Conn& c, Code op, std::vector<std::string> f) {
    auto need = [&](size_t n) {
      if (f.size() == n) return true;
      answer(fd, c, kBad, {"wrong number of fields"});
      return false;
    };
    switch (op) {
      case kSet:
        if (!need(2)) return;
        kv[f[0]] = std::move(f[1]);
        answer(fd, c, kOk, {});
        return wrote(f[0]);
      case kTryGet: {
        if (!need(1)) return;
        auto it = kv.find(f[0]);
        if (it == kv.end()) return answer(fd, c, kMissing, {});
        return answer(fd, c, kOk, {it->second});
      }
      case kGet:
      case kWait:
      case kWaitFor: {
        auto until = SteadyClock::time_point::max();
        if (op == kWaitFor) {
          if (f.size() < 2) return answer(fd, c, kBad, {"wrong number of fields"});
          int64_t ms = 0;
          try {
            ms = std::stoll(f[0]);
          } catch (const std::exception&) {
            return answer(fd, c, kBad, {"bad wait timeout '" + f[0] + "'"});
          }
          until = SteadyClock::now() + std::chrono::milliseconds(std::clamp<int64_t>(ms, 0, 86400000));
          f.erase(f.begin());
        }
        if (f.empty() || (op == kGet && f.size() != 1)) return answer(fd, c, kBad, {"wrong number of fields"});
        c.parked = true;
        c.parked_op = op;
        c.parked_keys = std::move(f);
        c.parked_until = until;
        try_unpark(fd, c);
        return;
      }
      case kAdd: {
        if (!need(2)) return;
        int64_t delta = 0, v = 0;
        try {
          delta = std::stoll(f[1]);
          auto it = kv.find(f[0]);
          if (it != kv.end()) v = std::stoll(it->second);
        } catch (const std::exception&) {
          return answer(fd, c, kBad, {"key '" + f[0] + "' does not hold an integer"});
        }
        if (__builtin_add_overflow(v, delta, &v))
          return answer(fd, c, kBad, {"key '" + f[0] + "' would overflow"});
        kv[f[0]] = std::to_string(v);
        answer(fd, c, kOk, {std::to_string(v)});
        return wrote(f[0]);
      }
      case kCompareSet: {
        if (!need(3)) return;
        auto it = kv.find(f[0]);
        if (it == kv.end()) {
          if (!f[1].empty()) return answer(fd, c, kOk, {f[1]});
          kv[f[0]] = f[2];
          answer(fd, c, kOk, {f[2]});
          return wrote(f[0]);
        }
        if (it->second == f[1]) it->second = f[2];
        answer(fd, c, kOk, {it->second});
        return wrote(f[0]);
      }
      case kErase: {
        if (!need(1)) return;
        answer(fd, c, kOk, {kv.erase(f[0]) ? "1" : "0"});
        return;
      }
      case kCheck: {
        bool all = true;
        for (const auto& k : f) all = all && kv.count(k);
        return answer(fd, c, kOk, {all ? "1" : "0"});
      }
      case kNumKeys:
        return answer(fd, c, kOk, {std::to_string(kv.size())});
      default:
        return answer(fd, c, kBad, {"unknown op " + std::to_string(op)});
    }
  }

  // Answers a parked request whose keys all exist; otherwise indexes it
  // under the first missing key. Does not serve the requests behind it.
  void try_unpark(int fd, Conn& c) {
    for (const auto& k : c.parked_keys)
      if (!kv.count(k)) {
        c.waiting_on = k;
        waiters[k].insert(fd);
        return;
      }
    c.parked = false;
    c.parked_until = SteadyClock::time_point::max();
    if (c.parked_op == kGet) answer(fd, c, kOk, {kv[c.parked_keys[0]]});
    else answer(fd, c, kOk, {});
    c.parked_keys.clear();
  }

  void unindex(int fd, Conn& c) {
    if (c.waiting_on.empty()) return;
    auto it = waiters.find(c.waiting_on);
    if (it != waiters.end()) {
      it->second.erase(fd);
      if (it->second.empty()) waiters.erase(it);
    }
    c.waiting_on.clear();
  }

  // Parked waits past their deadline answer "missing"; connections that
  // did not pass the handshake in time are closed.
  void expire(SteadyClock::time_point now) {
    for (auto& [fd, c] : conns) {
      if (c.parked && now >= c.parked_until) {
        unindex(fd, c);
        c.parked = false;
        c.parked_until = SteadyClock::time_point::max();
        c.parked_keys.clear();
        answer(fd, c, kMissing, {});
        to_serve.push_back(fd);
      }
      if (!c.authed && now >= c.auth_deadline) {
        auth_log.warn("closed the connection from " + c.peer + ": no handshake within " +
                      std::to_string(opt.handshake_timeout.count()) + " ms");
        c.closing = true;
      }
    }
  }

  // Wakes parked requests whose keys were written and serves what queued
  // up behind them, until nothing changes (a loop, not recursion).
  void drain() {
    while (!woken.empty() || !to_serve.empty()) {
      std::vector<int> w;
      w.swap(woken);
      for (int fd : w) {
        auto it = conns.find(fd);
        if (it == conns.end() || !it->second.parked || it->second.closing) continue;
        it->second.waiting_on.clear();
        try_unpark(fd, it->second);
        if (!it->second.parked) to_serve.push_back(fd);
      }
      std::vector<int> s;
      s.swap(to_serve);
      for (int fd : s) {
        auto it = conns.find(fd);
        if (it != conns.end()) serve(fd, it->second);
      }
    }
  }

  void answer(int fd, Conn& c, uint8_t status, const std::vector<std::string>& fields) {
    c.out += frame(status, fields);
    if (c.out.size() - c.out_sent > kMaxOut) {
      log_warn("rendezvous store: closed a connection that does not read its answers");
      c.closing = true;
      return;
    }
    flush(fd, c);
  }

  void flush(int fd, Conn& c) {
    while (c.out_sent < c.out.size()) {
      ssize_t n = ::send(fd, c.out.data() + c.out_sent, c.out.size() - c.out_sent, MSG_NOSIGNAL);
      if (n > 0) {
        c.out_sent += static_cast<size_t>(n);
        continue;
      }
      if (n < 0 && errno == EINTR) continue;
      if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) break;
      c.closing = true;
      return;
    }
    if (c.out_sent == c.out.size()) {
      c.out.clear();
      c.out_sent = 0;
    } else if (c.out_sent > (size_t{1} << 20) && c.out_sent > c.out.size() / 2) {
      c.out.erase(0, c.out_sent);
      c.out_sent = 0;
    }
  }
};

StoreServer::StoreServer(const std::string& host, int port, StoreServerOptions opt)
    : impl_(std::make_unique<Impl>()) {
  impl_->opt = std::move(opt);
  if (impl_->opt.max_connections < 1) throw InvalidInput("rendezvous store: max_connections must be >= 1");
  addrinfo* res = resolve(host, port, true);
  if (!res) throw InvalidInput("cannot resolve the rendezvous address '" + host + "'");
  int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  int one = 1;
  ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
  const bool bound = fd >= 0 && ::bind(fd, res->ai_addr, res->ai_addrlen) == 0 && ::listen(fd, 512) == 0;
  const int err = errno;
  ::freeaddrinfo(res);
  if (!bound) {
    if (fd >= 0) ::close(fd);
    throw InvalidInput("cannot host the rendezvous store on " + host + ":" + std::to_string(port) + ": " +
                       std::strerror(err));
  }
  sockaddr_in a{};
  socklen_t alen = sizeof a;
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &alen);
  impl_->port = ntohs(a.sin_port);
  impl_->listen_fd = fd;
  if (::pipe2(impl_->wake, O_NONBLOCK | O_CLOEXEC) != 0) {
    ::close(fd);
    throw Error(std::string("rendezvous store: pipe: ") + std::strerror(errno));
  }
  impl_->thread = std::thread([i = impl_.get()] { i->run(); });
}

StoreServer::~StoreServer() {
  impl_->stop = true;
  char b = 1;
  (void)!::write(impl_->wake[1], &b, 1);
  impl_->thread.join();
  for (auto& [fd, c] : impl_->conns) ::close(fd);
  ::close(impl_->listen_fd);
  ::close(impl_->wake[0]);
  ::close(impl_->wake[1]);
}

int StoreServer::port() const { return impl_->port; }

// ---- client ------------------------------------------------------------------

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
