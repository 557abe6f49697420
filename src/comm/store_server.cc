#include "comm/store.h"


#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/epoll.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <algorithm>
#include <map>
#include <set>
#include <thread>
#include <tuple>

#include "comm/auth.h"
#include "common/error.h"
#include "common/log.h"
#include "common/process.h"
#include "common/throttled_log.h"

#include "comm/store_wire.h"

namespace limbo::comm {

using namespace store_wire;



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
// cannot fill the connection cap. At this count a new connection replaces
// the one longest in its handshake (a member passes it within
// milliseconds, a flood's silent sockets never do), so a flood cannot keep
// members out either by holding sockets open.
constexpr size_t kMaxPendingHandshakes = 256;
// The keys of the waits parked on one connection, and on the whole store,
// take at most this much memory (a wait's keys may be up to 64 MiB).
constexpr size_t kMaxParkedBytes = size_t{64} << 20;
constexpr size_t kMaxAllParkedBytes = size_t{512} << 20;
constexpr std::chrono::milliseconds kMinEvictAge{500};
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
  // A get / wait waiting for its keys (by its request id).
  struct Parked {
    Code op = 0;
    std::vector<std::string> keys;
    std::string waiting_on;  // the key it is indexed under in `waiters`
    size_t next = 0;         // keys[0, next) were there when last looked at
    size_t bytes = 0;        // of its keys
    SteadyClock::time_point until = SteadyClock::time_point::max();
  };
  struct Conn {
    std::string in;
    size_t in_off = 0;     // bytes of `in` already parsed (compacted now and then: linear time)
    std::string out;
    size_t out_sent = 0;   // bytes of `out` already sent
    std::map<uint32_t, Parked> parked;  // the requests behind them are served meanwhile
    size_t parked_bytes = 0;            // their keys'
    bool authed = false;
    std::string nonce;     // this connection's challenge
    SteadyClock::time_point auth_deadline = SteadyClock::time_point::max();
    std::string peer;
    bool closing = false;
    uint32_t events = 0;  // registered with epoll
  };

  StoreServerOptions opt;
  int listen_fd = -1;
  int ep = -1;  // epoll: the listening socket, the wake pipe, every connection
  bool accepting = true;
  int wake[2] = {-1, -1};
  int port = 0;
  std::atomic<bool> stop{false};
  std::map<std::string, std::string> kv;
  Revisions revisions;  // for changes_since
  std::map<int, Conn> conns;
  std::atomic<size_t> open_connections{0};  // conns.size(), for other threads
  // Parked requests (connection, request id) by a key they still wait
  // for; a write of that key wakes only them (not every parked request).
  std::map<std::string, std::set<std::pair<int, uint32_t>>> waiters;
  std::vector<std::pair<int, uint32_t>> woken;  // parked requests whose key was written
  std::vector<int> to_serve;   // connections with requests left to parse
  std::vector<int> busy;       // connections whose turn ended with requests left
  std::vector<int> touched;    // connections whose epoll events may have to change
  std::vector<int> closing_fds;
  // Parked waits' (connection, request id) and handshakes' (id 0)
  // deadlines, earliest first (an entry may outlive its reason: expire()
  // checks the connection).
  std::set<std::tuple<SteadyClock::time_point, int, uint32_t>> deadlines;
  // Connections in their handshake, oldest first (by deadline: accepted
  // time + the handshake timeout); a closing one is taken out at once.
  std::set<std::pair<SteadyClock::time_point, int>> handshaking;
  size_t parked_bytes = 0;  // every connection's
  SteadyClock::time_point accept_paused_until{};
  ThrottledLog over_cap_log{"rendezvous store: "}, emfile_log{"rendezvous store: "},
      auth_log{"rendezvous store: "};
  std::thread thread;

  // One turn: wait for events (epoll: a turn costs what is ready, not the
  // number of connections), serve them, expire deadlines, close, and
  // update the events of the connections this turn touched.
  void run() {
    name_this_thread("limbo-store");
    std::vector<epoll_event> evs(1024);
    while (!stop) {
      const auto now = SteadyClock::now();
      if (!accepting && now >= accept_paused_until) set_accepting(true);
      to_serve.swap(busy);  // their next turn
      busy.clear();
      const int n = ::epoll_wait(ep, evs.data(), static_cast<int>(evs.size()), to_serve.empty() ? timeout_ms(now) : 0);
      if (n < 0) {
        if (errno == EINTR) continue;
        log_warn(std::string("rendezvous store: epoll_wait failed: ") + std::strerror(errno));
        std::this_thread::sleep_for(std::chrono::milliseconds(10));
        continue;
      }
      if (stop) break;
      for (int i = 0; i < n; ++i) {
        const int fd = evs[i].data.fd;
        const uint32_t e = evs[i].events;
        if (fd == listen_fd) {
          accept_all();
          continue;
        }
        if (fd == wake[0]) continue;
        auto it = conns.find(fd);
        if (it == conns.end() || it->second.closing) continue;
        Conn& c = it->second;
        if (e & EPOLLIN) read_from(fd, c);
        else if (e & (EPOLLERR | EPOLLHUP | EPOLLRDHUP)) close_later(fd, c);
        if (!c.closing && (e & EPOLLOUT)) flush(fd, c);
        touched.push_back(fd);
      }
      expire(SteadyClock::now());
      drain();
      for (int fd : closing_fds) {
        auto it = conns.find(fd);
        if (it == conns.end()) continue;
        for (auto& [id, p] : it->second.parked) unindex(fd, id, p);
        parked_bytes -= it->second.parked_bytes;
        forget_deadlines(fd, it->second);
        ::epoll_ctl(ep, EPOLL_CTL_DEL, fd, nullptr);
        ::close(fd);
        conns.erase(it);
      }
      closing_fds.clear();
      open_connections = conns.size();
      for (int fd : touched) {
        auto it = conns.find(fd);
        if (it != conns.end()) sync_events(fd, it->second);
      }
      touched.clear();
    }
  }

  void close_later(int fd, Conn& c) {
    if (c.closing) return;
    if (!c.authed) handshaking.erase({c.auth_deadline, fd});
    c.closing = true;
    closing_fds.push_back(fd);
  }

  static uint32_t desired_events(const Conn& c) {
    return (wants_input(c) ? EPOLLIN : 0u) | EPOLLRDHUP | (c.out_sent < c.out.size() ? EPOLLOUT : 0u);
  }

  void sync_events(int fd, Conn& c) {
    const uint32_t want = desired_events(c);
    if (want == c.events) return;
    epoll_event ev{};
    ev.events = want;
    ev.data.fd = fd;
    if (::epoll_ctl(ep, EPOLL_CTL_MOD, fd, &ev) == 0) c.events = want;
  }

  void set_accepting(bool on) {
    epoll_event ev{};
    ev.events = on ? EPOLLIN : 0u;
    ev.data.fd = listen_fd;
    ::epoll_ctl(ep, EPOLL_CTL_MOD, listen_fd, &ev);
    accepting = on;
  }

  void forget_deadlines(int fd, const Conn& c) {
    for (const auto& [id, p] : c.parked) deadlines.erase({p.until, fd, id});
    deadlines.erase({c.auth_deadline, fd, 0});
  }

  // Reads only while the connection has no backlog of complete requests
  // (or needs the rest of a large one).
  static bool wants_input(const Conn& c) {
    const size_t pending = c.in.size() - c.in_off;
    if (pending < 4) return true;
    const size_t len = get_u32(c.in.data() + c.in_off);
    if (pending < 4 + static_cast<size_t>(std::min<size_t>(len, kMaxFrame))) return true;
    return pending < kBacklog;
  }

  size_t pending_handshakes() const { return handshaking.size(); }

  // Closes (at the end of this turn) the connection longest in its
  // handshake, if it has been in it for kMinEvictAge: a member passes the
  // handshake in milliseconds, so a burst of members starting together is
  // not evicted, only sockets that stay silent. False when none is that old.
  bool evict_oldest_handshake() {
    if (handshaking.empty()) return false;
    const auto [deadline, oldest_fd] = *handshaking.begin();
    Conn* oldest = &conns.at(oldest_fd);
    const auto accepted_at = deadline - opt.handshake_timeout;
    if (SteadyClock::now() - accepted_at < kMinEvictAge) return false;
    over_cap_log.warn("closed the connection from " + oldest->peer + " (the longest in its handshake): " +
                      std::to_string(kMaxPendingHandshakes) + " connections are in their handshake");
    close_later(oldest_fd, *oldest);
    return true;
  }

  int timeout_ms(SteadyClock::time_point now) const {
    auto next = SteadyClock::time_point::max();
    if (!accepting) next = accept_paused_until;
    if (!deadlines.empty()) next = std::min(next, std::get<0>(*deadlines.begin()));
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
          set_accepting(false);
          emfile_log.warn(std::string("cannot accept connections: ") + std::strerror(errno) +
                          "; pausing accepts for 100 ms");
        }
        return;  // EAGAIN, or an error to try again on the next poll
      }
      if (conns.size() >= opt.max_connections) {
        over_cap_log.warn("closed a connection from " + peer_name(fd) + ": " + std::to_string(conns.size()) +
                          " connections open, the most it takes");
        ::close(fd);
        continue;
      }
      if (!opt.token.empty() && pending_handshakes() >= kMaxPendingHandshakes && !evict_oldest_handshake()) {
        over_cap_log.warn("closed a connection from " + peer_name(fd) + ": " +
                          std::to_string(kMaxPendingHandshakes) + " connections are in their handshake already");
        ::close(fd);
        continue;
      }
      epoll_event ev{};
      ev.events = EPOLLIN | EPOLLRDHUP;
      ev.data.fd = fd;
      if (::epoll_ctl(ep, EPOLL_CTL_ADD, fd, &ev) != 0) {
        over_cap_log.warn("closed a connection from " + peer_name(fd) + ": epoll: " + std::strerror(errno));
        ::close(fd);
        continue;
      }
      set_nodelay(fd);
      Conn& c = conns[fd];
      c.events = ev.events;
      c.peer = peer_name(fd);
      if (!opt.token.empty()) {
        c.nonce = random_bytes(32);
        c.auth_deadline = SteadyClock::now() + opt.handshake_timeout;
        deadlines.insert({c.auth_deadline, fd, 0});
        handshaking.insert({c.auth_deadline, fd});
      } else {
        c.authed = true;
      }
      answer_raw(fd, c, kHello, {kProtocol, c.nonce});
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
          close_later(fd, c);
          return;
        }
        if (pending > 2 * kMaxFrame) {  // a backlog without end
          close_later(fd, c);
          return;
        }
        continue;
      }
      if (n < 0 && errno == EINTR) continue;
      if (n == 0 || (errno != EAGAIN && errno != EWOULDBLOCK)) close_later(fd, c);
      break;
    }
    serve(fd, c);
  }

  // Answers the complete requests in the buffer, in order; a parked
  // request waits aside (by its id) and the ones behind it are served.
  // Never recurses: writes that wake parked requests queue them for drain().
  void serve(int fd, Conn& c) {
    touched.push_back(fd);
    for (int served = 0; !c.closing && c.in.size() - c.in_off >= 4; ++served) {
      if (served == kServeBudget) {
        busy.push_back(fd);
        break;
      }
      const char* p = c.in.data() + c.in_off;
      const size_t len = get_u32(p);
      if (len == 0 || len > kMaxFrame || (!c.authed && len > kMaxHandshake)) {
        auth_log.warn("closed the connection from " + c.peer + ": it sent a request of " + std::to_string(len) +
                      " bytes");
        close_later(fd, c);
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
      if (!ok || f.empty() || f[0].size() != 4) {
        answer(fd, c, 0, kBad, {"malformed request (" + std::string(kProtocol) + " requests start with an id)"});
        continue;
      }
      const uint32_t id = get_u32(f[0].data());
      f.erase(f.begin());
      handle(fd, c, id, op, std::move(f));
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
      answer_raw(fd, c, kDenied, {"this store needs the job's secret (--token-file / LIMBO_JOB_TOKEN)"});
      close_later(fd, c);
      return;
    }
    c.authed = true;
    handshaking.erase({c.auth_deadline, fd});
    deadlines.erase({c.auth_deadline, fd, 0});
    c.auth_deadline = SteadyClock::time_point::max();
    answer_raw(fd, c, kOk, {server_proof(opt.token, c.nonce, f[0])});
  }

  void wrote(const std::string& key) {
    revisions.bump(key);
    auto it = waiters.find(key);
    if (it == waiters.end()) return;
    woken.insert(woken.end(), it->second.begin(), it->second.end());
    waiters.erase(it);
  }

  void handle(int fd, Conn& c, uint32_t id, Code op, std::vector<std::string> f) {
    auto answer = [&](int, Conn&, uint8_t status, const std::vector<std::string>& fields) {
      this->answer(fd, c, id, status, fields);
    };
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
        if (c.parked.count(id)) return answer(fd, c, kBad, {"request id " + std::to_string(id) + " is waiting already"});
        if (c.parked.size() >= kMaxParked)
          return answer(fd, c, kBad, {std::to_string(kMaxParked) + " waits are parked on this connection already"});
        size_t bytes = 0;
        for (const auto& k : f) bytes += k.size() + 32;  // (and the container's share)
        if (c.parked_bytes + bytes > kMaxParkedBytes || parked_bytes + bytes > kMaxAllParkedBytes)
          return answer(fd, c, kBad, {"the waits parked on " + std::string(c.parked_bytes + bytes > kMaxParkedBytes
                                                                                  ? "this connection"
                                                                                  : "the store") +
                                          " would hold over " +
                                          std::to_string((c.parked_bytes + bytes > kMaxParkedBytes
                                                              ? kMaxParkedBytes
                                                              : kMaxAllParkedBytes) >> 20) +
                                          " MiB of keys"});
        Parked& p = c.parked[id];
        p.op = op;
        p.keys = std::move(f);
        p.bytes = bytes;
        c.parked_bytes += bytes;
        parked_bytes += bytes;
        p.until = until;
        if (until != SteadyClock::time_point::max()) deadlines.insert({until, fd, id});
        try_unpark(fd, c, id);
        return;
      }
      case kCancel: {  // a parked request the client no longer waits for: dropped unanswered
        if (!need(1) || f[0].size() != 4) return;
        const uint32_t target = get_u32(f[0].data());
        auto it = c.parked.find(target);
        if (it != c.parked.end()) {
          deadlines.erase({it->second.until, fd, target});
          drop_parked(fd, c, it);
        }
        return answer(fd, c, kOk, {});
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
        if (it->second != f[1]) return answer(fd, c, kOk, {it->second});  // nothing written
        it->second = f[2];
        answer(fd, c, kOk, {it->second});
        return wrote(f[0]);
      }
      case kErase: {
        if (!need(1)) return;
        const bool erased = kv.erase(f[0]) > 0;
        if (erased) revisions.bump(f[0]);
        answer(fd, c, kOk, {erased ? "1" : "0"});
        return;
      }
      case kCheck: {
        bool all = true;
        for (const auto& k : f) all = all && kv.count(k);
        return answer(fd, c, kOk, {all ? "1" : "0"});
      }
      case kNumKeys:
        return answer(fd, c, kOk, {std::to_string(kv.size())});
      case kList: {  // every key under a prefix, with its value, as fields in one answer
        if (!need(1)) return;
        std::string out;
        for (auto it = kv.lower_bound(f[0]); it != kv.end() && it->first.compare(0, f[0].size(), f[0]) == 0; ++it) {
          if (out.size() + it->first.size() + it->second.size() > kMaxFrame / 2)
            return answer(fd, c, kBad, {"the keys under '" + f[0] + "' exceed one answer"});
          put_u32(out, static_cast<uint32_t>(it->first.size()));
          out += it->first;
          put_u32(out, static_cast<uint32_t>(it->second.size()));
          out += it->second;
        }
        return answer(fd, c, kOk, {out});
      }
      case kChanges: {  // since, prefixes...
        if (f.empty()) return answer(fd, c, kBad, {"wrong number of fields"});
        int64_t since = 0;
        try {
          since = std::stoll(f[0]);
        } catch (const std::exception&) {
          return answer(fd, c, kBad, {"bad revision '" + f[0] + "'"});
        }
        const auto ch = revisions.since(
            std::vector<std::string>(f.begin() + 1, f.end()), since,
            [&](const std::string& k) { return kv.count(k) > 0; }, [&](const std::string& k) { return kv.at(k); });
        std::vector<std::string> head = {std::to_string(ch.revision), ch.full ? "1" : "0",
                                         std::to_string(ch.written.size())};
        std::string out;
        auto put = [&](const std::string& x) {
          put_u32(out, static_cast<uint32_t>(x.size()));
          out += x;
        };
        for (const auto& h : head) put(h);
        for (const auto& [k, v] : ch.written) {
          put(k);
          put(v);
        }
        for (const auto& k : ch.erased) put(k);
        if (out.size() > kMaxFrame / 2) return answer(fd, c, kBad, {"the changes exceed one answer"});
        return answer(fd, c, kOk, {out});
      }
      default:
        return answer(fd, c, kBad, {"unknown op " + std::to_string(op)});
    }
  }

  // Answers parked request `id` when its keys all exist; otherwise indexes
  // it under the first missing key. Each wake goes on from the key that was
  // missing (a wait for K keys written one by one costs O(K), not O(K^2));
  // once past the last, the earlier ones are looked at again (one may have
  // been erased since).
  void try_unpark(int fd, Conn& c, uint32_t id) {
    auto it = c.parked.find(id);
    if (it == c.parked.end()) return;
    Parked& p = it->second;
    auto missing = [&](size_t from) {
      for (size_t i = from; i < p.keys.size(); ++i)
        if (!kv.count(p.keys[i])) return i;
      return p.keys.size();
    };
    p.next = missing(p.next);
    if (p.next == p.keys.size()) p.next = missing(0);
    if (p.next < p.keys.size()) {
      p.waiting_on = p.keys[p.next];
      waiters[p.waiting_on].insert({fd, id});
      return;
    }
    deadlines.erase({p.until, fd, id});
    const bool get = p.op == kGet;
    const std::string key = get ? p.keys[0] : std::string();
    drop_parked(fd, c, it);
    if (get) answer(fd, c, id, kOk, {kv[key]});
    else answer(fd, c, id, kOk, {});
  }

  // Parked request `it` of connection `fd` goes (its deadline entry, if
  // any, is the caller's).
  void drop_parked(int fd, Conn& c, std::map<uint32_t, Parked>::iterator it) {
    unindex(fd, it->first, it->second);
    c.parked_bytes -= it->second.bytes;
    parked_bytes -= it->second.bytes;
    c.parked.erase(it);
  }

  void unindex(int fd, uint32_t id, Parked& p) {
    if (p.waiting_on.empty()) return;
    auto it = waiters.find(p.waiting_on);
    if (it != waiters.end()) {
      it->second.erase({fd, id});
      if (it->second.empty()) waiters.erase(it);
    }
    p.waiting_on.clear();
  }

  // Parked waits past their deadline answer "missing"; connections that
  // did not pass the handshake in time are closed.
  void expire(SteadyClock::time_point now) {
    while (!deadlines.empty() && std::get<0>(*deadlines.begin()) <= now) {
      const auto [when, fd, id] = *deadlines.begin();
      deadlines.erase(deadlines.begin());
      auto it = conns.find(fd);
      if (it == conns.end() || it->second.closing) continue;
      Conn& c = it->second;
      auto pit = c.parked.find(id);
      if (pit != c.parked.end() && now >= pit->second.until) {
        drop_parked(fd, c, pit);
        answer(fd, c, id, kMissing, {});
      }
      if (!c.authed && now >= c.auth_deadline) {
        auth_log.warn("closed the connection from " + c.peer + ": no handshake within " +
                      std::to_string(opt.handshake_timeout.count()) + " ms");
        close_later(fd, c);
      }
    }
  }

  // Wakes parked requests whose keys were written and serves what queued
  // up behind them, until nothing changes (a loop, not recursion).
  void drain() {
    while (!woken.empty() || !to_serve.empty()) {
      std::vector<std::pair<int, uint32_t>> w;
      w.swap(woken);
      for (const auto& [fd, id] : w) {
        auto it = conns.find(fd);
        if (it == conns.end() || it->second.closing) continue;
        auto pit = it->second.parked.find(id);
        if (pit == it->second.parked.end()) continue;
        pit->second.waiting_on.clear();
        try_unpark(fd, it->second, id);
      }
      std::vector<int> s;
      s.swap(to_serve);
      for (int fd : s) {
        auto it = conns.find(fd);
        if (it != conns.end()) serve(fd, it->second);
      }
    }
  }

  // An answer to request `id` (its id first, as the request had it).
  void answer(int fd, Conn& c, uint32_t id, uint8_t status, const std::vector<std::string>& fields) {
    std::vector<std::string> with_id;
    with_id.reserve(fields.size() + 1);
    with_id.push_back(id_field(id));
    with_id.insert(with_id.end(), fields.begin(), fields.end());
    answer_raw(fd, c, status, with_id);
  }

  // A frame as it is (the handshake's have no id).
  void answer_raw(int fd, Conn& c, uint8_t status, const std::vector<std::string>& fields) {
    c.out += frame(status, fields);
    touched.push_back(fd);
    if (c.out.size() - c.out_sent > kMaxOut) {
      log_warn("rendezvous store: closed a connection that does not read its answers");
      close_later(fd, c);
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
      close_later(fd, c);
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
  if (impl_->opt.max_connections == 0) impl_->opt.max_connections = connections_allowed();
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
  impl_->ep = ::epoll_create1(EPOLL_CLOEXEC);
  if (impl_->ep < 0) {
    const int e = errno;
    ::close(fd);
    ::close(impl_->wake[0]);
    ::close(impl_->wake[1]);
    throw Error(std::string("rendezvous store: epoll: ") + std::strerror(e));
  }
  for (int watched : {fd, impl_->wake[0]}) {
    epoll_event ev{};
    ev.events = EPOLLIN;
    ev.data.fd = watched;
    ::epoll_ctl(impl_->ep, EPOLL_CTL_ADD, watched, &ev);
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
  ::close(impl_->ep);
  ::close(impl_->wake[0]);
  ::close(impl_->wake[1]);
}

int StoreServer::port() const { return impl_->port; }

size_t StoreServer::max_connections() const { return impl_->opt.max_connections; }

size_t StoreServer::connections() const { return impl_->open_connections; }

size_t connections_allowed() {
  rlimit r{};
  if (::getrlimit(RLIMIT_NOFILE, &r) != 0) return 4096;
  if (r.rlim_cur < r.rlim_max) {  // the soft limit up to the hard one
    rlimit raised = r;
    raised.rlim_cur = r.rlim_max;
    if (::setrlimit(RLIMIT_NOFILE, &raised) == 0) r = raised;
  }
  // Room for the process's other descriptors (its workers' pipes, the
  // status page, logs, Gloo): 256, or an eighth of a small limit.
  const rlim_t n = r.rlim_cur == RLIM_INFINITY ? rlim_t{1} << 20 : r.rlim_cur;
  const rlim_t reserve = std::min<rlim_t>(256, n / 8);
  return static_cast<size_t>(std::max<rlim_t>(1, n - reserve));
}

}  // namespace limbo::comm
