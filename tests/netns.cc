#include "netns.h"

#include <signal.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>

namespace limbo::testing {
namespace {

int sh(const std::string& cmd) { return std::system((cmd + " >/dev/null 2>&1").c_str()); }

}  // namespace

// The switch namespace is the claim on a tag: `ip netns add` fails when
// the name exists, so of several test processes (or several sets in one
// process) exactly one holds each tag. Host namespaces of a tag left by a
// process that was killed before its clean-up are removed and made again.
VirtualHosts::VirtualHosts(int n) : n_(n) {
  if (::geteuid() != 0 || sh("ip netns list") != 0) {
    why_ = "needs root and iproute2";
    return;
  }
  const int first = ::getpid() % 250;
  for (int k = 0; k < 250 && tag_ == 0; ++k) {
    const int t = (first + k) % 250 + 1;
    if (sh("ip netns add lsw" + std::to_string(t)) == 0) tag_ = t;
  }
  if (tag_ == 0) {
    why_ = "cannot create network namespaces here (every tag 1-250 is taken)";
    return;
  }
  const std::string t = std::to_string(tag_), sw = "lsw" + t, br = "lbr" + t;
  bool ok = sh("ip -n " + sw + " link add " + br + " type bridge") == 0 && sh("ip -n " + sw + " link set " + br + " up") == 0;
  for (int i = 0; ok && i < n; ++i) {
    if (sh("ip netns pids " + ns(i)) == 0) {  // a stale one
      signal_host(i, SIGCONT);
      signal_host(i, SIGKILL);
      sh("ip netns del " + ns(i));
    }
    const std::string h = "lv" + t + "h" + std::to_string(i), s = "lv" + t + "s" + std::to_string(i);
    sh("ip link del " + h);  // one left in this namespace half made
    ok = sh("ip netns add " + ns(i)) == 0 && sh("ip link add " + h + " type veth peer name " + s) == 0 &&
         sh("ip link set " + h + " netns " + ns(i)) == 0 && sh("ip link set " + s + " netns " + sw) == 0 &&
         sh("ip -n " + sw + " link set " + s + " master " + br) == 0 &&
         sh("ip -n " + sw + " link set " + s + " up") == 0 &&
         sh("ip -n " + ns(i) + " addr add " + ip(i) + "/24 dev " + h) == 0 &&
         sh("ip -n " + ns(i) + " link set " + h + " up") == 0 && sh("ip -n " + ns(i) + " link set lo up") == 0;
  }
  ok_ = ok;
  if (!ok) why_ = "cannot create network namespaces and a bridge here";
}

VirtualHosts::~VirtualHosts() {
  if (tag_ == 0) return;  // claimed nothing: touches nothing
  for (int i = 0; i < n_; ++i) {
    signal_host(i, SIGCONT);
    signal_host(i, SIGKILL);
  }
  for (int i = 0; i < n_; ++i) sh("ip netns del " + ns(i));
  sh("ip netns del lsw" + std::to_string(tag_));
}

std::string VirtualHosts::ns(int i) const { return "lh" + std::to_string(tag_) + "-" + std::to_string(i); }

std::string VirtualHosts::ip(int i) const {
  return "10.77." + std::to_string(tag_) + "." + std::to_string(i + 1);
}

std::vector<std::string> VirtualHosts::in(int i, const std::vector<std::string>& argv) const {
  std::vector<std::string> out = {"/usr/sbin/ip", "netns", "exec", ns(i)};
  out.insert(out.end(), argv.begin(), argv.end());
  return out;
}

std::vector<pid_t> VirtualHosts::pids(int i) const {
  std::vector<pid_t> out;
  FILE* p = ::popen(("ip netns pids " + ns(i) + " 2>/dev/null").c_str(), "r");
  if (!p) return out;
  int pid = 0;
  while (std::fscanf(p, "%d", &pid) == 1) out.push_back(pid);
  ::pclose(p);
  return out;
}

void VirtualHosts::signal_host(int i, int sig) const {
  for (pid_t p : pids(i)) ::kill(p, sig);
}

bool VirtualHosts::shape(const std::string& rate) const {
  const std::string t = std::to_string(tag_);
  for (int i = 0; i < n_; ++i) {
    const std::string h = "lv" + t + "h" + std::to_string(i), s = "lv" + t + "s" + std::to_string(i);
    const std::string tbf = " root tbf rate " + rate + " burst 256kb latency 100ms";
    if (sh("ip netns exec " + ns(i) + " tc qdisc add dev " + h + tbf) != 0 ||
        sh("ip netns exec lsw" + t + " tc qdisc add dev " + s + tbf) != 0)
      return false;
  }
  return true;
}

int64_t VirtualHosts::tx_bytes(int i) const {
  const std::string path = "/sys/class/net/lv" + std::to_string(tag_) + "h" + std::to_string(i) + "/statistics/tx_bytes";
  FILE* p = ::popen(("ip netns exec " + ns(i) + " cat " + path + " 2>/dev/null").c_str(), "r");
  if (!p) return -1;
  long long v = -1;
  if (std::fscanf(p, "%lld", &v) != 1) v = -1;
  ::pclose(p);
  return v;
}

bool VirtualHosts::cut(int i) const {
  return sh("ip -n " + ns(i) + " link set lv" + std::to_string(tag_) + "h" + std::to_string(i) + " down") == 0;
}

}  // namespace limbo::testing
