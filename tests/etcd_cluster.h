// A real etcd cluster for tests (Debian's etcd-server): N members, each
// its own process, on loopback ports or inside the namespaces of
// tests/netns.h. Members can be killed, stopped and continued like any
// host's process. ok() is false (why() says why) where etcd is not
// installed.
#pragma once

#include <sys/types.h>

#include <functional>
#include <string>
#include <vector>

namespace limbo::testing {

struct EtcdMemberSpec {
  std::string ip = "127.0.0.1";
  // Wraps the member's command line (e.g. VirtualHosts::in for a namespace).
  std::function<std::vector<std::string>(const std::vector<std::string>&)> wrap;
};

class EtcdCluster {
 public:
  // `extra` goes on every member's command line (e.g. TLS flags).
  EtcdCluster(const std::string& dir, const std::vector<EtcdMemberSpec>& members,
              const std::vector<std::string>& extra = {}, bool tls = false);
  // n members on loopback.
  EtcdCluster(const std::string& dir, int n, const std::vector<std::string>& extra = {}, bool tls = false);
  ~EtcdCluster();
  EtcdCluster(const EtcdCluster&) = delete;
  EtcdCluster& operator=(const EtcdCluster&) = delete;

  bool ok() const { return ok_; }
  const std::string& why() const { return why_; }
  int size() const { return static_cast<int>(pids_.size()); }
  std::string endpoint(int i) const;  // IP:PORT of member i's clients
  std::string endpoints() const;      // all of them, comma-separated
  pid_t pid(int i) const { return pids_[i]; }
  std::string log(int i) const;
  // The member that leads now (-1 when none answers as leader).
  int leader() const;
  // Waits until some member leads (true) or `timeout_s` passes.
  bool wait_leader(double timeout_s) const;
  void signal(int i, int sig) const;
  // Kills member i and reaps it.
  void kill(int i);
  // Runs etcdctl against the cluster; its exit code.
  int etcdctl(const std::vector<std::string>& args) const;

 private:
  void start(const std::string& dir, const std::vector<EtcdMemberSpec>& members,
             const std::vector<std::string>& extra);
  std::string dir_;
  std::string data_;  // the members' data directories
  bool tls_ = false;
  std::vector<EtcdMemberSpec> members_;
  std::vector<int> client_ports_;
  std::vector<pid_t> pids_;
  bool ok_ = false;
  std::string why_;
};

}  // namespace limbo::testing

namespace limbo::testing {
// Makes a CA, a server certificate for `server_ip` and a client
// certificate under dir/tls (ca.crt, server.crt/.key, client.crt/.key)
// with the openssl command; false when that fails.
bool make_certificates(const std::string& dir, const std::string& server_ip);
}  // namespace limbo::testing
