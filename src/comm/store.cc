#include "comm/store.h"

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
#include <map>
#include <thread>

#include "common/error.h"
#include "common/log.h"

namespace limbo::comm {

namespace {

// Request op codes, shared by the server and the client.
using Code = uint8_t;
constexpr Code kSet = 1, kGet = 2, kTryGet = 3, kAdd = 4, kCompareSet = 5, kErase = 6, kCheck = 7,
             kNumKeys = 8, kWait = 9;
constexpr uint8_t kOk = 0, kMissing = 1, kBad = 2;
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

struct StoreServer::Impl {
  struct Conn {
    std::string in, out;
    size_t out_sent = 0;  // bytes of `out` already sent
    bool parked = false;   // a get or wait waiting for its keys
    Code parked_op = 0;
    std::vector<std::string> parked_keys;
    bool closing = false;
  };

  int listen_fd = -1;
  int wake[2] = {-1, -1};
  int port = 0;
  std::atomic<bool> stop{false};
  std::map<std::string, std::string> kv;
  std::map<int, Conn> conns;
  std::thread thread;

  void run() {
    std::vector<pollfd> fds;
    while (!stop) {
      fds.clear();
      fds.push_back({listen_fd, POLLIN, 0});
      fds.push_back({wake[0], POLLIN, 0});
      for (auto& [fd, c] : conns)
        fds.push_back({fd, static_cast<short>(POLLIN | (c.out_sent < c.out.size() ? POLLOUT : 0)), 0});
      if (::poll(fds.data(), fds.size(), -1) < 0) {
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
        else if (fds[i].revents & (POLLERR | POLLHUP | POLLNVAL)) c.closing = true;
        if (!c.closing && (fds[i].revents & POLLOUT)) flush(fds[i].fd, c);
      }
      for (auto it = conns.begin(); it != conns.end();) {
        if (it->second.closing) {
          ::close(it->first);
          it = conns.erase(it);
        } else {
          ++it;
        }
      }
    }
  }

  void accept_all() {
    for (;;) {
      int fd = ::accept4(listen_fd, nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
      if (fd < 0) return;  // EAGAIN, or an error to try again on the next poll
      set_nodelay(fd);
      conns[fd] = Conn{};
    }
  }

  void read_from(int fd, Conn& c) {
    char buf[65536];
    for (;;) {
      ssize_t n = ::recv(fd, buf, sizeof buf, 0);
      if (n > 0) {
        c.in.append(buf, static_cast<size_t>(n));
        if (c.in.size() > 2 * kMaxFrame) {  // requests behind a parked one, without end
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
  // request holds back the ones behind it).
  void serve(int fd, Conn& c) {
    while (!c.closing && !c.parked && c.in.size() >= 4) {
      const size_t len = get_u32(c.in.data());
      if (len == 0 || len > kMaxFrame) {
        log_warn("rendezvous store: closed a connection that sent a request of " + std::to_string(len) + " bytes");
        c.closing = true;
        return;
      }
      if (c.in.size() < 4 + len) return;  // the rest is still in transit (or its sender is stopped)
      const Code op = static_cast<Code>(c.in[4]);
      std::vector<std::string> f;
      const bool ok = parse_fields(c.in.data() + 5, len - 1, &f);
      c.in.erase(0, 4 + len);
      if (!ok) {
        answer(fd, c, kBad, {"malformed request"});
        continue;
      }
      handle(fd, c, op, std::move(f));
    }
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
        return changed();
      case kTryGet: {
        if (!need(1)) return;
        auto it = kv.find(f[0]);
        if (it == kv.end()) return answer(fd, c, kMissing, {});
        return answer(fd, c, kOk, {it->second});
      }
      case kGet:
      case kWait:
        if (f.empty() || (op == kGet && f.size() != 1)) return answer(fd, c, kBad, {"wrong number of fields"});
        c.parked = true;
        c.parked_op = op;
        c.parked_keys = std::move(f);
        return try_unpark(fd, c);
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
        v += delta;
        kv[f[0]] = std::to_string(v);
        answer(fd, c, kOk, {std::to_string(v)});
        return changed();
      }
      case kCompareSet: {
        if (!need(3)) return;
        auto it = kv.find(f[0]);
        if (it == kv.end()) {
          if (!f[1].empty()) return answer(fd, c, kOk, {f[1]});
          kv[f[0]] = f[2];
          answer(fd, c, kOk, {f[2]});
          return changed();
        }
        if (it->second == f[1]) it->second = f[2];
        answer(fd, c, kOk, {it->second});
        return changed();
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

  void try_unpark(int fd, Conn& c) {
    for (const auto& k : c.parked_keys)
      if (!kv.count(k)) return;
    c.parked = false;
    if (c.parked_op == kGet) answer(fd, c, kOk, {kv[c.parked_keys[0]]});
    else answer(fd, c, kOk, {});
    c.parked_keys.clear();
    serve(fd, c);
  }

  // A key was written: answer the parked requests that can go now.
  void changed() {
    for (auto& [fd, c] : conns)
      if (c.parked && !c.closing) try_unpark(fd, c);
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

StoreServer::StoreServer(const std::string& host, int port) : impl_(std::make_unique<Impl>()) {
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

StoreClient::StoreClient(const std::string& host, int port, std::chrono::milliseconds timeout)
    : host_(host), port_(port), address_(host + ":" + std::to_string(port)), timeout_(timeout) {
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
      fd_ = fd;
      return;
    }
    why = std::strerror(errno);
    ::close(fd);
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  } while (std::chrono::steady_clock::now() < deadline);
  throw PeerFailure("cannot reach the rendezvous store at " + address_ + " (" + why + ")");
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
  std::string in;
  size_t want = 4;
  char buf[65536];
  while (in.size() < want) {
    pollfd p{fd_, POLLIN, 0};
    int pr = ::poll(&p, 1, ms_until(deadline));
    if (pr == 0) fail(true, "waiting for the answer");
    if (pr < 0 && errno == EINTR) continue;
    ssize_t n = ::recv(fd_, buf, sizeof buf, 0);
    if (n == 0) fail(false, "the store closed the connection");
    if (n < 0) {
      if (errno == EINTR || errno == EAGAIN || errno == EWOULDBLOCK) continue;
      fail(false, std::string("recv failed: ") + std::strerror(errno));
    }
    in.append(buf, static_cast<size_t>(n));
    if (want == 4 && in.size() >= 4) {
      const size_t len = get_u32(in.data());
      if (len == 0 || len > kMaxFrame) fail(false, "an answer of " + std::to_string(len) + " bytes");
      want = 4 + len;
    }
  }
  if (in.size() != want) fail(false, "more bytes than one answer");
  std::vector<std::string> f;
  if (!parse_fields(in.data() + 5, want - 5, &f) || f.size() > 1) fail(false, "a malformed answer");
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

}  // namespace limbo::comm
