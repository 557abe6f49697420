#include "elastic/join.h"

#include <pthread.h>
#include <signal.h>

#include <atomic>
#include <cstdlib>

#include "comm/etcd.h"
#include "comm/hier_group.h"
#include "comm/kv_store.h"
#include "comm/store.h"
#include "common/error.h"
#include "common/log.h"

namespace limbo::elastic {

std::pair<std::string, int> split_host_port(const std::string& s, const char* flag) {
  auto colon = s.rfind(':');
  if (colon == std::string::npos || colon == 0 || colon + 1 == s.size())
    throw InvalidInput(std::string(flag) + " expects HOST:PORT, got '" + s + "'");
  try {
    int port = std::stoi(s.substr(colon + 1));
    if (port < 0 || port > 65535) throw std::out_of_range("port");
    return {s.substr(0, colon), port};
  } catch (const std::exception&) {
    throw InvalidInput(std::string(flag) + ": bad port in '" + s + "'");
  }
}

namespace {

comm::GroupOptions group_options(const JoinOptions& opt) {
  comm::GroupOptions go;
  go.token = opt.token;
  go.direct_allreduce = opt.direct_allreduce;
  go.shared_memory = opt.shared_memory;
  go.hierarchical = opt.hierarchical;
  return go;
}

std::atomic<bool> g_leave_requested{false};
constexpr int kLeaveSignals[] = {SIGTERM, SIGINT, SIGUSR1};
struct sigaction g_before[3];          // the handlers leave_on_signals() replaced
volatile sig_atomic_t g_chain[3] = {};  // ... which also run
volatile sig_atomic_t g_installed = 0;

int slot_of(int sig) {
  for (int i = 0; i < 3; ++i)
    if (kLeaveSignals[i] == sig) return i;
  return -1;
}

volatile sig_atomic_t g_last_signal = 0;

void on_leave_signal(int sig, siginfo_t* info, void* ctx) {
  g_last_signal = sig;
  g_leave_requested = true;
  const int i = slot_of(sig);
  if (i < 0 || !g_chain[i]) return;
  const struct sigaction& old = g_before[i];
  if (old.sa_flags & SA_SIGINFO) {
    if (old.sa_sigaction) old.sa_sigaction(sig, info, ctx);
  } else if (old.sa_handler != SIG_DFL && old.sa_handler != SIG_IGN && old.sa_handler) {
    old.sa_handler(sig);
  }
}

void put_back() {
  if (!g_installed) return;
  for (int i = 0; i < 3; ++i) ::sigaction(kLeaveSignals[i], &g_before[i], nullptr);
  g_installed = 0;
}

}  // namespace

std::shared_ptr<AllReduceUpdate> join_static(const JoinOptions& opt, int rank, int world,
                                             std::shared_ptr<train::OptimizerStep> optimizer,
                                             optim::FlatParams& flat) {
  comm::GroupOptions go = group_options(opt);
  std::tie(go.store_host, go.store_port) = split_host_port(opt.rdzv, "--dist-rdzv");
  go.prefix = "limbo/static";
  auto group = comm::make_group(go, rank, world);
  return std::make_shared<AllReduceUpdate>(std::shared_ptr<comm::Collective>(std::move(group)), std::move(optimizer),
                                           flat, opt.reduce);
}

Joined join_elastic(const JoinOptions& opt, std::shared_ptr<train::OptimizerStep> optimizer, optim::FlatParams& flat,
                    std::function<bool()> want_leave) {
  comm::GroupOptions go = group_options(opt);
  go.timeout = std::chrono::milliseconds(static_cast<int64_t>(1000 * opt.collective_timeout));
  MemberOptions mo;
  mo.round_timeout = std::chrono::milliseconds(static_cast<int64_t>(1000 * opt.round_timeout));
  mo.interrupted = want_leave;
  std::shared_ptr<comm::KvStore> kv;
  if (comm::is_etcd_url(opt.rdzv)) {
    // Every store call of this worker goes to etcd; its credentials come
    // from the environment the launcher set.
    auto eo = comm::parse_etcd_url(opt.rdzv, "--dist-rdzv");
    comm::etcd_from_env(&eo);
    std::tie(go.store_host, go.store_port) = split_host_port(eo.endpoints[0], "--dist-rdzv");
    for (const auto& ep : eo.endpoints) go.control_ports.push_back(split_host_port(ep, "--dist-rdzv").second);
    const auto call_timeout = go.timeout;
    go.connect_store = [eo, call_timeout]() -> std::shared_ptr<comm::KvStore> {
      return comm::connect_etcd(eo, call_timeout);
    };
    mo.connect = [eo]() -> std::shared_ptr<comm::KvStore> {
      return comm::connect_etcd(eo, std::chrono::milliseconds(1000));
    };
    mo.cut_off_after = std::chrono::seconds(10);
    mo.watch_wait = std::chrono::milliseconds(1000);
    kv = comm::connect_etcd(eo, go.timeout);
  } else {
    std::tie(go.store_host, go.store_port) = split_host_port(opt.rdzv, "--dist-rdzv");
    // One connection for every store call of this worker: its training
    // thread's, its member threads' (Member shares it) and each group
    // formation's.
    go.share_client = std::make_shared<comm::StoreClient>(go.store_host, go.store_port, go.timeout, go.token);
    kv = comm::kv_store_on(*go.share_client, go.timeout);
  }
  mo.group = go;
  // The launcher's heartbeat table and this worker's slot in it.
  if (const char* slot = std::getenv("LIMBO_BEAT_SLOT")) {
    const std::string v = slot;
    const auto colon = v.rfind(':');
    try {
      if (colon == std::string::npos) throw Error("not NAME:SLOT");
      mo.beats = LocalBeats::open(v.substr(0, colon));
      mo.beat_slot = std::stoi(v.substr(colon + 1));
    } catch (const std::exception& e) {
      log_warn("LIMBO_BEAT_SLOT='" + v + "' is not usable (" + e.what() + "); this worker sends its own heartbeats");
      mo.beats.reset();
    }
  }
  auto member = std::make_unique<Member>(std::move(kv), mo);
  ReduceOptions ro = opt.reduce;
  if (ro.shard_state) ro.home_prefix = "/limbo-zero-" + member->job_tag() + "-";
  Joined j;
  j.rule = std::make_shared<AllReduceUpdate>(nullptr, std::move(optimizer), flat, ro);
  j.membership = std::make_unique<ElasticMembership>(std::move(member), j.rule, std::move(want_leave));
  return j;
}

std::function<bool()> leave_on_signals(const std::vector<int>& chain) {
  static const bool at_fork = [] {
    // A forked child (a DataLoader worker) gets the handlers of before.
    ::pthread_atfork(nullptr, nullptr, [] { put_back(); });
    return true;
  }();
  (void)at_fork;
  struct sigaction sa {};
  sa.sa_sigaction = on_leave_signal;
  sa.sa_flags = SA_SIGINFO;
  for (int i = 0; i < 3; ++i) {
    g_chain[i] = 0;
    for (int c : chain) g_chain[i] = g_chain[i] || c == kLeaveSignals[i];
    ::sigaction(kLeaveSignals[i], &sa, g_installed ? nullptr : &g_before[i]);
  }
  g_installed = 1;
  return [] { return g_leave_requested.load(); };
}

void restore_signals() { put_back(); }

int leave_signal() { return g_last_signal; }

int exit_code_for(int sig) { return sig == SIGUSR1 ? kExitPreempted : 128 + sig; }

}  // namespace limbo::elastic
