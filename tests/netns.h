// "Several hosts" on one machine: network namespaces joined by a bridge
// (in a namespace of its own), each host at 10.77.<tag>.<i + 1>/24. A host
// is lost the ways a real one is: all its processes killed (peers see RST),
// stopped (silence), or its link cut (a partition). Needs root and iproute2;
// ok() is false (and why() says why) where namespaces cannot be made.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <string>
#include <vector>

namespace limbo::testing {

class VirtualHosts {
 public:
  explicit VirtualHosts(int n);
  ~VirtualHosts();
  VirtualHosts(const VirtualHosts&) = delete;
  VirtualHosts& operator=(const VirtualHosts&) = delete;

  bool ok() const { return ok_; }
  const std::string& why() const { return why_; }
  int size() const { return n_; }
  std::string ns(int i) const;
  std::string ip(int i) const;
  // `argv` run inside host i (through `ip netns exec`, which keeps the pid).
  std::vector<std::string> in(int i, const std::vector<std::string>& argv) const;
  // Every process in host i's namespace.
  std::vector<pid_t> pids(int i) const;
  // Sends `sig` to every process of host i.
  void signal_host(int i, int sig) const;
  // Takes host i's link down: no packet in or out, no RST.
  bool cut(int i) const;
  // Shapes every host's link both ways with the kernel's token bucket
  // (`tc qdisc ... tbf rate RATE burst 256kb latency 100ms`): a slow link.
  // False where tc is missing or refuses.
  bool shape(const std::string& rate) const;
  // Bytes host i has sent on its link.
  int64_t tx_bytes(int i) const;

 private:
  int n_ = 0;
  int tag_ = 0;
  bool ok_ = false;
  std::string why_;
};

}  // namespace limbo::testing
