// The rendezvous store's wire format, shared by its server (store_server.cc)
// and client (store_client.cc); see comm/store.h. Internal to comm/.
#pragma once

#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

namespace limbo::comm::store_wire {

// Request op codes, shared by the server and the client.
using Code = uint8_t;
constexpr Code kSet = 1, kGet = 2, kTryGet = 3, kAdd = 4, kCompareSet = 5, kErase = 6, kCheck = 7,
             kNumKeys = 8, kWait = 9, kWaitFor = 10, kAuth = 11, kList = 12, kChanges = 13, kCancel = 14;
// Answer status codes; kHello opens every connection (comm/auth.h).
constexpr uint8_t kOk = 0, kMissing = 1, kBad = 2, kDenied = 3, kHello = 4;
// 3: requests carry an id (their first field) and answers echo it, so one
// connection carries many callers' requests, parked waits among them.
constexpr const char* kProtocol = "limbo-store/3";
// Waits one connection may have parked at once.
constexpr size_t kMaxParked = 4096;

// A request id as its field (4 bytes, little-endian), and back.
inline std::string id_field(uint32_t id) {
  std::string s;
  for (int i = 0; i < 4; ++i) s.push_back(static_cast<char>((id >> (8 * i)) & 0xff));
  return s;
}
constexpr size_t kMaxFrame = size_t{64} << 20;
constexpr size_t kMaxOut = size_t{64} << 20;

inline void put_u32(std::string& s, uint32_t v) {
  for (int i = 0; i < 4; ++i) s.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
}
inline uint32_t get_u32(const char* p) {
  uint32_t v = 0;
  for (int i = 0; i < 4; ++i) v |= static_cast<uint32_t>(static_cast<uint8_t>(p[i])) << (8 * i);
  return v;
}

inline std::string frame(uint8_t head, const std::vector<std::string>& fields) {
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
inline bool parse_fields(const char* p, size_t n, std::vector<std::string>* out) {
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

inline void set_nodelay(int fd) {
  int one = 1;
  ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
}

inline addrinfo* resolve(const std::string& host, int port, bool passive) {
  addrinfo hints{};
  hints.ai_family = AF_INET;
  hints.ai_socktype = SOCK_STREAM;
  if (passive) hints.ai_flags = AI_PASSIVE;
  addrinfo* res = nullptr;
  if (::getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &res) != 0 || !res) return nullptr;
  return res;
}

inline int ms_until(std::chrono::steady_clock::time_point deadline) {
  auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
  return static_cast<int>(std::max<int64_t>(0, std::min<int64_t>(left.count(), 1 << 30)));
}


}  // namespace limbo::comm::store_wire
