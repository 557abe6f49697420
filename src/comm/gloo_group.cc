// c10d/Gloo implementation of Collective. The only translation unit that
// includes c10d headers.
#include <gloo/allgatherv.h>
#include <gloo/allreduce.h>
#include <gloo/math.h>
#include <gloo/rendezvous/context.h>
#include <gloo/rendezvous/store.h>
#include <gloo/transport/tcp/device.h>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>

#include <arpa/inet.h>
#include <dirent.h>
#include <signal.h>
#include <ifaddrs.h>
#include <net/if.h>
#include <netdb.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <condition_variable>
#include <mutex>
#include <thread>
#include <set>

#include "comm/collective.h"
#include "comm/compression.h"
#include "comm/gloo_tree.h"
#include "comm/store.h"
#include "common/error.h"

namespace limbo::comm {
namespace {

// c10d reports failures as c10::Error / std::runtime_error with messages;
// classify them so callers can recover (re-form on peer loss, retry on timeout).
// c10::Error's what() carries a backtrace; keep the message only.
std::string message_of(const std::exception& e) {
  if (auto* c = dynamic_cast<const c10::Error*>(&e)) return c->what_without_backtrace();
  return e.what();
}

[[noreturn]] void rethrow_classified(const std::string& what, const std::string& context) {
  auto has = [&](const char* s) { return what.find(s) != std::string::npos; };
  if (has("Timed out") || has("timed out") || has("Timeout") || has("timeout"))
    throw Timeout(context + ": " + what.substr(0, 300));
  throw PeerFailure(context + ": " + what.substr(0, 300));
}

// Lets Gloo's own rendezvous use the job's c10d store.
class StoreAdapter : public gloo::rendezvous::Store {
 public:
  explicit StoreAdapter(c10::intrusive_ptr<c10d::Store> s) : s_(std::move(s)) {}
  void set(const std::string& key, const std::vector<char>& data) override {
    s_->set(key, std::vector<uint8_t>(data.begin(), data.end()));
  }
  std::vector<char> get(const std::string& key) override {
    auto v = s_->get(key);
    return std::vector<char>(v.begin(), v.end());
  }
  void wait(const std::vector<std::string>& keys) override { s_->wait(keys); }
  void wait(const std::vector<std::string>& keys, const std::chrono::milliseconds& t) override {
    s_->wait(keys, t);
  }

 private:
  c10::intrusive_ptr<c10d::Store> s_;
};

// c10d's Store interface over the job's own store client (comm/store.h),
// for ProcessGroupGloo's rendezvous.
class C10dStore : public c10d::Store {
 public:
  explicit C10dStore(std::shared_ptr<StoreClient> c) : c10d::Store(c->timeout()), c_(std::move(c)) {}
  void set(const std::string& key, const std::vector<uint8_t>& value) override {
    c_->set(key, std::string(value.begin(), value.end()));
  }
  std::vector<uint8_t> compareSet(const std::string& key, const std::vector<uint8_t>& expected,
                                  const std::vector<uint8_t>& desired) override {
    return bytes(c_->compare_set(key, std::string(expected.begin(), expected.end()),
                                 std::string(desired.begin(), desired.end())));
  }
  std::vector<uint8_t> get(const std::string& key) override { return bytes(c_->get(key, timeout_)); }
  int64_t add(const std::string& key, int64_t value) override { return c_->add(key, value); }
  bool deleteKey(const std::string& key) override { return c_->erase(key); }
  bool check(const std::vector<std::string>& keys) override { return c_->check(keys); }
  int64_t getNumKeys() override { return c_->num_keys(); }
  void wait(const std::vector<std::string>& keys) override { c_->wait(keys, timeout_); }
  void wait(const std::vector<std::string>& keys, const std::chrono::milliseconds& t) override {
    c_->wait(keys, t);
  }

 private:
  static std::vector<uint8_t> bytes(const std::string& s) { return std::vector<uint8_t>(s.begin(), s.end()); }
  std::shared_ptr<StoreClient> c_;
};

// c10d's Store interface over the rendezvous interface (comm/kv_store.h),
// for a group formed through etcd. Blocking reads wait in slices so that
// `cancelled` stops them within a tenth of a second.
class KvC10dStore : public c10d::Store {
 public:
  KvC10dStore(std::shared_ptr<KvStore> s, std::chrono::milliseconds timeout, std::function<bool()> cancelled)
      : c10d::Store(timeout), s_(std::move(s)), cancelled_(std::move(cancelled)) {}
  void set(const std::string& key, const std::vector<uint8_t>& value) override {
    s_->set(key, std::string(value.begin(), value.end()));
  }
  std::vector<uint8_t> compareSet(const std::string& key, const std::vector<uint8_t>& expected,
                                  const std::vector<uint8_t>& desired) override {
    return bytes(s_->compare_set(key, std::string(expected.begin(), expected.end()),
                                 std::string(desired.begin(), desired.end())));
  }
  std::vector<uint8_t> get(const std::string& key) override {
    wait({key}, timeout_);
    auto v = s_->try_get(key);
    if (!v) throw PeerFailure(s_->describe() + ": key '" + key + "' vanished");
    return bytes(*v);
  }
  int64_t add(const std::string& key, int64_t value) override { return s_->add(key, value); }
  bool deleteKey(const std::string& key) override { return s_->erase(key); }
  bool check(const std::vector<std::string>& keys) override {
    for (const auto& k : keys)
      if (!s_->try_get(k)) return false;
    return true;
  }
  int64_t getNumKeys() override { return static_cast<int64_t>(s_->list("").size()); }
  void wait(const std::vector<std::string>& keys) override { wait(keys, timeout_); }
  void wait(const std::vector<std::string>& keys, const std::chrono::milliseconds& t) override {
    const auto deadline = std::chrono::steady_clock::now() + t;
    for (const auto& k : keys) {
      while (true) {
        if (cancelled_ && cancelled_()) throw PeerFailure("waiting for '" + k + "': the round was replaced");
        const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
        if (left.count() <= 0)
          throw Timeout(s_->describe() + ": key '" + k + "' did not appear within " + std::to_string(t.count()) + " ms");
        if (s_->wait_for(k, std::min(left, std::chrono::milliseconds(100)))) break;
      }
    }
  }

 private:
  static std::vector<uint8_t> bytes(const std::string& s) { return std::vector<uint8_t>(s.begin(), s.end()); }
  std::shared_ptr<KvStore> s_;
  std::function<bool()> cancelled_;
};

// This process's TCP sockets: (fd, inode), so that a descriptor closed and
// reused by something else is told apart.
std::set<std::pair<int, ino_t>> tcp_sockets() {
  std::set<std::pair<int, ino_t>> out;
  DIR* d = ::opendir("/proc/self/fd");
  if (!d) return out;
  while (dirent* e = ::readdir(d)) {
    char* end = nullptr;
    const long fd = std::strtol(e->d_name, &end, 10);
    if (end == e->d_name || *end != '\0' || fd == ::dirfd(d)) continue;
    struct stat st {};
    if (::fstat(static_cast<int>(fd), &st) != 0 || !S_ISSOCK(st.st_mode)) continue;
    int domain = 0, type = 0;
    socklen_t len = sizeof domain;
    if (::getsockopt(static_cast<int>(fd), SOL_SOCKET, SO_DOMAIN, &domain, &len) != 0) continue;
    len = sizeof type;
    if (::getsockopt(static_cast<int>(fd), SOL_SOCKET, SO_TYPE, &type, &len) != 0) continue;
    if ((domain == AF_INET || domain == AF_INET6) && type == SOCK_STREAM) out.insert({static_cast<int>(fd), st.st_ino});
  }
  ::closedir(d);
  return out;
}

int peer_port(int fd) {
  sockaddr_storage a{};
  socklen_t len = sizeof a;
  if (::getpeername(fd, reinterpret_cast<sockaddr*>(&a), &len) != 0) return -1;
  if (a.ss_family == AF_INET) return ntohs(reinterpret_cast<sockaddr_in*>(&a)->sin_port);
  if (a.ss_family == AF_INET6) return ntohs(reinterpret_cast<sockaddr_in6*>(&a)->sin6_port);
  return -1;
}

// The TCP sockets opened since `before`, except connections to the store
// (whose ports are `store_ports`).
std::vector<std::pair<int, ino_t>> new_sockets(const std::set<std::pair<int, ino_t>>& before,
                                               const std::set<int>& store_ports) {
  std::vector<std::pair<int, ino_t>> out;
  for (const auto& s : tcp_sockets())
    if (!before.count(s) && !store_ports.count(peer_port(s.first))) out.push_back(s);
  return out;
}

std::set<int> store_ports(const GroupOptions& opt) {
  std::set<int> ports(opt.control_ports.begin(), opt.control_ports.end());
  if (!opt.connect_store) ports.insert(opt.store_port);
  return ports;
}

void shutdown_sockets(const std::vector<std::pair<int, ino_t>>& sockets) {
  for (const auto& [fd, inode] : sockets) {
    struct stat st {};
    if (::fstat(fd, &st) == 0 && st.st_ino == inode) ::shutdown(fd, SHUT_RDWR);
  }
}

// Polls GroupOptions::cancelled during formation (every 5 ms) and shuts
// down the formation's sockets when it fires.
class FormationWatch {
 public:
  FormationWatch(const GroupOptions& opt, const std::set<std::pair<int, ino_t>>& before) {
    if (!opt.cancelled) return;
    thread_ = std::thread([this, cancelled = opt.cancelled, before, ports = store_ports(opt)] {
      std::unique_lock<std::mutex> lock(mu_);
      while (!done_) {
        cv_.wait_for(lock, std::chrono::milliseconds(5));
        if (done_) return;
        if (cancelled()) {
          shutdown_sockets(new_sockets(before, ports));
          return;
        }
      }
    });
  }
  void finish() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      done_ = true;
    }
    cv_.notify_all();
    if (thread_.joinable()) thread_.join();
  }
  ~FormationWatch() { finish(); }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  bool done_ = false;
  std::thread thread_;
};

class GlooGroup : public Collective {
 public:
  GlooGroup(const GroupOptions& opt, int rank, int size) : opt_(opt) {
    const auto sockets_before = tcp_sockets();
    // While the group forms, a watcher stops it when the round is replaced:
    // the store's waits see `cancelled` themselves; Gloo's connection set-up
    // (a peer that froze after publishing its address) is stopped by
    // shutting down the sockets this formation opened.
    FormationWatch watch(opt, sockets_before);
    try {
      std::shared_ptr<StoreClient> client;
      c10::intrusive_ptr<c10d::Store> tcp;
      if (opt.connect_store) {
        tcp = c10::make_intrusive<KvC10dStore>(opt.connect_store(), opt.timeout, opt.cancelled);
      } else {
        client = opt.share_client ? std::make_shared<StoreClient>(*opt.share_client, opt.timeout)
                                  : std::make_shared<StoreClient>(opt.store_host, opt.store_port, opt.timeout, opt.token);
        if (opt.cancelled) client->set_cancel(opt.cancelled);
        tcp = c10::make_intrusive<C10dStore>(client);
      }
      auto store = c10::make_intrusive<c10d::PrefixStore>(opt.prefix, tcp);
      auto go = c10d::ProcessGroupGloo::Options::create(opt.timeout);
      const std::string bind =
          opt.bind_host.empty() ? local_address_towards(opt.store_host) : opt.bind_host;
      go->devices.push_back(c10d::ProcessGroupGloo::createDeviceForHostname(bind));
      go->threads = opt.worker_threads;
      pg_ = c10::make_intrusive<c10d::ProcessGroupGloo>(store, rank, size, go);
      if (opt.direct_allreduce && size > 1) {
        // A second, raw Gloo context for the gradient all-reduce: it runs on
        // the calling thread, without c10d's hand-off to a worker thread
        // (a fixed cost of milliseconds per call on this class of machine).
        StoreAdapter adapter(c10::make_intrusive<c10d::PrefixStore>(opt.prefix + "/raw", tcp));
        gloo::transport::tcp::attr attr(bind.c_str());
        ctx_ = std::make_shared<gloo::rendezvous::Context>(rank, size);
        ctx_->setTimeout(opt.timeout);
        auto device = gloo::transport::tcp::CreateDevice(attr);
        ctx_->connectFullMesh(adapter, device);
      }
      watch.finish();
      if (opt.cancelled && opt.cancelled())
        throw PeerFailure("forming the Gloo group '" + opt.prefix + "': the round was replaced by a newer one");
      // The sockets this group opened (its Gloo connections and listeners,
      // not its store connection), for abort().
      sockets_ = new_sockets(sockets_before, store_ports(opt));
      if (client) client->set_cancel(nullptr);
    } catch (const limbo::Error&) {
      throw;
    } catch (const std::exception& e) {
      watch.finish();
      if (opt.cancelled && opt.cancelled())
        throw PeerFailure("forming the Gloo group '" + opt.prefix + "': the round was replaced by a newer one (" +
                          message_of(e).substr(0, 200) + ")");
      rethrow_classified(message_of(e), "forming the Gloo group '" + opt.prefix + "' (rank " +
                                       std::to_string(rank) + " of " + std::to_string(size) +
                                       ", store " + opt.store_host + ":" +
                                       std::to_string(opt.store_port) + ")");
    }
  }

  ~GlooGroup() override {
    std::lock_guard<std::mutex> lock(abort_mu_);
    sockets_.clear();  // closed with the contexts below; abort() must not touch them
  }

  int rank() const override { return pg_->getRank(); }

  void abort() override {
    std::lock_guard<std::mutex> lock(abort_mu_);
    aborted_ = true;
    shutdown_sockets(sockets_);
  }
  int size() const override { return pg_->getSize(); }

  void allreduce_sum(torch::Tensor& t) override {
    if (size() == 1) return;
    check_aborted();
    if (ctx_ && t.scalar_type() == torch::kFloat32 && t.is_contiguous()) {
      try {
        direct_allreduce(t.data_ptr(), static_cast<size_t>(t.numel()), sizeof(float),
                         static_cast<ReduceFn>(&gloo::sum<float>));
      } catch (const std::exception& e) {
        rethrow_classified(message_of(e), "all-reduce in group '" + opt_.prefix + "'");
      }
      return;
    }
    auto flat = t.view(-1);
    const int64_t per_bucket = std::max<int64_t>(1, opt_.bucket_bytes / t.element_size());
    // Issue every bucket, then wait: Gloo pipelines them on its own thread.
    std::vector<c10::intrusive_ptr<c10d::Work>> work;
    std::vector<std::vector<at::Tensor>> buckets;
    for (int64_t off = 0; off < flat.numel(); off += per_bucket) {
      buckets.push_back({flat.narrow(0, off, std::min(per_bucket, flat.numel() - off))});
    }
    try {
      for (auto& b : buckets) work.push_back(pg_->allreduce(b));
      for (auto& w : work) w->wait(opt_.timeout);
    } catch (const std::exception& e) {
      rethrow_classified(message_of(e), "all-reduce in group '" + opt_.prefix + "'");
    }
  }

  void allreduce_sum_16(torch::Tensor& t) override {
    if (size() == 1) return;
    check_aborted();
    const bool half = t.scalar_type() == torch::kHalf;
    if ((!half && t.scalar_type() != torch::kBFloat16) || !t.is_contiguous())
      throw InvalidInput("allreduce_sum_16 takes a contiguous kHalf or kBFloat16 tensor");
    if (!ctx_)
      throw InvalidInput("compressed all-reduce needs the direct Gloo path (elastic.direct_allreduce = true)");
    try {
      direct_allreduce(t.data_ptr(), static_cast<size_t>(t.numel()), 2, half ? &sum_fp16 : &sum_bf16);
    } catch (const std::exception& e) {
      rethrow_classified(message_of(e), "compressed all-reduce in group '" + opt_.prefix + "'");
    }
  }

  void allreduce_max(torch::Tensor& t) override {
    if (size() == 1) return;
    check_aborted();
    std::vector<at::Tensor> v = {t};
    c10d::AllreduceOptions ao;
    ao.reduceOp = c10d::ReduceOp::MAX;
    try {
      pg_->allreduce(v, ao)->wait(opt_.timeout);
    } catch (const std::exception& e) {
      rethrow_classified(message_of(e), "all-reduce (max) in group '" + opt_.prefix + "'");
    }
  }

  // Gloo's all-gather of variable parts on the direct context (each
  // member's part is already in place in the output).
  void all_gather(torch::Tensor& t, const std::vector<int64_t>& bounds) override {
    check_shards(t, bounds, size(), "all-gather");
    if (size() == 1) return;
    if (!ctx_) return Collective::all_gather(t, bounds);
    check_aborted();
    const size_t es = t.element_size();
    std::vector<size_t> counts;
    for (int r = 0; r < size(); ++r) counts.push_back(static_cast<size_t>(bounds[r + 1] - bounds[r]) * es);
    try {
      gloo::AllgathervOptions o(ctx_);
      o.setOutput(static_cast<uint8_t*>(t.data_ptr()), counts);
      o.setTag(tag_++);
      o.setTimeout(opt_.timeout);
      gloo::allgatherv(o);
    } catch (const std::exception& e) {
      rethrow_classified(message_of(e), "all-gather in group '" + opt_.prefix + "'");
    }
  }

  void broadcast(torch::Tensor& t, int root) override {
    if (size() == 1) return;
    check_aborted();
    std::vector<at::Tensor> v = {t};
    c10d::BroadcastOptions bo;
    bo.rootRank = root;
    try {
      pg_->broadcast(v, bo)->wait(opt_.timeout);
    } catch (const std::exception& e) {
      rethrow_classified(message_of(e), "broadcast in group '" + opt_.prefix + "'");
    }
  }

 private:
  using ReduceFn = GlooReduceFn;

  // The direct path's all-reduce. Two members, or a count that is not a
  // power of two: Gloo's ring. 4, 8, 16, ... members: the tree over ranks
  // (comm/gloo_tree.h), the order a hierarchical group gives.
  void direct_allreduce(void* data, size_t count, size_t elsize, ReduceFn fn) {
    const int p = size();
    if (p <= 2 || (p & (p - 1)) != 0) {
      gloo::AllreduceOptions o(ctx_);
      if (elsize == sizeof(float)) o.setOutput(static_cast<float*>(data), count);
      else o.setOutput(static_cast<uint16_t*>(data), count);
      o.setReduceFunction(fn);
      o.setTag(tag_++);
      o.setTimeout(opt_.timeout);
      gloo::allreduce(o);
      return;
    }
    tree_allreduce(*ctx_, static_cast<uint8_t*>(data), count, elsize, fn, tag_++, opt_.timeout, scratch_);
  }

  void check_aborted() {
    std::lock_guard<std::mutex> lock(abort_mu_);
    if (aborted_) throw PeerFailure("group '" + opt_.prefix + "' was aborted (a member stopped answering)");
  }

  GroupOptions opt_;
  std::mutex abort_mu_;
  bool aborted_ = false;
  std::vector<std::pair<int, ino_t>> sockets_;
  c10::intrusive_ptr<c10d::ProcessGroupGloo> pg_;
  std::shared_ptr<gloo::rendezvous::Context> ctx_;
  uint32_t tag_ = 0;
  std::vector<uint8_t> scratch_;  // the tree all-reduce's received halves
};

}  // namespace

std::string local_address_towards(const std::string& host) {
  addrinfo hints{};
  hints.ai_family = AF_INET;
  hints.ai_socktype = SOCK_DGRAM;
  addrinfo* res = nullptr;
  if (::getaddrinfo(host.c_str(), "9", &hints, &res) != 0 || !res)
    throw PeerFailure("cannot resolve '" + host + "'");
  int fd = ::socket(AF_INET, SOCK_DGRAM, 0);
  std::string out;
  if (fd >= 0 && ::connect(fd, res->ai_addr, res->ai_addrlen) == 0) {
    sockaddr_in local{};
    socklen_t len = sizeof local;
    if (::getsockname(fd, reinterpret_cast<sockaddr*>(&local), &len) == 0) {
      char buf[INET_ADDRSTRLEN];
      if (::inet_ntop(AF_INET, &local.sin_addr, buf, sizeof buf)) out = buf;
    }
  }
  if (fd >= 0) ::close(fd);
  ::freeaddrinfo(res);
  if (out.empty()) throw PeerFailure("no route from this machine to '" + host + "'");
  return out;
}

std::string reachable_address(const std::vector<std::string>& hosts) {
  auto loopback = [](const std::string& a) { return a.rfind("127.", 0) == 0; };
  for (const auto& h : hosts) {
    try {
      const std::string a = local_address_towards(h);
      if (!loopback(a)) return a;
    } catch (const PeerFailure&) {
      // no route to this one: the next
    }
  }
  ifaddrs* all = nullptr;
  std::string found;
  if (::getifaddrs(&all) == 0) {
    for (ifaddrs* i = all; i && found.empty(); i = i->ifa_next) {
      if (!i->ifa_addr || i->ifa_addr->sa_family != AF_INET || !(i->ifa_flags & IFF_UP) || (i->ifa_flags & IFF_LOOPBACK))
        continue;
      char buf[INET_ADDRSTRLEN];
      const auto* in = reinterpret_cast<const sockaddr_in*>(i->ifa_addr);
      if (::inet_ntop(AF_INET, &in->sin_addr, buf, sizeof buf)) found = buf;
    }
    ::freeifaddrs(all);
  }
  if (!found.empty()) return found;
  return hosts.empty() ? std::string("127.0.0.1") : local_address_towards(hosts.front());
}

bool is_local_address(const std::string& host) {
  addrinfo hints{};
  hints.ai_family = AF_INET;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* res = nullptr;
  if (::getaddrinfo(host.c_str(), "0", &hints, &res) != 0 || !res) return false;
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  bool local = fd >= 0 && ::bind(fd, res->ai_addr, res->ai_addrlen) == 0;
  if (fd >= 0) ::close(fd);
  ::freeaddrinfo(res);
  return local;
}

std::unique_ptr<Collective> make_gloo_group(const GroupOptions& opt, int rank, int size) {
  if (size < 1 || rank < 0 || rank >= size)
    throw InvalidInput("bad rank " + std::to_string(rank) + " for a group of " + std::to_string(size));
  // Gloo writes to its sockets without MSG_NOSIGNAL: a peer that died (or
  // abort() shutting the sockets down) would kill this process with SIGPIPE
  // instead of failing the collective. Ignore it unless the program chose a
  // handler of its own.
  struct sigaction old {};
  if (::sigaction(SIGPIPE, nullptr, &old) == 0 && old.sa_handler == SIG_DFL) ::signal(SIGPIPE, SIG_IGN);
  return std::make_unique<GlooGroup>(opt, rank, size);
}

std::shared_ptr<void> host_store(const std::string& host, int* port, const std::string& token) {
  StoreServerOptions so;
  so.token = token;
  auto server = std::make_shared<StoreServer>(host, *port, so);
  *port = server->port();
  return server;
}

}  // namespace limbo::comm
