// Coordination at scale: the membership coordinator (elastic/coordinator.h)
// against 10, 100 and 1,000 synthetic members, on the embedded store and on
// etcd, side by side. The members are real elastic::Member objects (their
// heartbeat and watch threads, their store connections), in synthetic
// hosts of --per-host members whose heartbeat tables are relayed to the
// coordinator's listener as a launcher relays them (elastic/beats.h); only
// training is left out. For each store and member count it measures:
//   * load: rendezvous calls per second from all clients, the coordinator's
//     poll time and CPU, and (etcd) the etcd server's CPU;
//   * loss to round: a member stops (its threads end, as in a crash) until
//     the coordinator has written the round without it;
//   * round to all: from that write until every other member has seen it.
// Clients, coordinator and store share this machine's cores: the figures
// say where one machine saturates, not a cluster's limit.
//
// usage: limbo_bench_coordination [--members 10,100,1000] [--store both|embedded|etcd]
//        [--losses 3] [--window 3] [--per-host 8] [--heartbeat-timeout 0.4] [--etcd-data DIR] [--json FILE]
#include <signal.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <thread>

#include <nlohmann/json.hpp>

#include "bench_args.h"
#include "comm/etcd.h"
#include "comm/kv_store.h"
#include "comm/store.h"
#include "common/error.h"
#include "common/log.h"
#include "elastic/coordinator.h"
#include "elastic/member.h"

using namespace limbo;
using Clock = std::chrono::steady_clock;

namespace {

std::atomic<int64_t> g_calls{0};

// Counts every call of the rendezvous interface.
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

 private:
  std::shared_ptr<comm::KvStore> s_;
};

double seconds(Clock::duration d) { return std::chrono::duration<double>(d).count(); }

double thread_cpu() {
  timespec ts{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return ts.tv_sec + ts.tv_nsec / 1e9;
}

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

// A single etcd member on loopback for the run.
struct LocalEtcd {
  pid_t pid = -1;
  std::string dir, endpoint;
  explicit LocalEtcd(const std::string& data_root) {
    const int port = 40000 + ::getpid() % 10000;
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
  int members = 0;
  double join_s = 0, calls_per_s = 0, poll_ms = 0, coord_cpu = 0, server_cpu = NAN;
  double loss_to_round = NAN, round_to_all = NAN, loss_to_all = NAN;
  int join_retries = 0, gave_up = 0;  // registrations a slow store failed, and members that never got in
};

void write_json(const std::string& out, const std::vector<Row>& rows);

Row run(const std::string& store, int n, int per_host, int losses, double window, std::chrono::milliseconds hb,
        std::function<std::shared_ptr<comm::KvStore>(std::chrono::milliseconds)> connect, pid_t server_pid) {
  Row row;
  row.store = store;
  row.members = n;
  const std::string job = "bench-" + std::to_string(::getpid()) + "-" + std::to_string(n);
  auto count = [&](std::chrono::milliseconds t) { return std::make_shared<Counting>(connect(t)); };

  elastic::CoordinatorOptions co;
  co.initial_workers = n;
  co.min_workers = 1;
  co.heartbeat_timeout = hb;
  elastic::BeatListener listener("127.0.0.1", "127.0.0.1", "");
  co.beat_address = listener.address();
  elastic::Coordinator coord(count(hb), co, listener.table());

  std::mutex mu;
  elastic::Round latest;
  Clock::time_point latest_at;
  std::vector<double> poll_ms;
  std::atomic<bool> stop{false};
  double coord_cpu = 0;
  std::thread coordinator([&] {
    const double c0 = thread_cpu();
    while (!stop) {
      const auto t = Clock::now();
      try {
        auto r = coord.poll();
        std::lock_guard<std::mutex> lock(mu);
        poll_ms.push_back(1000 * seconds(Clock::now() - t));
        if (r.new_round) {
          latest = r.round;
          latest_at = Clock::now();
        }
      } catch (const std::exception& e) {
        log_warn(std::string("coordinator poll failed: ") + e.what());
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    coord_cpu = thread_cpu() - c0;
  });

  auto shared = count(std::chrono::seconds(30));
  // Synthetic hosts of `per_host` members, each with its heartbeat table and
  // the relay its launcher would run (elastic/beats.h).
  const int hosts = (n + per_host - 1) / per_host;
  std::vector<std::shared_ptr<elastic::LocalBeats>> tables(hosts);
  std::vector<std::unique_ptr<elastic::BeatSender>> relays(hosts);
  for (int h = 0; h < hosts; ++h) {
    tables[h] = elastic::LocalBeats::in_process();
    elastic::BeatSenderOptions bo;
    bo.interval = std::max(std::chrono::milliseconds(10), hb / 4);
    bo.connect = [&, hb] { return count(std::max(hb, std::chrono::milliseconds(1000))); };
    relays[h] = std::make_unique<elastic::BeatSender>(tables[h], bo);
  }
  // Members start concurrently, as a job's workers do (16 at a time).
  std::vector<std::unique_ptr<elastic::Member>> members(n);
  const auto t_join = Clock::now();
  std::atomic<int> next{0}, made{0}, join_retries{0}, gave_up{0};
  std::vector<std::thread> starters;
  for (int t = 0; t < std::min(n, 16); ++t)
    starters.emplace_back([&] {
      for (int i; (i = next++) < n;) {
        elastic::MemberOptions mo;
        mo.connect = [&, hb]() -> std::shared_ptr<comm::KvStore> {
          return count(std::max(hb, std::chrono::milliseconds(1000)));
        };
        mo.watch_wait = store == "etcd" ? std::chrono::milliseconds(1000) : std::chrono::milliseconds(200);
        if (store == "etcd") mo.cut_off_after = std::chrono::seconds(10);
        mo.beats = tables[i / per_host];
        mo.beat_slot = i % per_host;
        // A store slow to answer under load (etcd's 400 ms on a busy
        // machine) fails a registration with PeerFailure: the member
        // registers again on a new connection, as a worker its launcher
        // restarts would, up to 5 times; retries and give-ups are reported.
        for (int attempt = 1; !members[i]; ++attempt) {
          try {
            members[i] = std::make_unique<elastic::Member>(attempt == 1 ? shared : mo.connect(), mo);
          } catch (const Error& e) {
            join_retries += 1;
            if (attempt == 5) {
              gave_up += 1;
              std::fprintf(stderr, "%s: member %d not registered after 5 tries: %s\n", store.c_str(), i, e.what());
              break;
            }
            std::this_thread::sleep_for(std::chrono::milliseconds(200 * attempt));
          }
        }
        if (!members[i]) continue;
        if (++made % 100 == 0)
          std::fprintf(stderr, "%s: %d of %d members registered (%.1f s)\n", store.c_str(), made.load(), n,
                       seconds(Clock::now() - t_join));
      }
    });
  for (auto& t : starters) t.join();
  members.erase(std::remove(members.begin(), members.end(), nullptr), members.end());  // those that gave up
  // Until the first round holds everyone.
  while (true) {
    {
      std::lock_guard<std::mutex> lock(mu);
      if (static_cast<int>(latest.members.size()) == n - gave_up.load()) break;
    }
    if (seconds(Clock::now() - t_join) > 300) {
      std::fprintf(stderr, "%s, %d members: no round with all of them after 300 s\n", store.c_str(), n);
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  row.join_s = seconds(Clock::now() - t_join);
  row.join_retries = join_retries.load();
  row.gave_up = gave_up.load();
  if (row.join_retries > 0)
    std::fprintf(stderr, "%s, %d members: %d registrations retried, %d given up\n", store.c_str(), n,
                 row.join_retries, row.gave_up);

  // Steady state: the load.
  {
    std::lock_guard<std::mutex> lock(mu);
    poll_ms.clear();
  }
  const int64_t calls0 = g_calls.load();
  const double server0 = server_pid > 0 ? process_cpu(server_pid) : 0;
  const auto w0 = Clock::now();
  std::this_thread::sleep_for(std::chrono::duration<double>(window));
  const double w = seconds(Clock::now() - w0);
  row.calls_per_s = (g_calls.load() - calls0) / w;
  if (server_pid > 0) row.server_cpu = (process_cpu(server_pid) - server0) / w;
  {
    std::lock_guard<std::mutex> lock(mu);
    row.poll_ms = median(poll_ms);
  }

  // Losses: one member's threads stop; the others must see the new round.
  std::vector<double> to_round, to_all, total;
  for (int l = 0; l < losses && members.size() > 1; ++l) {
    int64_t before;
    {
      std::lock_guard<std::mutex> lock(mu);
      before = latest.number;
    }
    const auto t0 = Clock::now();
    std::thread([m = std::move(members.back())]() mutable { m.reset(); }).detach();
    members.pop_back();
    Clock::time_point written{};
    while (seconds(Clock::now() - t0) < 60) {
      {
        std::lock_guard<std::mutex> lock(mu);
        if (latest.number > before && static_cast<int>(latest.members.size()) == static_cast<int>(members.size())) {
          written = latest_at;
          break;
        }
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    if (written == Clock::time_point{}) break;
    const int64_t k = latest.number;
    while (seconds(Clock::now() - t0) < 60) {
      bool all = true;
      for (auto& m : members) all = all && m->newer_round(k - 1);
      if (all) break;
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    const auto seen = Clock::now();
    to_round.push_back(seconds(written - t0));
    to_all.push_back(seconds(seen - written));
    total.push_back(seconds(seen - t0));
    std::this_thread::sleep_for(std::chrono::milliseconds(500));
  }
  row.loss_to_round = median(to_round);
  row.round_to_all = median(to_all);
  row.loss_to_all = median(total);
  const auto t_cpu = Clock::now();
  stop = true;
  coordinator.join();
  row.coord_cpu = coord_cpu / seconds(t_cpu - t_join);
  members.clear();
  relays.clear();
  return row;
}

}  // namespace

int main(int argc, char** argv) {
  bench::BenchArgs args(argc, argv,
                        "[--members 10,100,1000] [--store both|embedded|etcd] [--losses 3] [--window 3] "
                        "[--per-host 8] [--heartbeat-timeout 0.4] [--etcd-data DIR] [--json FILE]",
                        {"--members", "--store", "--losses", "--per-host", "--window", "--heartbeat-timeout", "--etcd-data",
                         "--json"});
  std::vector<int> sizes;
  for (double m : args.numbers("--members", {10, 100, 1000})) sizes.push_back(static_cast<int>(m));
  const std::string which = args.text("--store", "both");
  if (which != "both" && which != "embedded" && which != "etcd") {
    std::fprintf(stderr, "--store must be both, embedded or etcd, not '%s'\n", which.c_str());
    return 2;
  }
  const int losses = static_cast<int>(args.integer("--losses", 3));
  const int per_host = static_cast<int>(args.integer("--per-host", 8));
  if (per_host < 1 || per_host > elastic::LocalBeats::kSlots) {
    std::fprintf(stderr, "--per-host must be 1 to %d\n", elastic::LocalBeats::kSlots);
    return 2;
  }
  const double window = args.number("--window", 3);
  const auto hb = std::chrono::milliseconds(static_cast<int64_t>(1000 * args.number("--heartbeat-timeout", 0.4)));
  set_log_level(LogLevel::Warn);
  rlimit r{};
  if (::getrlimit(RLIMIT_NOFILE, &r) == 0) {
    r.rlim_cur = r.rlim_max;
    ::setrlimit(RLIMIT_NOFILE, &r);
  }
  std::vector<Row> rows;
  std::printf("%-9s %7s %8s %10s %8s %9s %10s %10s %10s %10s\n", "store", "members", "join s", "calls/s",
              "poll ms", "coord cpu", "store cpu", "loss>round", "round>all", "loss>all");
  const std::string out = args.text("--json", "");
  auto print = [&](const Row& x) {
    write_json(out, rows);  // after every row: a long run that is stopped keeps what it measured
    std::printf("%-9s %7d %8.2f %10.0f %8.2f %8.1f%% %9.1f%% %9.3fs %9.3fs %9.3fs\n", x.store.c_str(), x.members,
                x.join_s, x.calls_per_s, x.poll_ms, 100 * x.coord_cpu, 100 * x.server_cpu, x.loss_to_round,
                x.round_to_all, x.loss_to_all);
    std::fflush(stdout);
  };
  for (int n : sizes) {
    // The two stores side by side for each size.
    if (which == "both" || which == "embedded") {
      comm::StoreServer server("127.0.0.1", 0);
      const int port = server.port();
      rows.push_back(run("embedded", n, per_host, losses, window, hb,
                         [port](std::chrono::milliseconds t) { return comm::connect_kv_store("127.0.0.1", port, t); }, -1));
      print(rows.back());
    }
    if (which == "both" || which == "etcd") {
      LocalEtcd etcd(args.text("--etcd-data", "/tmp"));
      auto o = comm::parse_etcd_url("etcd://" + etcd.endpoint + "/bench-" + std::to_string(n), "--etcd");
      // Until etcd answers.
      for (int i = 0; i < 100; ++i) {
        try {
          comm::connect_etcd(o, std::chrono::milliseconds(500))->try_get("x");
          break;
        } catch (const std::exception&) {
          std::this_thread::sleep_for(std::chrono::milliseconds(100));
        }
      }
      rows.push_back(run("etcd", n, per_host, losses, window, hb,
                         [o](std::chrono::milliseconds t) { return comm::connect_etcd(o, t); }, etcd.pid));
      print(rows.back());
    }
  }
  return 0;
}

namespace {
void write_json(const std::string& out, const std::vector<Row>& rows) {
  if (!out.empty()) {
    nlohmann::json j = nlohmann::json::array();
    for (const auto& x : rows)
      j.push_back({{"store", x.store}, {"members", x.members}, {"join_s", x.join_s},
                   {"join_retries", x.join_retries}, {"gave_up", x.gave_up}, {"calls_per_s", x.calls_per_s},
                   {"poll_ms", x.poll_ms}, {"coordinator_cpu", x.coord_cpu},
                   {"store_cpu", std::isnan(x.server_cpu) ? nlohmann::json() : nlohmann::json(x.server_cpu)},
                   {"loss_to_round_s", x.loss_to_round}, {"round_to_all_s", x.round_to_all},
                   {"loss_to_all_s", x.loss_to_all}});
    std::ofstream(out) << j.dump(2) << "\n";
  }
}
}  // namespace
