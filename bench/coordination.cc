// Coordination at scale: the membership coordinator (elastic/coordinator.h)
// against 1,000 to 50,000 members, on the embedded store and on etcd, with
// the benchmark's own cost kept apart from what it measures.
//
// Processes (so that each one's CPU is its own):
//   * the store: the embedded StoreServer (this program, --serve-store) or
//     one local etcd member;
//   * the coordinator: a launcher's coordinator and heartbeat listener
//     (this program, --coordinator), polling every 20 ms as a launcher does;
//   * --real real members (default 16), each in its own process (this
//     program, --member): an elastic::Member with its threads and store
//     connections, and the relay of its host's heartbeat table (a host of
//     one worker). They report when they see each round;
//   * this process: the simulated hosts, --per-host members each, driven by
//     a few threads through the real wire protocol: each member's
//     registration is the store calls of Member's constructor on the real
//     client; each host's heartbeats are one datagram an interval in the
//     listener's format with its HMAC under the job secret (as a launcher's
//     relay sends them); and each member's watch of the event log is the
//     real client's call at the rate of its parked wait's expiry (a
//     wait_for that times out every watch_wait, with the safety-net reads
//     every fifth). Beats go from a thread that makes no store call, so a
//     slow store delays no beat.
//
// For each store and member count it reports: join (all registered and in
// one round), calls a second (every client, steady state), the
// coordinator's poll time, the CPU share of the coordinator, the store,
// this driver and the real members (each over the whole run), loss ->
// round (a real member's process SIGKILLed until the coordinator wrote the
// round without it), round -> all (until every real member saw it), and
// rounds that dropped a member nobody killed (false losses: a saturated
// machine).
//
// usage: limbo_bench_coordination [--members 1000,2000] [--store both|embedded|etcd]
//        [--watch host|member] [--losses 3] [--window 3] [--per-host 8] [--real 16] [--threads 3]
//        [--heartbeat-timeout 0.4] [--etcd-data DIR] [--json FILE]
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <mutex>
#include <sstream>
#include <thread>

#include <nlohmann/json.hpp>

#include "bench_args.h"
#include "comm/auth.h"
#include "comm/etcd.h"
#include "comm/kv_store.h"
#include "comm/store.h"
#include "common/error.h"
#include "common/log.h"
#include "elastic/beats.h"
#include "elastic/coordinator.h"
#include "elastic/event_relay.h"
#include "elastic/member.h"

using namespace limbo;
using Clock = std::chrono::steady_clock;

namespace {

const std::string kSecret = "bench-coordination-secret-32-byt";

double seconds(Clock::duration d) { return std::chrono::duration<double>(d).count(); }
double mono_s() { return elastic::monotonic_ns() / 1e9; }

// CPU seconds a process has used (utime + stime from /proc).
double process_cpu(pid_t pid) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/stat");
  std::string s((std::istreambuf_iterator<char>(in)), {});
  const auto close = s.rfind(')');
  if (close == std::string::npos) return 0;
  std::istringstream rest(s.substr(close + 2));
  std::string field;
  double ut = 0, st = 0;
  for (int i = 3; rest >> field; ++i) {
    if (i == 14) ut = std::stod(field);
    if (i == 15) {
      st = std::stod(field);
      break;
    }
  }
  return (ut + st) / static_cast<double>(sysconf(_SC_CLK_TCK));
}

double median(std::vector<double> v) {
  if (v.empty()) return NAN;
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// "HOST:PORT" (the embedded store) or an etcd URL.
std::shared_ptr<comm::KvStore> connect_spec(const std::string& spec, std::chrono::milliseconds t) {
  if (comm::is_etcd_url(spec)) return comm::connect_etcd(comm::parse_etcd_url(spec, "--store"), t);
  const auto colon = spec.rfind(':');
  return comm::connect_kv_store(spec.substr(0, colon), std::stoi(spec.substr(colon + 1)), t);
}

// Every call of the rendezvous interface, counted (per process); each is
// forwarded to the store's own (a wrapper that fell back on KvStore's
// defaults would list prefixes where the store answers with changes).
std::atomic<int64_t> g_calls{0};
class Counting : public comm::KvStore {
 public:
  explicit Counting(std::shared_ptr<comm::KvStore> s) : s_(std::move(s)) {}
  void set(const std::string& k, const std::string& v) override { ++g_calls, s_->set(k, v); }
  std::optional<std::string> try_get(const std::string& k) override { return ++g_calls, s_->try_get(k); }
  int64_t add(const std::string& k, int64_t d) override { return ++g_calls, s_->add(k, d); }
  bool wait_for(const std::string& k, std::chrono::milliseconds t) override { return ++g_calls, s_->wait_for(k, t); }
  std::vector<std::pair<std::string, std::string>> list(const std::string& p) override { return ++g_calls, s_->list(p); }
  std::string compare_set(const std::string& k, const std::string& e, const std::string& d) override {
    return ++g_calls, s_->compare_set(k, e, d);
  }
  bool erase(const std::string& k) override { return ++g_calls, s_->erase(k); }
  int64_t ticket(const std::string& k) override { return ++g_calls, s_->ticket(k); }
  comm::KvChanges changes_since(const std::vector<std::string>& p, int64_t since) override {
    return ++g_calls, s_->changes_since(p, since);
  }
  bool follow(const std::string& p, std::chrono::milliseconds idle, const std::function<bool()>& stop,
              const std::function<void(const std::string&, const std::string&)>& on_write) override {
    return ++g_calls, s_->follow(p, idle, stop, on_write);
  }

 private:
  std::shared_ptr<comm::KvStore> s_;
};

std::shared_ptr<comm::KvStore> counted(const std::string& spec, std::chrono::milliseconds t) {
  return std::make_shared<Counting>(connect_spec(spec, t));
}

// ---------- child processes ----------

// A child running this program with `args`; its stdout comes back on `out`,
// its stdin is `in` (closing it tells a member to end).
struct Child {
  pid_t pid = -1;
  int out = -1, in = -1;
  std::string buffered;
  Child(const std::vector<std::string>& args) {
    int o[2], i[2];
    if (::pipe2(o, O_CLOEXEC) != 0 || ::pipe2(i, O_CLOEXEC) != 0) throw Error("pipe failed");
    // Built before the fork: between fork and exec a child of a threaded
    // process may only make async-signal-safe calls.
    std::string self = "limbo_bench_coordination";
    std::vector<char*> argv{self.data()};
    for (const auto& a : args) argv.push_back(const_cast<char*>(a.c_str()));
    argv.push_back(nullptr);
    pid = ::fork();
    if (pid == 0) {
      ::prctl(PR_SET_PDEATHSIG, SIGKILL);
      ::dup2(o[1], 1);
      ::dup2(i[0], 0);
      ::execv("/proc/self/exe", argv.data());
      ::_exit(127);
    }
    ::close(o[1]);
    ::close(i[0]);
    out = o[0];
    in = i[1];
  }
  // The lines that arrived (non-blocking).
  std::vector<std::string> lines() {
    char buf[4096];
    while (true) {
      pollfd p{out, POLLIN, 0};
      if (::poll(&p, 1, 0) <= 0) break;
      const ssize_t n = ::read(out, buf, sizeof buf);
      if (n <= 0) break;
      buffered.append(buf, static_cast<size_t>(n));
    }
    std::vector<std::string> got;
    for (size_t nl; (nl = buffered.find('\n')) != std::string::npos;) {
      got.push_back(buffered.substr(0, nl));
      buffered.erase(0, nl + 1);
    }
    return got;
  }
  void kill_now() {
    if (pid > 0) ::kill(pid, SIGKILL);
  }
  ~Child() {
    if (in >= 0) ::close(in);
    if (pid > 0) {
      // A member ends when its stdin closes; anything left is killed.
      for (int i = 0; i < 100 && ::waitpid(pid, nullptr, WNOHANG) == 0; ++i)
        std::this_thread::sleep_for(std::chrono::milliseconds(20));
      ::kill(pid, SIGKILL);
      ::waitpid(pid, nullptr, 0);
    }
    if (out >= 0) ::close(out);
  }
};

bool stdin_open() {
  pollfd p{0, POLLIN, 0};
  if (::poll(&p, 1, 0) <= 0) return true;
  char c;
  return ::read(0, &c, 1) > 0;
}

void say(const std::string& line) {
  std::string l = line + "\n";
  if (::write(1, l.data(), l.size()) < 0) ::_exit(0);
}

// --serve-store: the embedded store on an ephemeral port; prints "port P".
int serve_store() {
  rlimit r{};
  if (::getrlimit(RLIMIT_NOFILE, &r) == 0) {
    r.rlim_cur = r.rlim_max;
    ::setrlimit(RLIMIT_NOFILE, &r);
  }
  comm::StoreServer server("127.0.0.1", 0);
  say("port " + std::to_string(server.port()));
  while (stdin_open()) std::this_thread::sleep_for(std::chrono::milliseconds(100));
  return 0;
}

// --coordinator STORE N HB_MS: a launcher's coordinator and listener. Prints
// "round K SIZE T" (T: monotonic seconds of the write), "poll MS" (median
// of the last second) and "calls N".
int coordinator(const std::string& spec, int n, int hb_ms) {
  elastic::CoordinatorOptions co;
  co.initial_workers = n;
  co.min_workers = 1;
  co.heartbeat_timeout = std::chrono::milliseconds(hb_ms);
  elastic::BeatListener listener("127.0.0.1", "127.0.0.1", kSecret);
  co.beat_address = listener.address();
  elastic::Coordinator coord(counted(spec, std::chrono::milliseconds(std::max(hb_ms, 1000))), co, listener.table());
  std::vector<double> polls;
  auto last_report = Clock::now();
  while (stdin_open()) {
    const auto t = Clock::now();
    try {
      auto r = coord.poll();
      polls.push_back(1000 * seconds(Clock::now() - t));
      if (r.new_round) {
        char line[96];
        std::snprintf(line, sizeof line, "round %lld %zu %.6f", static_cast<long long>(r.round.number),
                      r.round.members.size(), mono_s());
        say(line);
      }
    } catch (const std::exception& e) {
      std::fprintf(stderr, "coordinator poll failed: %s\n", e.what());
    }
    if (Clock::now() - last_report > std::chrono::seconds(1)) {
      say("poll " + std::to_string(polls.empty() ? -1.0 : median(polls)) + " calls " + std::to_string(g_calls.load()) + " refused " +
          std::to_string(listener.refused()));
      polls.clear();
      last_report = Clock::now();
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return 0;
}

// --member STORE: one real member, its host's table relayed by a relay of
// its own. Prints "id I", then "seen K T" for each round it learns of,
// and "calls N" once a second.
int member(const std::string& spec, int hb_ms, bool relay_events) {
  const auto t = std::chrono::milliseconds(std::max(hb_ms, 1000));
  auto table = elastic::LocalBeats::in_process();
  const bool etcd = comm::is_etcd_url(spec);
  elastic::BeatSenderOptions bo;
  bo.interval = std::chrono::milliseconds(std::max(10, hb_ms / 4));
  bo.token = kSecret;
  bo.connect = [&] { return counted(spec, t); };
  elastic::MemberOptions mo;
  mo.group.token = kSecret;
  mo.connect = [&]() -> std::shared_ptr<comm::KvStore> { return counted(spec, t); };
  mo.watch_wait = std::chrono::milliseconds(etcd ? 1000 : 200);
  if (etcd) mo.cut_off_after = std::chrono::seconds(10);
  mo.beats = table;
  mo.beat_slot = table->acquire();
  // Loaded: registration starts on the benchmark's word (its clock starts
  // then, not with this process's start).
  say("ready");
  char go[8];
  if (::read(0, go, 3) <= 0) return 0;
  // A launcher's relays run before its workers start.
  elastic::BeatSender relay(table, bo);
  std::unique_ptr<elastic::EventRelay> events;
  if (relay_events)
    events = std::make_unique<elastic::EventRelay>(table, [&] { return counted(spec, t + std::chrono::milliseconds(500)); },
                                                   std::chrono::milliseconds(etcd ? 1000 : 500));
  std::unique_ptr<elastic::Member> m;
  for (int attempt = 1; !m; ++attempt) {
    try {
      m = std::make_unique<elastic::Member>(counted(spec, t), mo);
    } catch (const Error& e) {
      if (attempt == 5) {
        say(std::string("failed ") + e.what());
        return 1;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(200 * attempt));
    }
  }
  say("id " + std::to_string(m->id()));
  int64_t seen = 0;
  auto last_report = Clock::now();
  while (stdin_open()) {
    if (m->newer_round(seen)) {
      // The newest round it knows of (newer_round is a lower bound).
      int64_t k = seen + 1;
      while (m->newer_round(k)) ++k;
      seen = k;
      char line[64];
      std::snprintf(line, sizeof line, "seen %lld %.6f", static_cast<long long>(seen), mono_s());
      say(line);
    }
    if (Clock::now() - last_report > std::chrono::seconds(1)) {
      say("calls " + std::to_string(g_calls.load()));
      last_report = Clock::now();
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  return 0;
}

// ---------- simulated hosts ----------

struct SimHost {
  std::vector<int64_t> ids;       // its members (registered)
  std::vector<int64_t> counters;  // their beat counters
  std::string nonce;              // its relay's
  int64_t seq = 0;
  // The watchers of the event log: its event relay (one), or each member.
  std::vector<int64_t> watched;    // the last event each has seen
  std::vector<int> quiet;
  std::vector<double> next_watch;  // monotonic seconds
  std::atomic<bool> registered{false};
};

// A local etcd member for the run.
struct LocalEtcd {
  pid_t pid = -1;
  std::string dir, endpoint;
  explicit LocalEtcd(const std::string& data_root) {
    // Below the ephemeral range (32768 and up here): the embedded store's
    // run before leaves thousands of client ports there, and one of them
    // taken made etcd fail to bind.
    const int port = 21000 + 2 * (::getpid() % 5000);
    dir = data_root + "/limbo-bench-etcd-" + std::to_string(::getpid());
    endpoint = "127.0.0.1:" + std::to_string(port);
    pid = ::fork();
    if (pid == 0) {
      ::prctl(PR_SET_PDEATHSIG, SIGKILL);  // no etcd left behind if the benchmark dies
      const std::string log = dir + ".log";
      FILE* f = std::fopen(log.c_str(), "w");
      if (f) {
        ::dup2(fileno(f), 1);
        ::dup2(fileno(f), 2);
      }
      const std::string client = "http://" + endpoint, peer = "http://127.0.0.1:" + std::to_string(port + 1);
      ::execl("/usr/bin/etcd", "etcd", "--data-dir", dir.c_str(), "--listen-client-urls", client.c_str(),
              "--advertise-client-urls", client.c_str(), "--listen-peer-urls", peer.c_str(),
              "--initial-advertise-peer-urls", peer.c_str(), "--initial-cluster", ("default=" + peer).c_str(),
              static_cast<char*>(nullptr));
      ::_exit(127);
    }
  }
  ~LocalEtcd() {
    if (pid > 0) {
      ::kill(pid, SIGKILL);
      ::waitpid(pid, nullptr, 0);
    }
    std::filesystem::remove_all(dir);
  }
};

struct Row {
  std::string store;
  int members = 0, real = 0;
  double join_s = NAN, calls_per_s = 0, poll_ms = NAN;
  // CPU shares (of one core) in the steady window, and over the join.
  double coord_cpu = 0, store_cpu = 0, driver_cpu = 0, real_cpu = 0;
  double join_coord_cpu = 0, join_store_cpu = 0, join_driver_cpu = 0;
  double loss_to_round = NAN, round_to_all = NAN, loss_to_all = NAN;
  int false_losses = 0, registration_failures = 0;
};

struct Options {
  std::string watch = "host";  // who watches the event log: each host's relay, or each member
  int per_host = 8, real = 16, threads = 3, losses = 3;
  double window = 3;
  int hb_ms = 400;
};

Row run(const std::string& store, const std::string& spec, pid_t store_pid, int n, const Options& o) {
  Row row;
  row.store = store;
  row.members = n;
  const bool etcd = store == "etcd";
  // A watch's parked wait: the relay's (elastic/launcher.cc; on etcd its
  // stream, reopened after 5 s idle) or a member's own (elastic/join.cc,
  // Member's default).
  const double watch_wait = o.watch == "host" ? (etcd ? 5.0 : 0.5) : (etcd ? 1.0 : 0.2);
  const double beat_interval = std::max(10, o.hb_ms / 4) / 1000.0;
  const auto call_timeout = std::chrono::milliseconds(std::max(o.hb_ms, 1000));
  const int real = std::min(o.real, n);
  row.real = real;
  const int simulated = n - real;
  const int hosts = (simulated + o.per_host - 1) / o.per_host;

  Child coord({"--coordinator", spec, std::to_string(n), std::to_string(o.hb_ms)});
  std::string beat_addr;
  for (int i = 0; i < 500 && beat_addr.empty(); ++i) {
    try {
      if (auto v = connect_spec(spec, call_timeout)->try_get("elastic/beat_addr")) beat_addr = *v;
    } catch (const std::exception&) {
    }
    if (beat_addr.empty()) std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  if (beat_addr.empty()) throw Error("the coordinator did not write its address");
  std::istringstream ba(beat_addr);
  std::string hostport, coord_nonce;
  ba >> hostport >> coord_nonce;
  sockaddr_in listener{};
  listener.sin_family = AF_INET;
  listener.sin_port = htons(static_cast<uint16_t>(std::stoi(hostport.substr(hostport.rfind(':') + 1))));
  listener.sin_addr.s_addr = htonl(INADDR_LOOPBACK);

  // What the coordinator wrote, and what the real members saw.
  struct RoundSeen {
    size_t size = 0;
    double at = 0;
  };
  std::map<int64_t, RoundSeen> rounds;
  std::vector<std::unique_ptr<Child>> reals;
  std::vector<std::map<int64_t, double>> real_seen(real);
  std::vector<int64_t> real_calls(real, 0);
  int64_t coord_calls = 0;
  std::vector<double> poll_ms;
  auto drain = [&] {
    for (auto& line : coord.lines()) {
      std::istringstream in(line);
      std::string what;
      in >> what;
      if (what == "round") {
        int64_t k;
        RoundSeen r;
        in >> k >> r.size >> r.at;
        rounds[k] = r;
      } else if (what == "poll") {
        double ms;
        std::string w;
        in >> ms >> w >> coord_calls;
        if (ms >= 0) poll_ms.push_back(ms);
      }
    }
    for (int i = 0; i < static_cast<int>(reals.size()); ++i) {
      if (!reals[i]) continue;
      for (auto& line : reals[i]->lines()) {
        std::istringstream in(line);
        std::string what;
        in >> what;
        if (what == "seen") {
          int64_t k;
          double at;
          in >> k >> at;
          real_seen[i][k] = at;
        } else if (what == "calls") {
          in >> real_calls[i];
        } else if (what == "failed") {
          std::fprintf(stderr, "real member %d: %s\n", i, line.c_str());
        }
      }
    }
  };

  // The simulated hosts and the threads that drive them.
  std::vector<std::unique_ptr<SimHost>> sim(hosts);
  for (int h = 0; h < hosts; ++h) {
    sim[h] = std::make_unique<SimHost>();
    sim[h]->nonce = "sim" + std::to_string(::getpid()) + "h" + std::to_string(h);
  }
  // The real members' processes, loaded before the clock starts.
  std::vector<int> ready(real, 0);
  for (int i = 0; i < real; ++i)
    reals.push_back(
        std::make_unique<Child>(std::vector<std::string>{"--member", spec, std::to_string(o.hb_ms), o.watch}));
  for (int waited = 0; std::count(ready.begin(), ready.end(), 1) < real && waited < 6000; ++waited) {
    for (int i = 0; i < real; ++i)
      for (auto& l : reals[i]->lines()) ready[i] = ready[i] || l == "ready";
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  // Each process's CPU seconds now (coordinator, store, this driver, the
  // real members).
  auto cpu_now = [&] {
    double rc = 0;
    for (auto& r : reals) rc += process_cpu(r->pid);
    return std::array<double, 4>{process_cpu(coord.pid), store_pid > 0 ? process_cpu(store_pid) : 0,
                                 process_cpu(::getpid()), rc};
  };
  const auto cpu_start = cpu_now();
  std::atomic<bool> stop{false};
  std::atomic<int> registered{0}, failures{0};
  const double t0 = mono_s();
  for (auto& r : reals)
    if (::write(r->in, "go\n", 3) != 3) throw Error("a real member is gone before it started");
  // Store threads: registration, then the watches.
  std::vector<std::thread> workers;
  for (int t = 0; t < o.threads; ++t)
    workers.emplace_back([&, t] {
      std::shared_ptr<comm::KvStore> s;
      auto store_call = [&](auto&& f) {
        for (int attempt = 0;; ++attempt) {
          try {
            if (!s) s = counted(spec, call_timeout);
            return f(*s);
          } catch (const std::exception& e) {
            s.reset();
            ++failures;
            if (attempt == 5 || stop) throw;
            std::this_thread::sleep_for(std::chrono::milliseconds(100 * (attempt + 1)));
          }
        }
      };
      for (int h = t; h < hosts && !stop; h += o.threads) {
        SimHost& host = *sim[h];
        const int count = std::min(o.per_host, simulated - h * o.per_host);
        try {
          for (int w = 0; w < count; ++w) {
            // Member's constructor, call for call.
            const int64_t id = store_call([](comm::KvStore& k) { return k.ticket("elastic/next_id"); });
            store_call([&](comm::KvStore& k) {
              k.set("elastic/host_pid/" + std::to_string(id), "bench-sim:" + std::to_string(h));
              k.try_get("elastic/heartbeat_interval_ms");
              k.try_get("elastic/heartbeat_timeout_ms");
              return 0;
            });
            const int64_t seen = store_call([](comm::KvStore& k) { return k.add("elastic/events", 0); });
            store_call([&](comm::KvStore& k) {
              k.try_get("elastic/round");
              k.try_get("elastic/abort");
              k.set("elastic/join/" + std::to_string(id), "1");
              return 0;
            });
            host.ids.push_back(id);
            host.counters.push_back(0);
            if (o.watch == "member" || host.watched.empty()) {
              host.watched.push_back(seen);
              host.quiet.push_back(0);
              host.next_watch.push_back(mono_s() + watch_wait);
            }
          }
        } catch (const std::exception& e) {
          std::fprintf(stderr, "%s: a simulated host's registration failed: %s\n", store.c_str(), e.what());
          continue;
        }
        host.registered = true;
        if ((registered += count) % 1000 < count)
          std::fprintf(stderr, "%s: %d of %d members registered (%.1f s)\n", store.c_str(), registered.load(), n,
                       mono_s() - t0);
      }
      // The watches of the event log: the calls of EventRelay (one a host)
      // or of Member::watch_loop (one a member), at the rate of their
      // parked wait's expiry (the relay's stream's reopening on etcd). Each
      // wait is the real client's wait_for with a 1 ms timeout: on etcd a
      // new watch on its own connection, on the embedded store a parked
      // wait that expires. (Not simulated: the fan-out of an event to the
      // simulated hosts' open streams on etcd; the real members' relays
      // hold theirs.)
      while (!stop) {
        const double now = mono_s();
        double next = now + 0.05;
        for (int h = t; h < hosts && !stop; h += o.threads) {
          SimHost& host = *sim[h];
          if (!host.registered) continue;
          for (size_t w = 0; w < host.watched.size() && !stop; ++w) {
            if (host.next_watch[w] > now) {
              next = std::min(next, host.next_watch[w]);
              continue;
            }
            try {
              store_call([&](comm::KvStore& k) {
                const std::string key = "elastic/event/" + std::to_string(host.watched[w] + 1);
                if (k.wait_for(key, std::chrono::milliseconds(1))) {
                  k.try_get(key);
                  ++host.watched[w];
                  host.quiet[w] = 0;
                  host.next_watch[w] = now;  // the next event at once
                } else {
                  const bool relay = o.watch == "host";
                  if (relay) k.try_get("elastic/done");
                  if (++host.quiet[w] % 5 == 0) {
                    k.try_get("elastic/round");
                    k.try_get("elastic/abort");
                    if (!relay) k.try_get("elastic/done");
                  }
                  host.next_watch[w] = now + watch_wait;
                }
                return 0;
              });
            } catch (const std::exception&) {
              host.next_watch[w] = now + watch_wait;
            }
          }
        }
        const double wait = next - mono_s();
        if (wait > 0) std::this_thread::sleep_for(std::chrono::duration<double>(std::min(wait, 0.05)));
      }
    });
  // The relays: one datagram per host and interval, from a thread that makes
  // no store call (acknowledgements are read and dropped).
  std::thread beats([&] {
    const int fd = ::socket(AF_INET, SOCK_DGRAM | SOCK_CLOEXEC, 0);
    const int buf = 8 << 20;
    ::setsockopt(fd, SOL_SOCKET, SO_SNDBUF, &buf, sizeof buf);
    std::vector<elastic::LocalBeats::Entry> entries;
    double next = mono_s();
    char ack[512];
    while (!stop) {
      const int64_t now_ns = elastic::monotonic_ns();
      for (auto& hp : sim) {
        SimHost& host = *hp;
        if (!host.registered) continue;
        entries.clear();
        for (size_t w = 0; w < host.ids.size(); ++w)
          entries.push_back({host.ids[w], ++host.counters[w], now_ns});
        const std::string msg = elastic::beat_datagram(kSecret, coord_nonce, host.nonce, ++host.seq, entries.data(),
                                                       entries.size(), now_ns);
        ::sendto(fd, msg.data(), msg.size(), MSG_DONTWAIT, reinterpret_cast<sockaddr*>(&listener), sizeof listener);
      }
      while (::recv(fd, ack, sizeof ack, MSG_DONTWAIT) > 0) {
      }
      next += beat_interval;
      const double left = next - mono_s();
      if (left > 0) std::this_thread::sleep_for(std::chrono::duration<double>(left));
      else next = mono_s();
    }
    ::close(fd);
  });

  auto latest = [&] {
    return rounds.empty() ? std::pair<int64_t, RoundSeen>{0, {}}
                          : std::pair<int64_t, RoundSeen>{rounds.rbegin()->first, rounds.rbegin()->second};
  };
  // Join: until a round holds every member.
  while (true) {
    drain();
    if (latest().second.size == static_cast<size_t>(n)) {
      row.join_s = latest().second.at - t0;
      break;
    }
    if (mono_s() - t0 > 600) {
      std::fprintf(stderr, "%s, %d members: no round with all of them after 600 s (latest has %zu)\n",
                   store.c_str(), n, latest().second.size);
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  auto all_calls = [&] {
    int64_t c = g_calls.load() + coord_calls;
    for (auto x : real_calls) c += x;
    return c;
  };
  std::fprintf(stderr, "%s, %d members: joined in %.2f s\n", store.c_str(), n, row.join_s);
  if (!std::isnan(row.join_s)) {
    // Steady state.
    std::this_thread::sleep_for(std::chrono::seconds(1));
    drain();
    poll_ms.clear();
    const int64_t calls0 = all_calls();
    const double w0 = mono_s();
    const auto cpu_w0 = cpu_now();
    row.join_coord_cpu = (cpu_w0[0] - cpu_start[0]) / (w0 - t0);
    row.join_store_cpu = (cpu_w0[1] - cpu_start[1]) / (w0 - t0);
    row.join_driver_cpu = (cpu_w0[2] - cpu_start[2]) / (w0 - t0);
    std::this_thread::sleep_for(std::chrono::duration<double>(o.window));
    std::this_thread::sleep_for(std::chrono::milliseconds(1100));  // the children's next counts
    drain();
    const auto cpu_w1 = cpu_now();
    const double w = mono_s() - w0;
    row.calls_per_s = (all_calls() - calls0) / w;
    row.coord_cpu = (cpu_w1[0] - cpu_w0[0]) / w;
    row.store_cpu = (cpu_w1[1] - cpu_w0[1]) / w;
    row.driver_cpu = (cpu_w1[2] - cpu_w0[2]) / w;
    row.real_cpu = (cpu_w1[3] - cpu_w0[3]) / w;
    row.poll_ms = median(poll_ms);
    // Losses: a real member's process killed.
    std::vector<double> to_round, to_all, total, kill_at;
    size_t expected = static_cast<size_t>(n);
    for (int l = 0; l < o.losses && l + 1 < real; ++l) {
      drain();
      const int64_t before = latest().first;
      const int victim = real - 1 - l;
      const double killed = mono_s();
      reals[victim]->kill_now();
      kill_at.push_back(killed);
      expected -= 1;
      int64_t k = 0;
      while (mono_s() - killed < 60) {
        drain();
        for (auto it = rounds.upper_bound(before); it != rounds.end(); ++it)
          if (it->second.size == expected) k = it->first;
        if (k) break;
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
      }
      if (!k) break;
      double last = 0;
      bool all = false;
      while (mono_s() - killed < 60 && !all) {
        drain();
        all = true;
        last = 0;
        for (int i = 0; i < real; ++i) {
          if (i >= victim) continue;  // killed
          auto it = real_seen[i].lower_bound(k);
          if (it == real_seen[i].end()) {
            all = false;
            break;
          }
          last = std::max(last, it->second);
        }
        if (!all) std::this_thread::sleep_for(std::chrono::milliseconds(1));
      }
      if (!all) break;
      to_round.push_back(rounds[k].at - killed);
      to_all.push_back(last - rounds[k].at);
      total.push_back(last - killed);
      std::this_thread::sleep_for(std::chrono::milliseconds(500));
    }
    row.loss_to_round = median(to_round);
    row.round_to_all = median(to_all);
    row.loss_to_all = median(total);
    // Rounds after the first full one with fewer members than were alive
    // (n less those killed before it was written).
    for (auto& [k, r] : rounds) {
      if (r.at <= t0 + row.join_s) continue;
      size_t alive = static_cast<size_t>(n);
      for (double at : kill_at) alive -= at < r.at ? 1 : 0;
      if (r.size < alive) row.false_losses += 1;
    }
  }
  stop = true;
  for (auto& w : workers) w.join();
  beats.join();
  drain();
  row.registration_failures = failures.load();
  reals.clear();
  return row;
}

void write_json(const std::string& out, const std::vector<Row>& rows, const Options& o) {
  if (out.empty()) return;
  nlohmann::json j = nlohmann::json::array();
  auto num = [](double x) { return std::isnan(x) ? nlohmann::json() : nlohmann::json(x); };
  for (const auto& x : rows)
    j.push_back({{"store", x.store}, {"members", x.members}, {"real_members", x.real},
                 {"per_host", o.per_host}, {"watch", o.watch}, {"heartbeat_timeout_s", o.hb_ms / 1000.0}, {"join_s", num(x.join_s)},
                 {"calls_per_s", x.calls_per_s}, {"poll_ms", num(x.poll_ms)}, {"coordinator_cpu", x.coord_cpu},
                 {"store_cpu", x.store_cpu}, {"driver_cpu", x.driver_cpu}, {"real_members_cpu", x.real_cpu},
                 {"join_coordinator_cpu", x.join_coord_cpu}, {"join_store_cpu", x.join_store_cpu},
                 {"join_driver_cpu", x.join_driver_cpu},
                 {"loss_to_round_s", num(x.loss_to_round)}, {"round_to_all_s", num(x.round_to_all)},
                 {"loss_to_all_s", num(x.loss_to_all)}, {"false_losses", x.false_losses},
                 {"store_call_failures", x.registration_failures}});
  std::ofstream(out) << j.dump(2) << "\n";
}

}  // namespace

int main(int argc, char** argv) {
  set_log_level(LogLevel::Warn);
  ::signal(SIGPIPE, SIG_IGN);
  if (argc >= 2 && std::string(argv[1]) == "--serve-store") return serve_store();
  if (argc >= 5 && std::string(argv[1]) == "--coordinator")
    return coordinator(argv[2], std::atoi(argv[3]), std::atoi(argv[4]));
  if (argc >= 5 && std::string(argv[1]) == "--member")
    return member(argv[2], std::atoi(argv[3]), std::string(argv[4]) == "host");

  bench::BenchArgs args(argc, argv,
                        "[--members 1000,2000] [--store both|embedded|etcd] [--watch host|member] [--losses 3] "
                        "[--window 3] [--per-host 8] [--real 16] [--threads 3] [--heartbeat-timeout 0.4] "
                        "[--etcd-data DIR] [--json FILE]",
                        {"--members", "--store", "--watch", "--losses", "--per-host", "--real", "--threads",
                         "--window", "--heartbeat-timeout", "--etcd-data", "--json"});
  std::vector<int> sizes;
  for (double m : args.numbers("--members", {1000, 2000})) sizes.push_back(static_cast<int>(m));
  const std::string which = args.text("--store", "both");
  if (which != "both" && which != "embedded" && which != "etcd") {
    std::fprintf(stderr, "--store must be both, embedded or etcd, not '%s'\n", which.c_str());
    return 2;
  }
  Options o;
  o.watch = args.text("--watch", "host");
  if (o.watch != "host" && o.watch != "member") {
    std::fprintf(stderr, "--watch must be host (each host's event relay) or member (each member its own)\n");
    return 2;
  }
  o.losses = static_cast<int>(args.integer("--losses", 3));
  o.per_host = static_cast<int>(args.integer("--per-host", 8));
  o.real = static_cast<int>(args.integer("--real", 16));
  o.threads = static_cast<int>(args.integer("--threads", 3));
  o.window = args.number("--window", 3);
  o.hb_ms = static_cast<int>(1000 * args.number("--heartbeat-timeout", 0.4));
  if (o.per_host < 1 || o.per_host > elastic::kBeatsPerDatagram) {
    std::fprintf(stderr, "--per-host must be 1 to %d\n", elastic::kBeatsPerDatagram);
    return 2;
  }
  if (o.real < 2 || o.threads < 1) {
    std::fprintf(stderr, "--real must be at least 2 (one is lost), --threads at least 1\n");
    return 2;
  }
  for (int n : sizes)
    if (n < o.real) {
      std::fprintf(stderr, "--members must each be at least --real (%d)\n", o.real);
      return 2;
    }
  rlimit r{};
  if (::getrlimit(RLIMIT_NOFILE, &r) == 0) {
    r.rlim_cur = r.rlim_max;
    ::setrlimit(RLIMIT_NOFILE, &r);
  }
  std::vector<Row> rows;
  std::printf("%-9s %7s %8s %9s %8s %7s %7s %7s %7s %10s %9s %8s %5s\n", "store", "members", "join s", "calls/s",
              "poll ms", "coord", "store", "driver", "reals", "loss>round", "round>all", "loss>all", "false");
  const std::string out = args.text("--json", "");
  auto print = [&](const Row& x) {
    write_json(out, rows, o);  // after every row: a long run that is stopped keeps what it measured
    std::printf("%-9s %7d %8.2f %9.0f %8.2f %6.1f%% %6.1f%% %6.1f%% %6.1f%% %9.3fs %8.3fs %7.3fs %5d\n",
                x.store.c_str(), x.members, x.join_s, x.calls_per_s, x.poll_ms, 100 * x.coord_cpu, 100 * x.store_cpu,
                100 * x.driver_cpu, 100 * x.real_cpu, x.loss_to_round, x.round_to_all, x.loss_to_all,
                x.false_losses);
    std::fflush(stdout);
  };
  for (int n : sizes) {
    // The two stores side by side for each size.
    if (which == "both" || which == "embedded") {
      Child server({"--serve-store"});
      std::string port;
      for (int i = 0; i < 500 && port.empty(); ++i) {
        for (auto& l : server.lines())
          if (l.rfind("port ", 0) == 0) port = l.substr(5);
        if (port.empty()) std::this_thread::sleep_for(std::chrono::milliseconds(10));
      }
      if (port.empty()) throw Error("the embedded store did not start");
      rows.push_back(run("embedded", "127.0.0.1:" + port, server.pid, n, o));
      print(rows.back());
    }
    if (which == "both" || which == "etcd") {
      LocalEtcd etcd(args.text("--etcd-data", "/tmp"));
      const std::string url = "etcd://" + etcd.endpoint + "/bench-" + std::to_string(n);
      for (int i = 0; i < 100; ++i) {  // until etcd answers
        try {
          connect_spec(url, std::chrono::milliseconds(500))->try_get("x");
          break;
        } catch (const std::exception&) {
          std::this_thread::sleep_for(std::chrono::milliseconds(100));
        }
      }
      rows.push_back(run("etcd", url, etcd.pid, n, o));
      print(rows.back());
    }
  }
  return 0;
}
