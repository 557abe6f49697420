// The coordinator's end of the heartbeats: BeatListener (elastic/beats.h).
#include "elastic/beats.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <charconv>
#include <cstring>
#include <string_view>
#include <thread>

#include "comm/auth.h"
#include "common/process.h"
#include "elastic/beat_wire.h"
#include "common/error.h"
#include "common/log.h"

namespace limbo::elastic {

using namespace wire;

// ---------- BeatListener ----------

namespace {

// The next word of `s` from `*at` (words are separated by spaces and
// newlines); empty at the end.
std::string_view next_word(std::string_view s, size_t* at) {
  size_t i = *at;
  while (i < s.size() && (s[i] == ' ' || s[i] == '\n')) ++i;
  size_t j = i;
  while (j < s.size() && s[j] != ' ' && s[j] != '\n') ++j;
  *at = j;
  return s.substr(i, j - i);
}

bool parse_int(std::string_view w, int64_t* out) {
  if (w.empty()) return false;
  const auto [end, ec] = std::from_chars(w.data(), w.data() + w.size(), *out);
  return ec == std::errc() && end == w.data() + w.size();
}

// The header "LB1 <listener nonce> <sender nonce> <seq>" of `s`: false
// when it is not one for the listener `nonce`. `*at`: where the header ends.
bool parse_head(std::string_view s, const std::string& nonce, std::string_view* sender, int64_t* seq, size_t* at) {
  *at = 0;
  if (next_word(s, at) != "LB1" || next_word(s, at) != nonce) return false;
  *sender = next_word(s, at);
  return !sender->empty() && parse_int(next_word(s, at), seq);
}

constexpr int kBatch = 32;  // datagrams a system call takes or answers

}  // namespace

struct BeatListener::Lane {
  int fd = -1;
  // Each sender's last datagram number and when it came, by nonce; the
  // order of their last datagrams, the oldest first, so that pruning senders
  // gone for forget_after_ looks only at the oldest (O(1) a datagram, not a
  // scan of the map).
  struct Sender {
    int64_t seq = 0;
    std::chrono::steady_clock::time_point at{};
    std::list<std::string>::iterator pos;
  };
  std::unordered_map<std::string, Sender> senders;
  std::list<std::string> order;
  std::atomic<size_t> held{0};
  std::vector<BeatTable::Beat> beats;  // one datagram's (kept for its capacity)
  std::thread thread;
};

BeatListener::BeatListener(const std::string& bind_host, const std::string& advertise_host, std::string token,
                           int lanes)
    : token_(std::move(token)), nonce_(to_hex(comm::random_bytes(8))) {
  if (lanes <= 0) lanes = static_cast<int>(std::clamp(std::thread::hardware_concurrency(), 1u, 4u));
  sockaddr_in a{};
  if (!resolve_udp(bind_host, 0, &a)) throw InvalidInput("cannot resolve '" + bind_host + "' for the heartbeat listener");
  auto close_all = [&] {
    for (auto& l : lanes_)
      if (l->fd >= 0) ::close(l->fd);
  };
  for (int i = 0; i < lanes; ++i) {
    auto lane = std::make_unique<Lane>();
    lane->fd = ::socket(AF_INET, SOCK_DGRAM | SOCK_CLOEXEC, 0);
    const int one = 1;
    // Room for a burst of every host's datagram at once.
    const int buf = 8 << 20;
    if (lane->fd >= 0) {
      ::setsockopt(lane->fd, SOL_SOCKET, SO_REUSEPORT, &one, sizeof one);
      ::setsockopt(lane->fd, SOL_SOCKET, SO_RCVBUF, &buf, sizeof buf);
    }
    // The first lane takes any port; the others join it on that port.
    if (lane->fd < 0 || ::bind(lane->fd, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0) {
      const std::string why = std::strerror(errno);
      if (lane->fd >= 0) ::close(lane->fd);
      close_all();
      throw Error("cannot bind the heartbeat listener on " + bind_host + ": " + why);
    }
    if (i == 0) {
      socklen_t len = sizeof a;
      ::getsockname(lane->fd, reinterpret_cast<sockaddr*>(&a), &len);
    }
    lanes_.push_back(std::move(lane));
  }
  address_ = advertise_host + ":" + std::to_string(ntohs(a.sin_port)) + " " + nonce_;
  for (auto& l : lanes_) {
    Lane* lane = l.get();
    lane->thread = std::thread([this, lane] { loop(*lane); });
  }
}

BeatListener::~BeatListener() {
  stop_ = true;
  for (auto& l : lanes_)
    if (l->thread.joinable()) l->thread.join();
  for (auto& l : lanes_) ::close(l->fd);
}

size_t BeatListener::senders() const {
  size_t n = 0;
  for (const auto& l : lanes_) n += l->held.load();
  return n;
}

std::vector<size_t> BeatListener::senders_by_lane() const {
  std::vector<size_t> out;
  for (const auto& l : lanes_) out.push_back(l->held.load());
  return out;
}

void BeatListener::loop(Lane& lane) {
  name_this_thread("limbo-beat-in");
  // What every datagram for this listener starts with. Anything else (a
  // flood from a sender without the address's nonce), or anything longer
  // than a beat datagram can be, is refused from its first bytes, with no
  // MAC computed.
  const std::string head = "LB1 " + nonce_ + " ";
  std::vector<char> bufs(static_cast<size_t>(kBatch) * (kMaxBeatDatagram + 1));
  std::array<iovec, kBatch> iov{};
  std::array<sockaddr_in, kBatch> from{};
  std::array<mmsghdr, kBatch> in{};
  std::array<std::string, kBatch> acks;
  std::array<iovec, kBatch> ack_iov{};
  std::array<mmsghdr, kBatch> out{};
  while (!stop_) {
    pollfd p{lane.fd, POLLIN, 0};
    if (::poll(&p, 1, 50) <= 0) continue;
    for (int round = 0; round < 128 && !stop_; ++round) {  // a flood never holds up a stop
      for (int i = 0; i < kBatch; ++i) {
        iov[i] = {bufs.data() + static_cast<size_t>(i) * (kMaxBeatDatagram + 1), kMaxBeatDatagram + 1};
        in[i] = {};
        in[i].msg_hdr.msg_iov = &iov[i];
        in[i].msg_hdr.msg_iovlen = 1;
        in[i].msg_hdr.msg_name = &from[i];
        in[i].msg_hdr.msg_namelen = sizeof from[i];
      }
      const int got = ::recvmmsg(lane.fd, in.data(), kBatch, MSG_DONTWAIT, nullptr);
      if (got <= 0) break;
      int answers = 0;
      for (int i = 0; i < got; ++i) {
        const char* data = static_cast<const char*>(iov[i].iov_base);
        const size_t len = in[i].msg_len;
        if ((in[i].msg_hdr.msg_flags & MSG_TRUNC) || len > kMaxBeatDatagram || len < head.size() ||
            std::memcmp(data, head.data(), head.size()) != 0) {
          ++refused_;
          continue;
        }
        std::string ack = take(lane, data, len);
        if (ack.empty()) continue;
        acks[answers] = std::move(ack);
        ack_iov[answers] = {acks[answers].data(), acks[answers].size()};
        out[answers] = {};
        out[answers].msg_hdr.msg_iov = &ack_iov[answers];
        out[answers].msg_hdr.msg_iovlen = 1;
        out[answers].msg_hdr.msg_name = &from[i];
        out[answers].msg_hdr.msg_namelen = in[i].msg_hdr.msg_namelen;
        ++answers;
      }
      // (Best effort, as a datagram is: an acknowledgement the socket has
      // no room for is one the sender misses.)
      for (int sent = 0; sent < answers;) {
        const int n = ::sendmmsg(lane.fd, out.data() + sent, answers - sent, MSG_DONTWAIT);
        if (n <= 0) break;
        sent += n;
      }
      if (got < kBatch) break;
    }
  }
}

// "LB1 <listener nonce> <sender nonce> <seq>" then "<id> <counter> <age µs>"
// lines, sealed; answered with "LA2 <listener nonce> <sender nonce> <seq>",
// sealed.
std::string BeatListener::take(Lane& lane, const char* data, size_t len) {
  const auto now = std::chrono::steady_clock::now();
  // The header's cheap checks first (this listener, a number newer than
  // the sender's last), then the MAC over the whole datagram.
  std::string_view sender;
  int64_t seq = 0;
  size_t at = 0;
  if (!parse_head(std::string_view(data, std::min<size_t>(len, 96)), nonce_, &sender, &seq, &at)) {
    ++refused_;
    return {};
  }
  if (auto known = lane.senders.find(std::string(sender)); known != lane.senders.end() && seq <= known->second.seq) {
    ++refused_;
    return {};
  }
  std::string body;
  if (!unseal(token_, std::string(data, len), &body) || !parse_head(body, nonce_, &sender, &seq, &at)) {
    ++refused_;
    return {};
  }
  const std::string name(sender);
  auto [known, fresh] = lane.senders.try_emplace(name);
  Lane::Sender& last = known->second;
  if (!fresh && seq <= last.seq) {
    ++refused_;
    return {};
  }
  last.seq = seq;
  last.at = now;
  if (fresh) last.pos = lane.order.insert(lane.order.end(), name);
  else lane.order.splice(lane.order.end(), lane.order, last.pos);
  lane.beats.clear();
  for (;;) {
    int64_t id = 0, counter = 0, age_us = 0;
    if (!parse_int(next_word(body, &at), &id) || !parse_int(next_word(body, &at), &counter) ||
        !parse_int(next_word(body, &at), &age_us))
      break;
    lane.beats.push_back({id, counter, now - std::chrono::microseconds(std::max<int64_t>(0, age_us))});
  }
  table_->note_all(lane.beats);
  // Beyond forget_cap_ senders, those gone for forget_after_ (workers
  // restarted under new nonces) are forgotten, the oldest first: a look at
  // the front of the order, not a scan, so a datagram costs the same at
  // 10,000 members as at 10.
  const auto forget = forget_after_.load();
  while (lane.senders.size() > forget_cap_.load() && lane.order.front() != name) {
    auto old = lane.senders.find(lane.order.front());
    if (now - old->second.at <= forget) break;
    lane.senders.erase(old);
    lane.order.pop_front();
  }
  lane.held = lane.senders.size();
  return seal(token_, "LA2 " + nonce_ + " " + name + " " + std::to_string(seq));
}

}  // namespace limbo::elastic
