#include "elastic/launcher.h"

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <map>
#include <set>
#include <sstream>
#include <thread>

#include <nlohmann/json.hpp>

#include "comm/collective.h"
#include "comm/kv_store.h"
#include "elastic/coordinator.h"
#include "status/server.h"
#include "common/error.h"
#include "common/log.h"
#include "common/files.h"
#include "common/process.h"
#include "common/timing.h"

namespace limbo::elastic {
namespace {

bool sets_threads(const std::vector<std::string>& args) {
  for (const auto& a : args)
    if (a.rfind("train.threads=", 0) == 0) return true;
  return false;
}

pid_t start_worker(Supervisor& sup, const LaunchOptions& opt, int rank, int threads, const std::string& rdzv) {
  std::vector<std::string> args = {"train"};
  if (threads > 0) args.insert(args.end(), {"--set", "train.threads=" + std::to_string(threads)});
  if (rank > 0) args.insert(args.end(), {"--set", "train.progress=false"});
  args.insert(args.end(), opt.train_args.begin(), opt.train_args.end());
  if (opt.elastic) args.insert(args.end(), {"--dist-rdzv", rdzv, "--elastic"});
  else
    args.insert(args.end(), {"--dist-rdzv", rdzv, "--dist-rank", std::to_string(rank),
                             "--dist-world", std::to_string(opt.nproc)});
  const pid_t pid = sup.start(opt.self_exe, args, "worker", rank);
  log_info("launch: worker rank " + std::to_string(rank) + " pid " + std::to_string(pid));
  return pid;
}

// Adds the workers the launcher killed after training completed to the run's
// summary (written by the member that finished as writer).
void record_killed(const std::string& run_dir, const std::set<pid_t>& pids) {
  if (run_dir.empty()) return;
  const std::string path = run_dir + "/summary.json";
  try {
    auto s = nlohmann::json::parse(read_file(path));
    s["workers_killed_after_training"] = std::vector<pid_t>(pids.begin(), pids.end());
    write_file_atomic(path, s.dump(2) + "\n");
  } catch (const std::exception& e) {
    log_warn(std::string("launch: could not record the killed workers in the summary: ") + e.what());
  }
}

}  // namespace

std::vector<std::pair<double, int>> parse_schedule(const std::string& text) {
  std::vector<std::pair<double, int>> out;
  std::stringstream ss(text);
  for (std::string item; std::getline(ss, item, ',');) {
    auto colon = item.find(':');
    double e = -1;
    int c = 0;
    try {
      if (colon == std::string::npos) throw std::invalid_argument("no colon");
      size_t p1 = 0, p2 = 0;
      e = std::stod(item.substr(0, colon), &p1);
      c = std::stoi(item.substr(colon + 1), &p2);
      if (p1 != colon || p2 != item.size() - colon - 1) throw std::invalid_argument("junk");
    } catch (const std::exception&) {
      throw InvalidInput("--elastic-schedule: '" + item + "' is not EPOCH:WORKERS (e.g. \"0:1,5:4,10:2\")");
    }
    if (e < 0 || c < 1 || (!out.empty() && e <= out.back().first))
      throw InvalidInput("--elastic-schedule: epochs must ascend from >= 0 and counts be >= 1, got '" +
                         text + "'");
    out.emplace_back(e, c);
  }
  if (out.empty()) throw InvalidInput("--elastic-schedule is empty");
  return out;
}

int launch(const LaunchOptions& opt_in) {
  LaunchOptions opt = opt_in;
  if (!opt.schedule.empty()) {
    opt.elastic = true;
    if (opt.schedule.front().first == 0) opt.nproc = opt.schedule.front().second;
    int most = opt.nproc;
    for (const auto& [e, c] : opt.schedule) most = std::max(most, c);
    opt.max_workers = std::max(opt.max_workers == (1 << 20) ? 0 : opt.max_workers, most);
    if (opt.cores == 0)  // split the cores for the largest scheduled count
      opt.cores = std::max(1, static_cast<int>(std::thread::hardware_concurrency()) * opt.nproc / most);
  }
  if (opt.nproc < 1) throw InvalidInput("--nproc must be >= 1, got " + std::to_string(opt.nproc));
  if (opt.self_exe.empty()) throw InvalidInput("launch: the limbo binary path is unknown");
  int port = opt.rdzv_port;
  // The launcher on the machine that owns the rendezvous address hosts the
  // store and the coordinator; launchers on other machines (same --rdzv)
  // only start workers, which join through that coordinator.
  std::shared_ptr<void> store;
  const bool hosting = comm::is_local_address(opt.rdzv_host);
  if (hosting) {
    store = comm::host_store(opt.rdzv_host, &port, opt.store_timeout);
  } else {
    if (!opt.elastic || port == 0)
      throw InvalidInput("--rdzv " + opt.rdzv_host + " is not an address of this machine; to join "
                         "a job hosted elsewhere give its port and run elastic (--min-workers)");
    log_info("launch: joining the job whose rendezvous store is at " + opt.rdzv_host + ":" +
             std::to_string(port));
  }
  const std::string rdzv = opt.rdzv_host + ":" + std::to_string(port);
  int cores = opt.cores > 0 ? opt.cores : static_cast<int>(std::thread::hardware_concurrency());
  int threads = sets_threads(opt.train_args) ? 0 : std::max(1, cores / opt.nproc);
  log_info("launch: rendezvous store at " + rdzv + ", " + std::to_string(opt.nproc) +
           " workers" + (threads ? ", " + std::to_string(threads) + " threads each" : ""));

  Supervisor sup;  // records SIGINT / SIGTERM; the loop below decides what workers get

  std::unique_ptr<Coordinator> coordinator;
  std::shared_ptr<comm::KvStore> kv;
  if (opt.elastic) kv = comm::connect_kv_store(opt.rdzv_host, port, opt.store_timeout);
  if (opt.elastic && hosting) {
    CoordinatorOptions co;
    co.min_workers = opt.min_workers;
    co.max_workers = opt.max_workers;
    co.initial_workers = opt.nproc;
    co.heartbeat_timeout = opt.heartbeat_timeout;
    co.rendezvous_timeout = opt.rendezvous_timeout;
    coordinator = std::make_unique<Coordinator>(kv, co);
  }
  char hostname[256] = {0};
  ::gethostname(hostname, sizeof hostname - 1);
  // The worker id of a child of this launcher, from the id's host:pid key.
  auto worker_id_of = [&](pid_t pid) -> int64_t {
    const std::string want = std::string(hostname) + ":" + std::to_string(pid);
    int64_t n = kv->add("elastic/next_id", 0);
    for (int64_t id = 1; id <= n; ++id)
      if (kv->try_get("elastic/host_pid/" + std::to_string(id)) == want) return id;
    return 0;
  };
  // How the job ends (each exit code other than 0 has one rule, logged):
  //   training completed (elastic/done, or a fixed-membership worker ended
  //   with 0)                                   -> 0, whatever else happened
  //   the launcher got SIGINT / SIGTERM         -> 128 + signal, no restart
  //   below the minimum past the timeout        -> 4 (timeout)
  //   a fixed-membership worker failed          -> its exit code
  //   every elastic worker gone before training completed: restart from the
  //   checkpoint (at most max_restarts); then   -> the last failure's code
  bool training_done = false;
  Clock::time_point done_at;
  std::set<pid_t> killed_after_done;
  int user_signal = 0;
  std::string exit_reason;
  auto last_done_check = Clock::now() - std::chrono::seconds(1);

  std::set<pid_t> terminating;   // SIGTERMed by the schedule
  int next_index = opt.nproc;
  for (int r = 0; r < opt.nproc; ++r) start_worker(sup, opt, r, threads, rdzv);

  int result = 0;
  bool stopping = false;
  // Elastic: when every worker is gone without finishing, start the job again
  // from the run directory's last checkpoint (a few times at most).
  std::string run_dir;
  for (size_t i = 0; i + 1 < opt.train_args.size(); ++i)
    if (opt.train_args[i] == "--run-dir") run_dir = opt.train_args[i + 1];
  // The job's status page (on the launcher that hosts the job). status.url
  // is written once the run directory exists (a refused config writes nothing).
  std::unique_ptr<status::Server> page;
  bool url_written = false;
  if (!opt.status.empty() && hosting) {
    auto [host, port] = status::parse_address(opt.status, "--status");
    page = std::make_unique<status::Server>(std::make_shared<status::Board>(opt.elastic ? "elastic" : "sync"), host,
                                            port);
    if (!run_dir.empty()) page->watch(run_dir + "/metrics.jsonl");
    if (!opt.elastic) page->board().member_event(opt.nproc, "start", "fixed membership");
    log_info("launch: status page at " + page->url());
  }
  int restarts = 0;
  for (;;) {
  while (sup.count() > 0) {
    if (page && !url_written && !run_dir.empty() && file_exists(run_dir + "/metrics.jsonl")) {
      page->write_url(run_dir);
      url_written = true;
    }
    if (int sig = sup.take_signal()) {
      // Elastic workers take SIGTERM as "leave cleanly" (the writer
      // checkpoints); the job stops without a restart.
      const int fwd = opt.elastic ? SIGTERM : sig;
      log_info("launch: got signal " + std::to_string(sig) + "; stopping the job (workers get signal " +
               std::to_string(fwd) + ")");
      if (!user_signal) user_signal = sig;
      if (!stopping) {
        stopping = true;
        sup.begin_stop(fwd, opt.kill_grace);  // SIGKILL after the grace period
      } else {
        sup.signal_all(fwd);
      }
    }
    // Members set elastic/done before they leave the group, so a check made
    // after the coordinator saw them leave never misses it.
    auto check_done = [&] {
      if (training_done || !opt.elastic) return training_done;
      last_done_check = Clock::now();
      if (kv->try_get("elastic/done")) {
        training_done = true;
        done_at = Clock::now();
        log_info("launch: training completed");
      }
      return training_done;
    };
    if (seconds_since(last_done_check) > 0.1) check_done();
    if (training_done && opt.elastic && seconds_since(done_at) > 1.0) {
      // Members that completed left the group at once; one that has not
      // left a second later is stopped or hung: it is declared failed.
      for (const auto& [pid, idx] : sup.children()) {
        if (killed_after_done.count(pid)) continue;
        const int64_t id = worker_id_of(pid);
        if (id && kv->try_get("elastic/left/" + std::to_string(id))) continue;
        log_warn("launch: worker pid " + std::to_string(pid) + " (id " + std::to_string(id) +
                 ") did not finish with the others (stopped or hung); killing it");
        sup.signal(pid, SIGKILL);
        killed_after_done.insert(pid);
      }
    }
    if (auto ex = sup.poll()) {
      const pid_t pid = ex->pid;
      const int rank = ex->index;
      const int code = ex->code();
      if (!opt.elastic && code == 0 && !terminating.count(pid)) training_done = true;
      if (opt.elastic) {
        if (coordinator)
          if (int64_t id = worker_id_of(pid)) coordinator->mark_dead(id);
        if (code != 0)
          log_warn("launch: worker (first rank " + std::to_string(rank) + ", pid " +
                   std::to_string(pid) + ") exited with status " + std::to_string(code) +
                   "; the others go on");
        if (code != 0 && !killed_after_done.count(pid) && result == 0) {  // the first rule holds
          result = code;
          exit_reason = "worker pid " + std::to_string(pid) + " exited with status " + std::to_string(code);
        }
        terminating.erase(pid);
        continue;
      }
      if (code != 0) {
        log_warn("launch: worker rank " + std::to_string(rank) + " (pid " + std::to_string(pid) +
                 ") failed with status " + std::to_string(code) + "; stopping the others");
        if (result == 0) {
          result = code;
          exit_reason = "worker rank " + std::to_string(rank) + " failed with status " + std::to_string(code) +
                        " (fixed membership: the job stops)";
        }
        if (!stopping) {
          stopping = true;
          sup.begin_stop(SIGTERM, opt.kill_grace);
        }
      }
      continue;
    }
    if (coordinator && !stopping && !training_done && !opt.schedule.empty()) {
      double progress = 0;
      if (auto p = kv->try_get("elastic/progress")) progress = std::stod(*p);
      int target = opt.nproc;
      for (const auto& [e, c] : opt.schedule)
        if (progress >= e) target = c;
      int active = static_cast<int>(sup.count() - terminating.size());
      if (active != target)
        log_info("launch: schedule at epoch " + std::to_string(progress) + ": " +
                 std::to_string(active) + " -> " + std::to_string(target) + " workers");
      for (; active < target; ++active) start_worker(sup, opt, next_index++, threads, rdzv);
      while (active > target) {
        // The newest workers leave first (SIGTERM: finish the step, leave cleanly).
        pid_t newest = 0;
        int best = -1;
        for (const auto& [pid, idx] : sup.children())
          if (!terminating.count(pid) && idx > best) best = idx, newest = pid;
        if (!newest) break;
        sup.signal(newest, SIGTERM);
        terminating.insert(newest);
        --active;
      }
    }
    if (coordinator && !stopping && !training_done) {
      auto r = coordinator->poll();
      if (r.new_round) {
        log_info("launch: membership round " + std::to_string(r.round.number) + ": workers [" +
                 format_members(r.round.members) + "] (" + r.reason + ")");
        if (page) {
          const std::string kind = r.round.number == 1                    ? "start"
                                   : !r.crashed.empty()                   ? "crash"
                                   : !r.lost.empty()                      ? "hang"
                                   : r.reason.find("left") != std::string::npos   ? "leave"
                                   : r.reason.find("joined") != std::string::npos ? "join"
                                                                                  : "change";
          page->board().member_event(static_cast<int>(r.round.members.size()), kind, r.reason);
        }
      }
      if ((r.fell_below || r.below_minimum_timed_out) && check_done()) continue;
      if (r.fell_below && r.round.number > 0)
        log_warn("launch: " + std::to_string(r.alive) + " workers alive, below the minimum of " +
                 std::to_string(opt.min_workers) + "; waiting up to " +
                 std::to_string(opt.rendezvous_timeout.count() / 1000) + " s for more to join");
      if (r.below_minimum_timed_out) {
        log_warn("launch: only " + std::to_string(r.alive) + " workers alive, below the minimum of " +
                 std::to_string(opt.min_workers) + ", for longer than the rendezvous timeout; "
                 "stopping the job");
        result = kExitTimeout;
        exit_reason = "fewer workers than --min-workers for longer than the rendezvous timeout";
        stopping = true;
        sup.begin_stop(SIGTERM, opt.kill_grace);
      }
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  const std::string ckpt = run_dir + "/checkpoint.pt";
  if (opt.elastic && !training_done && !stopping && restarts < opt.max_restarts &&
      !run_dir.empty() && ::access(ckpt.c_str(), R_OK) == 0) {
    ++restarts;
    log_warn("launch: every worker is gone; restarting the job from " + ckpt + " (restart " +
             std::to_string(restarts) + " of at most " + std::to_string(opt.max_restarts) + ")");
    LaunchOptions again = opt;
    again.train_args.push_back("--resume");
    for (int r = 0; r < opt.nproc; ++r) start_worker(sup, again, next_index++, threads, rdzv);
    result = 0;
    continue;
  }
  break;
  }
  if (training_done) {
    if (!killed_after_done.empty()) record_killed(run_dir, killed_after_done);
    return 0;
  }
  if (user_signal) {
    log_warn("launch: exit code " + std::to_string(128 + user_signal) + ": stopped by signal " +
             std::to_string(user_signal) + " before training completed (resume with --resume)");
    return 128 + user_signal;
  }
  if (result == 0) {
    result = kExitFailure;
    exit_reason = "every worker left before training completed";
  }
  log_warn("launch: exit code " + std::to_string(result) + ": " + exit_reason);
  return result;
}

}  // namespace limbo::elastic
