// What the heartbeat relay and listener (elastic/beats.h) share on the
// wire: the datagram's size bound, sealing under the job secret, and
// address resolution. Internal to beats.cc and beat_listener.cc.
#pragma once

#include <netdb.h>
#include <netinet/in.h>
#include <sys/socket.h>

#include <cstring>
#include <string>

#include "comm/auth.h"
#include "elastic/beats.h"

namespace limbo::elastic::wire {

// A datagram carries at most kEntriesPerDatagram beats of at most 64
// bytes each (three int64 numbers), a header and a MAC: anything longer is
// refused from a peek at its length, so a flood that carries the
// listener's nonce costs a MAC over at most this much.
inline constexpr int kEntriesPerDatagram = kBeatsPerDatagram;
inline constexpr size_t kMaxBeatDatagram = kEntriesPerDatagram * 64 + 512;

inline std::string to_hex(const std::string& bytes) {
  static const char* d = "0123456789abcdef";
  std::string out;
  for (unsigned char c : bytes) out += {d[c >> 4], d[c & 15]};
  return out;
}

// "<body>\nmac <hex>" (the MAC "-" without a secret).
inline std::string seal(const std::string& token, const std::string& body) {
  return body + "\nmac " + (token.empty() ? std::string("-") : to_hex(comm::hmac_sha256(token, body)));
}

// The body of a sealed message whose MAC holds under `token`; false when not.
inline bool unseal(const std::string& token, const std::string& msg, std::string* body) {
  const auto at = msg.rfind("\nmac ");
  if (at == std::string::npos) return false;
  *body = msg.substr(0, at);
  const std::string mac = msg.substr(at + 5);
  if (token.empty()) return mac == "-";
  return comm::same_secret_bytes(mac, to_hex(comm::hmac_sha256(token, *body)));
}

inline bool resolve_udp(const std::string& host, int port, sockaddr_in* out) {
  addrinfo hints{};
  hints.ai_family = AF_INET;
  hints.ai_socktype = SOCK_DGRAM;
  addrinfo* res = nullptr;
  if (::getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &res) != 0 || !res) return false;
  std::memcpy(out, res->ai_addr, sizeof *out);
  ::freeaddrinfo(res);
  return true;
}

}  // namespace limbo::elastic::wire
