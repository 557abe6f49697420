#include "etcd_cluster.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <thread>

#include <nlohmann/json.hpp>

#include "test_util.h"

namespace limbo::testing {
namespace {

bool have_etcd() { return ::access("/usr/bin/etcd", X_OK) == 0; }

// Ports unlikely to collide between concurrent test processes (and
// distinct for each cluster of one process).
int base_port() {
  static int clusters = 0;
  return 32000 + (::getpid() % 1000) * 24 + 8 * (clusters++ % 3);
}

// A loopback port nobody holds now (bound to port 0, then released).
int free_port() {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof a;
  int port = 0;
  if (fd >= 0 && ::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0 &&
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) == 0)
    port = ntohs(a.sin_port);
  if (fd >= 0) ::close(fd);
  return port;
}

}  // namespace

EtcdCluster::EtcdCluster(const std::string& dir, const std::vector<EtcdMemberSpec>& members,
                         const std::vector<std::string>& extra, bool tls)
    : dir_(dir), tls_(tls) {
  start(dir, members, extra);
}

EtcdCluster::EtcdCluster(const std::string& dir, int n, const std::vector<std::string>& extra, bool tls)
    : dir_(dir), tls_(tls) {
  start(dir, std::vector<EtcdMemberSpec>(n), extra);
}

void EtcdCluster::start(const std::string& dir, const std::vector<EtcdMemberSpec>& members,
                        const std::vector<std::string>& extra) {
  if (!have_etcd()) {
    why_ = "etcd is not installed (Debian etcd-server)";
    return;
  }
  members_ = members;
  // Member data on tmpfs when there is one: etcd syncs every write to disk,
  // which on a shared test machine's disk costs tens of milliseconds.
  const int base = base_port();
  data_ = ::access("/dev/shm", W_OK) == 0 ? "/dev/shm/limbo-etcd-" + std::to_string(::getpid()) + "-" +
                                                std::to_string(base)
                                          : dir + "/data";
  std::string cluster;
  std::vector<int> peer_ports;
  for (size_t i = 0; i < members.size(); ++i) {
    // On this machine's loopback, ports the kernel says are free (a fixed
    // formula collided with other tests' ports); inside a namespace of its
    // own every port is free.
    const bool here = !members[i].wrap;
    client_ports_.push_back(here ? free_port() : base + 2 * static_cast<int>(i));
    peer_ports.push_back(here ? free_port() : base + 2 * static_cast<int>(i) + 1);
    cluster += (i ? "," : "") + std::string("m") + std::to_string(i) + "=http://" + members[i].ip + ":" +
               std::to_string(peer_ports[i]);
  }
  const std::string scheme = tls_ ? "https://" : "http://";
  for (size_t i = 0; i < members.size(); ++i) {
    const std::string ip = members[i].ip;
    const std::string client = scheme + ip + ":" + std::to_string(client_ports_[i]);
    const std::string peer = "http://" + ip + ":" + std::to_string(peer_ports[i]);
    std::vector<std::string> argv = {"/usr/bin/etcd", "--name", "m" + std::to_string(i), "--data-dir",
                                     data_ + "/m" + std::to_string(i), "--listen-client-urls", client,
                                     "--advertise-client-urls", client, "--listen-peer-urls", peer,
                                     "--initial-advertise-peer-urls", peer, "--initial-cluster", cluster,
                                     "--initial-cluster-state", "new", "--initial-cluster-token",
                                     "limbo-test-" + std::to_string(::getpid())};
    argv.insert(argv.end(), extra.begin(), extra.end());
    if (members[i].wrap) argv = members[i].wrap(argv);
    pids_.push_back(spawn_process(argv, log(static_cast<int>(i)), true));
  }
  ok_ = wait_leader(30);
  if (!ok_) why_ = "the etcd cluster elected no leader within 30 s: " + slurp(log(0)).substr(0, 2000);
}

EtcdCluster::~EtcdCluster() {
  for (pid_t p : pids_) {
    if (p <= 0) continue;
    ::kill(p, SIGCONT);
    ::kill(p, SIGKILL);
    ::waitpid(p, nullptr, 0);
  }
  if (!data_.empty()) std::filesystem::remove_all(data_);
}

std::string EtcdCluster::endpoint(int i) const { return members_[i].ip + ":" + std::to_string(client_ports_[i]); }

std::string EtcdCluster::endpoints() const {
  std::string s;
  for (int i = 0; i < size(); ++i) s += (i ? "," : "") + endpoint(i);
  return s;
}

std::string EtcdCluster::log(int i) const { return dir_ + "/etcd" + std::to_string(i) + ".log"; }

// Asks each live member (through etcdctl, inside its own host when it has
// one) for its id and its leader's.
int EtcdCluster::leader() const {
  std::vector<std::string> ids(size());
  std::string lead;
  for (int i = 0; i < size(); ++i) {
    if (pids_[i] <= 0) continue;
    std::vector<std::string> argv = {"/usr/bin/etcdctl", "--endpoints", endpoint(i), "--dial-timeout", "1s",
                                     "--command-timeout", "1s"};
    if (tls_)
      argv.insert(argv.end(), {"--cacert", dir_ + "/tls/ca.crt", "--cert", dir_ + "/tls/client.crt", "--key",
                               dir_ + "/tls/client.key"});
    argv.insert(argv.end(), {"endpoint", "status", "-w", "json"});
    if (members_[i].wrap) argv = members_[i].wrap(argv);
    const std::string out = dir_ + "/status" + std::to_string(i) + ".json";
    const pid_t p = spawn_process(argv, out);
    ::waitpid(p, nullptr, 0);
    try {
      auto j = nlohmann::json::parse(slurp(out));
      const auto& st = j.at(0).at("Status");
      ids[i] = std::to_string(st.at("header").at("member_id").get<uint64_t>());
      const auto l = st.at("leader").get<uint64_t>();
      if (l) lead = std::to_string(l);
    } catch (const std::exception&) {
    }
  }
  for (int i = 0; i < size(); ++i)
    if (!lead.empty() && ids[i] == lead) return i;
  return -1;
}

bool EtcdCluster::wait_leader(double timeout_s) const {
  const auto end = std::chrono::steady_clock::now() + std::chrono::duration<double>(timeout_s);
  while (std::chrono::steady_clock::now() < end) {
    if (leader() >= 0) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  return false;
}

void EtcdCluster::signal(int i, int sig) const {
  if (pids_[i] > 0) ::kill(pids_[i], sig);
}

void EtcdCluster::kill(int i) {
  if (pids_[i] <= 0) return;
  ::kill(pids_[i], SIGKILL);
  ::waitpid(pids_[i], nullptr, 0);
  pids_[i] = -1;
}

int EtcdCluster::etcdctl(const std::vector<std::string>& args) const {
  std::vector<std::string> argv = {"/usr/bin/etcdctl", "--endpoints", endpoints()};
  argv.insert(argv.end(), args.begin(), args.end());
  const pid_t p = spawn_process(argv, dir_ + "/etcdctl.log");
  int status = 0;
  ::waitpid(p, &status, 0);
  return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

}  // namespace limbo::testing

namespace limbo::testing {

bool make_certificates(const std::string& dir, const std::string& server_ip) {
  const std::string t = dir + "/tls";
  const std::string script =
      "set -e; mkdir -p '" + t + "'; cd '" + t + "';"
      "openssl req -x509 -newkey rsa:2048 -nodes -days 2 -subj /CN=limbo-test-ca -keyout ca.key -out ca.crt;"
      "printf 'subjectAltName=IP:" + server_ip + "\\nextendedKeyUsage=serverAuth,clientAuth\\n' > server.ext;"
      "openssl req -newkey rsa:2048 -nodes -subj /CN=etcd -keyout server.key -out server.csr;"
      "openssl x509 -req -in server.csr -CA ca.crt -CAkey ca.key -CAcreateserial -days 2 -extfile server.ext "
      "-out server.crt;"
      "printf 'extendedKeyUsage=clientAuth\\n' > client.ext;"
      "openssl req -newkey rsa:2048 -nodes -subj /CN=limbo -keyout client.key -out client.csr;"
      "openssl x509 -req -in client.csr -CA ca.crt -CAkey ca.key -CAcreateserial -days 2 -extfile client.ext "
      "-out client.crt";
  const pid_t p = spawn_process({"/bin/sh", "-c", script}, dir + "/openssl.log");
  int status = 0;
  ::waitpid(p, &status, 0);
  return WIFEXITED(status) && WEXITSTATUS(status) == 0;
}

}  // namespace limbo::testing
