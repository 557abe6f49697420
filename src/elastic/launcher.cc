#include "elastic/launcher.h"
#include "elastic/launch_job.h"
#include "elastic/workers.h"
#include "elastic/shards.h"

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <filesystem>
#include <functional>
#include <map>
#include <optional>
#include <set>
#include <sstream>
#include <thread>

#include <nlohmann/json.hpp>

#include "comm/collective.h"
#include "comm/kv_store.h"
#include "comm/shm_group.h"
#include "elastic/coordinator.h"
#include "elastic/election.h"
#include "elastic/member.h"
#include "status/server.h"
#include "common/error.h"
#include "common/log.h"
#include "common/throttled_log.h"
#include "common/files.h"
#include "common/process.h"
#include "common/timing.h"


namespace limbo::elastic {

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

Job::Job(LaunchOptions opt) : opt_(std::move(opt)) {
  port_ = opt_.rdzv_port;
  hosting_ = !opt_.etcd && comm::is_local_address(opt_.rdzv_host);
  if (opt_.etcd) {
    if (!opt_.elastic)
      throw InvalidInput("--rdzv " + opt_.etcd->url() + ": an etcd rendezvous is for elastic jobs (add --min-workers)");
    log_info("launch: joining job '" + opt_.etcd->job + "' through etcd at " + opt_.etcd->url());
  } else if (hosting_) {
    try {
      store_ = comm::host_store(opt_.rdzv_host, &port_, opt_.token);
    } catch (const Error& e) {
      if (port_ == 0) throw;
      // A port taken (another job's store: two Slurm jobs whose derived
      // ports collide) is said, never joined silently.
      throw InvalidInput("cannot host the rendezvous store on " + opt_.rdzv_host + ":" + std::to_string(port_) +
                         " (" + e.what() + "); another job's store may hold the port (under Slurm it is 29400 + "
                         "job id mod 1000): give --rdzv HOST:PORT with a free port");
    }
  } else {
    if (!opt_.elastic || port_ == 0)
      throw InvalidInput("--rdzv " + opt_.rdzv_host + " is not an address of this machine; to join "
                         "a job hosted elsewhere give its port and run elastic (--min-workers)");
    log_info("launch: joining the job whose rendezvous store is at " + opt_.rdzv_host + ":" +
             std::to_string(port_));
  }
  if (hosting_ && opt_.token.empty() && opt_.rdzv_host != "127.0.0.1" && opt_.rdzv_host != "localhost")
    log_warn("launch: the rendezvous store on " + opt_.rdzv_host + " takes anyone who reaches it; give every "
             "launcher --token-file FILE (docs/elastic.md, \"Security\")");
  rdzv_ = opt_.etcd ? opt_.etcd->url() : opt_.rdzv_host + ":" + std::to_string(port_);
  threads_ = threads_per_worker(opt_.train_args, opt_.cores, opt_.nproc);
  log_info("launch: rendezvous store at " + rdzv_ + ", " + std::to_string(opt_.nproc) + " workers" +
           (threads_ ? ", " + std::to_string(threads_) + " threads each" : ""));
  for (size_t i = 0; i + 1 < opt_.train_args.size(); ++i)
    if (opt_.train_args[i] == "--run-dir") run_dir_ = opt_.train_args[i + 1];
  if (!run_dir_.empty()) {
    try {
      make_dirs(run_dir_);
      char tag[24];
      std::snprintf(tag, sizeof tag, "%016zx", std::hash<std::string>{}(comm::host_identity()));
      start_marker_ = run_dir_ + "/.launch-" + tag + "-" + std::to_string(::getpid());
      write_file_atomic(start_marker_, "");
    } catch (const Error& e) {
      start_marker_.clear();  // the workers report an unwritable run directory themselves
    }
  }
  if (opt_.elastic) {
    // Short calls: a store out of reach must not stall this loop; the
    // loss clock (--rdzv-timeout) decides when it counts as lost.
    const auto call_timeout = opt_.heartbeat_timeout;
    // (The first connection only waits, up to --rdzv-timeout, for a store
    // that is still starting on another host.)
    if (opt_.etcd) {
      // The first call may wait for etcd (a cluster still starting), up to
      // --rdzv-timeout; the later ones are short.
      auto first = comm::connect_etcd(*opt_.etcd, opt_.rendezvous_timeout);
      if (first->try_get("elastic/done"))
        throw InvalidInput("job '" + opt_.etcd->job + "' in etcd at " + opt_.etcd->url() +
                           " has already completed (its completion is kept for an hour); give this job another "
                           "name, or delete the old one's keys "
                           "(etcdctl del --prefix " + opt_.etcd->prefix() + ")");
      kv_ = comm::connect_etcd(*opt_.etcd, call_timeout);
      launcher_id_ = first->add("elastic/launchers", 1);
      char host[256] = {0};
      ::gethostname(host, sizeof host - 1);
      election_ = std::make_unique<Election>(*opt_.etcd, "launcher " + std::to_string(launcher_id_) + " on " + host,
                                             opt_.heartbeat_timeout);
    } else {
      comm::connect_kv_store(opt_.rdzv_host, port_, hosting_ ? call_timeout : opt_.rendezvous_timeout, opt_.token);
      kv_ = comm::connect_kv_store(opt_.rdzv_host, port_, call_timeout, opt_.token);
      check_job_name();
      launcher_id_ = kv_->add("elastic/launchers", 1);
    }
  }
  if (opt_.elastic) {
    beats_table_ = LocalBeats::create();
    BeatSenderOptions bo;
    bo.interval = std::max(std::chrono::milliseconds(10), opt_.heartbeat_timeout / 4);
    bo.token = opt_.token;
    const auto t = opt_.heartbeat_timeout;
    if (opt_.etcd) bo.connect = [e = *opt_.etcd, t] { return comm::connect_etcd(e, t); };
    else bo.connect = [h = opt_.rdzv_host, p = port_, t, k = opt_.token] { return comm::connect_kv_store(h, p, t, k); };
    relay_ = std::make_unique<BeatSender>(beats_table_, bo);
    // One watch of the event log for all of this host's workers (a parked
    // wait is answered by its deadline, the heartbeat timeout on top).
    const auto wait = std::chrono::milliseconds(opt_.etcd ? 1000 : 500);
    std::function<std::shared_ptr<comm::KvStore>()> connect;
    if (opt_.etcd) connect = [e = *opt_.etcd, t] { return comm::connect_etcd(e, t); };
    else connect = [h = opt_.rdzv_host, p = port_, t, k = opt_.token] { return comm::connect_kv_store(h, p, t, k); };
    event_relay_ = std::make_unique<EventRelay>(beats_table_, connect, wait);
  }
  if (opt_.elastic && hosting_) make_coordinator();
  // Every launcher of an elastic job serves the whole job's page: rank 0
  // publishes its metrics records in the rendezvous (a ring the launchers
  // read), so no page depends on which host holds the run directory.
  if (!opt_.status.empty() && (hosting_ || opt_.elastic)) {
    auto [host, port] = status::parse_address(opt_.status, "--status");
    page_ = std::make_unique<status::Server>(std::make_shared<status::Board>(opt_.elastic ? "elastic" : "sync"),
                                             host, port);
    if (!run_dir_.empty() && !opt_.elastic) page_->watch(run_dir_ + "/metrics.jsonl");
    if (!opt_.elastic) page_->board().member_event(opt_.nproc, "start", "fixed membership");
    log_info("launch: status page at " + page_->url());
  }
}

void Job::make_coordinator() {
  CoordinatorOptions co;
  co.min_workers = opt_.min_workers;
  co.max_workers = opt_.max_workers;
  co.initial_workers = opt_.start_workers > 0 ? opt_.start_workers : opt_.nproc;
  co.heartbeat_timeout = opt_.heartbeat_timeout;
  co.rendezvous_timeout = opt_.rendezvous_timeout;
  std::shared_ptr<comm::KvStore> store = kv_;
  if (election_)  // every write holds only while this launcher holds the election's key
    store = comm::connect_etcd(*opt_.etcd, opt_.heartbeat_timeout,
                               std::make_pair(std::string(Election::kKey), election_->fence_value()));
  // The heartbeats come to this launcher: on the store's address when it
  // hosts the store, else on its own address towards etcd.
  // Under etcd, an address the other hosts reach: not the route towards a
  // local endpoint, which is loopback.
  std::string host = opt_.rdzv_host;
  if (opt_.etcd) {
    std::vector<std::string> hosts;
    for (const auto& ep : opt_.etcd->endpoints) hosts.push_back(ep.substr(0, ep.rfind(':')));
    host = comm::reachable_address(hosts);
  }
  auto listener = std::make_unique<BeatListener>(host, host, opt_.token);
  co.beat_address = listener->address();
  coordinator_ = std::make_unique<Coordinator>(store, co, listener->table());
  listener_ = std::move(listener);
}

void Job::elect() {
  if (!election_) return;
  const bool lead = election_->leading();
  if (!lead && coordinator_) {
    coordinator_.reset();
    listener_.reset();  // senders find the new coordinator's address
    log_warn("launch: stopped coordinating (another launcher took over)");
  }
  if (lead && !coordinator_) {  // in the ending too: it watches the members that write the final files
    try {
      make_coordinator();
      const auto& r = coordinator_->current();
      log_info("launch: coordinating from round " + std::to_string(r.number) + " (workers [" +
               format_members(r.members) + "])");
    } catch (const comm::FencedOut& e) {
      election_->step_down(e.what());
    } catch (const Error& e) {
      poll_errors_.warn(std::string("launch: could not start coordinating (") + e.what() + "); retrying");
    }
  }
}

void Job::start_worker(int index, bool resume) {
  LaunchOptions o = opt_;
  if (resume && std::find(o.train_args.begin(), o.train_args.end(), "--resume") == o.train_args.end())
    o.train_args.push_back("--resume");
  std::vector<std::string> env;
  const int slot = beats_table_ ? beats_table_->acquire() : -1;
  if (slot >= 0) env.push_back("LIMBO_BEAT_SLOT=" + beats_table_->name() + ":" + std::to_string(slot));
  const pid_t pid = spawn_worker(sup_, o, index, threads_, rdzv_, env);
  if (slot >= 0) slot_of_[pid] = slot;
}

int Job::run() {
  if (opt_.elastic) {
    // What an earlier launcher on this host, killed before it could, left
    // in /dev/shm (not this job's: a launcher rejoining a running job may
    // have its workers' homes to hand on).
    std::optional<std::string> tag;
    with_store([&] { tag = kv_->try_get("elastic/job_tag"); });
    if (const int n = remove_orphaned_homes(tag.value_or("")))
      log_info("launch: removed " + std::to_string(n) + " shard homes that ended jobs left in /dev/shm");
  }
  for (next_index_ = 0; next_index_ < opt_.nproc; ++next_index_) start_worker(next_index_, false);
  while (!finished()) {
    while (int sig = sup_.take_signal()) on_signal(sig);
    while (auto ex = sup_.poll()) on_exit(*ex);
    if (sup_.count() == 0 && phase_ != Phase::Completing && phase_ != Phase::Stopping && phase_ != Phase::Lost)
      on_all_gone();
    if (!finished()) tick();
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return finish();
}


void Job::enter(Phase p, const std::string& why) {
  if (p == phase_) return;
  log_info(std::string("launch: ") + phase_name(phase_) + " -> " + phase_name(p) + " (" + why + ")");
  phase_ = p;
  // Cut off from the job: the event relay's call in progress may wait out
  // its time; it ends during the workers' grace period, not at exit.
  if (p == Phase::Lost && event_relay_) event_relay_->request_stop();
}

bool Job::with_store(const std::function<void()>& f) {
  if (!kv_) return false;
  try {
    f();
    last_contact_ = Clock::now();
    return true;
  } catch (const PeerFailure& e) {
    last_store_error_ = e.what();
  } catch (const Timeout& e) {
    last_store_error_ = e.what();
  }
  return false;
}

int64_t Job::worker_id_of(pid_t pid) {
  const std::string want = process_key(pid);
  int64_t found = 0;
  with_store([&] {
    const std::string prefix = "elastic/host_pid/";
    for (const auto& [key, value] : kv_->list(prefix))
      if (value == want) found = std::strtoll(key.c_str() + prefix.size(), nullptr, 10);  // 0 when not a number
  });
  return found;
}

// The hosting launcher writes the job's name into its store; any other
// launcher that has a name refuses a store that holds another (two Slurm
// jobs whose derived ports collide on a shared first node would otherwise
// meet in one store, and a token shared between jobs does not tell them
// apart).
void Job::check_job_name() {
  if (hosting_) {
    kv_->set("elastic/job_name", opt_.job_name);
    return;
  }
  if (opt_.job_name.empty()) return;
  const auto theirs = kv_->try_get("elastic/job_name");
  if (theirs && !theirs->empty() && *theirs != opt_.job_name)
    throw InvalidInput("the rendezvous store at " + opt_.rdzv_host + ":" + std::to_string(port_) +
                       " belongs to job '" + *theirs + "', not to this launcher's job '" + opt_.job_name +
                       "' (two jobs on one address: under Slurm the port is 29400 + job id mod 1000 on the first "
                       "node; give one of them --rdzv HOST:PORT)");
}

void Job::on_signal(int sig, bool relayed) {
  // Elastic workers take SIGTERM as "leave cleanly" (the writer
  // checkpoints); the job stops without a restart. SIGUSR1 (Slurm's warning
  // ahead of preemption) reaches the workers as SIGTERM too.
  const int fwd = opt_.elastic || sig == SIGUSR1 ? SIGTERM : sig;
  log_info((relayed ? "launch: the hosting launcher got signal " + std::to_string(sig) + " and stops the job"
                    : "launch: got signal " + std::to_string(sig)) +
           "; stopping the job (workers get signal " + std::to_string(fwd) + ")");
  if (!user_signal_) user_signal_ = sig;
  if (sig == SIGUSR1 && warned_at_ == Clock::time_point{}) warned_at_ = Clock::now();
  // Training may have completed a moment ago, before this launcher's next
  // look at the store (it looks every 0.1 s): it looks now, so that a
  // warning in the ending is taken as one.
  if (opt_.elastic && sig == SIGUSR1 && !relayed && phase_ != Phase::Completing && phase_ != Phase::Stopping &&
      phase_ != Phase::Lost)
    poll_store(true);
  if (phase_ == Phase::Completing && sig == SIGUSR1) {
    // Training completed: what is left (the final evaluation, checkpoint
    // and summary) takes seconds and the warning gives the job its time, so
    // the ending goes on; killing the writer in it would lose the result.
    log_info("launch: training has completed; its ending (final evaluation, checkpoint and summary) goes on "
             "through Slurm's warning");
    return;
  }
  if (phase_ == Phase::Stopping || phase_ == Phase::Lost) sup_.signal_all(fwd);
  else if (phase_ == Phase::Completing) sup_.begin_stop(fwd, opt_.kill_grace);  // training completed: still 0
  else {
    warned_stop_ = sig == SIGUSR1;
    stop(128 + sig, "stopped by signal " + std::to_string(sig), fwd);
    if (opt_.elastic && hosting_) {
      // The store goes with this launcher, so the whole job stops: the
      // other launchers stop their workers too, and the coordinator goes
      // on forming rounds until every member has left (members whose
      // signals come later than the others' leave in rounds of their own;
      // the writer checkpoints in its last).
      with_store([&] { kv_->set("elastic/stop", std::to_string(sig)); });
      if (coordinator_) coordinator_->stopping();
    }
  }
}

void Job::on_exit(const Supervisor::Exit& ex) {
  const int code = ex.code();
  terminating_.erase(ex.pid);
  if (auto it = slot_of_.find(ex.pid); it != slot_of_.end()) {
    beats_table_->release(it->second);
    slot_of_.erase(it);
  }
  if (phase_ == Phase::Completing && !killed_after_done_.count(ex.pid)) finishers_.insert(ex.pid);
  // A worker that died while its group formed may leave a shared-memory
  // segment's name behind (comm/shm_group.h).
  comm::remove_stale_segments();
  if (!opt_.elastic) {
    if (code == 0 && phase_ != Phase::Stopping) return complete("worker rank " + std::to_string(ex.index) + " finished");
    if (code != 0 && phase_ != Phase::Completing && phase_ != Phase::Stopping) {
      log_warn("launch: worker rank " + std::to_string(ex.index) + " (pid " + std::to_string(ex.pid) +
               ") failed with status " + std::to_string(code) + "; stopping the others");
      stop(code, "worker rank " + std::to_string(ex.index) + " failed with status " + std::to_string(code) +
                     " (fixed membership: the job stops)", SIGTERM);
    }
    return;
  }
  // Any launcher's dead worker is known to whichever launcher coordinates.
  // (Not while the store is out of reach: each call would hold this loop
  // for its timeout, and the job is being lost anyway.)
  if (const int64_t id = store_down() ? 0 : worker_id_of(ex.pid)) {
    if (coordinator_) coordinator_->mark_dead(id);
    with_store([&] {
      // A worker that had left when training completed took part in the ending.
      if (!killed_after_done_.count(ex.pid) && kv_->try_get("elastic/left/" + std::to_string(id)) &&
          kv_->try_get("elastic/done"))
        finishers_.insert(ex.pid);
      kv_->set("elastic/dead/" + std::to_string(id), "1");
    });
  }
  if (code != 0)
    log_warn("launch: worker (first rank " + std::to_string(ex.index) + ", pid " + std::to_string(ex.pid) +
             ") exited with status " + std::to_string(code) + "; the others go on");
  if (code != 0 && !killed_after_done_.count(ex.pid) && result_ == 0) {
    result_ = code;
    exit_reason_ = "worker pid " + std::to_string(ex.pid) + " exited with status " + std::to_string(code);
  }
}

// Every worker of this launcher is gone before training completed.
void Job::on_all_gone() {
  bool done = false;
  if (opt_.elastic) with_store([&] { done = kv_->try_get("elastic/done").has_value(); });
  if (done) return complete("training completed");
  // While the job goes on elsewhere (another launcher's workers), new
  // workers rejoin it (state sync gives them the newest state). When every
  // worker of the job is gone, the job restarts from its last checkpoint.
  const std::string ckpt = run_dir_ + "/checkpoint.pt";
  const bool have_ckpt = !run_dir_.empty() && ::access(ckpt.c_str(), R_OK) == 0;
  if (coordinator_) with_store([&] { on_round(coordinator_->poll()); });  // its workers are marked dead by now
  if (phase_ == Phase::Stopping || phase_ == Phase::Completing) return;
  const bool job_lives = opt_.elastic && (!hosting_ || alive_ > 0);
  // Workers that exited with an input error (bad data or config, a run that
  // diverged) would fail again the same way: no restart.
  const bool input_error = result_ == kExitInvalidInput;
  if (opt_.elastic && !input_error && restarts_ < opt_.max_restarts && (have_ckpt || job_lives)) {
    ++restarts_;
    const std::string what = !job_lives ? "every worker is gone; restarting the job from " + ckpt
                                      : "every worker of this launcher is gone; restarting them to rejoin the job" +
                                            (have_ckpt ? " (from " + ckpt + ")" : std::string());
    log_warn("launch: " + what + " (restart " + std::to_string(restarts_) + " of at most " +
             std::to_string(opt_.max_restarts) + ")");
    for (int r = 0; r < opt_.nproc; ++r) start_worker(next_index_++, have_ckpt);
    result_ = 0;
    return enter(Phase::Starting, "workers restarted");
  }
  if (result_ == 0) {
    result_ = kExitFailure;
    exit_reason_ = "every worker left before training completed";
  }
  stop(result_, exit_reason_, SIGTERM);
}


void Job::read_records() {
  if (!page_ || !opt_.elastic || store_down() || seconds_since(last_records_) < 0.5) return;
  last_records_ = Clock::now();
  std::vector<std::pair<int64_t, std::string>> fresh;
  with_store([&] {
    for (const auto& [key, value] : kv_->list("elastic/record/")) {
      const auto space = value.find(' ');
      if (space == std::string::npos) continue;
      try {
        const int64_t n = std::stoll(value.substr(0, space));
        if (n > records_seen_) fresh.emplace_back(n, value.substr(space + 1));
      } catch (const std::exception&) {
      }
    }
  });
  std::sort(fresh.begin(), fresh.end());
  for (const auto& [n, text] : fresh) {
    try {
      page_->board().add_record(nlohmann::json::parse(text));
    } catch (const std::exception&) {
      // not a record (a stray key): skipped
    }
    records_seen_ = n;
  }
}

void Job::tick() {
  elect();
  read_records();
  // Every elastic launcher's page shows the whole job: each names its page
  // in its run directory (`limbo status RUN_DIR` tries them newest first),
  // so a run directory on any host, or shared by all, finds a live one.
  if (page_ && !url_written_ && (keeper() || opt_.elastic) && !run_dir_.empty() &&
      file_exists(run_dir_ + "/metrics.jsonl")) {
    page_->write_url(run_dir_);
    url_written_ = true;
  }
  if (phase_ == Phase::Completing) return complete_tick();
  if (opt_.elastic && phase_ == Phase::Stopping) {
    stopping_tick();
    if (warned_stop_) warned_tick();
    return;
  }
  if (!opt_.elastic || phase_ == Phase::Stopping || phase_ == Phase::Lost) return;
  poll_store();
  if (phase_ == Phase::Completing || phase_ == Phase::Lost) return;
  if (coordinator_)
    with_coordinator([&] {
      apply_schedule();
      on_round(coordinator_->poll());
    });
}

void Job::with_coordinator(const std::function<void()>& f) {
  try {
    f();
  } catch (const comm::FencedOut& e) {
    election_->step_down(e.what());
    coordinator_.reset();
    listener_.reset();
  } catch (const std::exception& e) {
    // A store call that timed out (a starved machine): the next poll, 20 ms
    // later, takes it up again; the coordinator commits nothing half-written.
    poll_errors_.warn(std::string("launch: the coordinator's poll failed (") + e.what() + "); retrying");
  }
}

// Stopping on Slurm's warning while training completes elsewhere (its
// last step was under way, or done before this launcher looked): the
// workers took the SIGTERM in their ending, which goes on, so the scheduled
// SIGKILLs are taken back and the job ends as one that completed (0 once
// the final files are written, 75 if they are not).

void Job::poll_store(bool now) {
  if (!now && seconds_since(last_done_check_) < 0.1) return;
  last_done_check_ = Clock::now();
  bool done = false;
  std::optional<std::string> stopped;
  if (with_store([&] {
        done = kv_->try_get("elastic/done").has_value();
        // The hosting launcher stopped the job (a signal): its store goes.
        if (!done && !hosting_ && !opt_.etcd) stopped = kv_->try_get("elastic/stop");
      })) {
    if (done) complete("training completed (elastic/done)");
    else if (stopped) on_signal(std::atoi(stopped->c_str()), true);
    return;
  }
  // Lost after --rdzv-timeout in all: the workers get SIGTERM a grace
  // period before it and SIGKILL at it.
  const double silent = seconds_since(last_contact_);
  const double limit = opt_.rendezvous_timeout.count() / 1000.0, grace = std::min(1.0, limit / 4);
  if (!hosting_ && silent > limit - grace) {
    result_ = kExitLostJob;
    exit_reason_ = "lost the job: no answer from the rendezvous store at " + rdzv_ + " for " +
                   std::to_string(static_cast<int>(silent)) + " s (" + last_store_error_ + ")";
    log_warn("launch: " + exit_reason_ + "; stopping this host's workers");
    sup_.begin_stop(SIGTERM, std::chrono::milliseconds(static_cast<int64_t>(grace * 1000)));
    enter(Phase::Lost, "cut off from the job");
  }
}

// A member that has not left a second after completion, and whose heartbeat
// stands still, is stopped or hung: it is killed (and recorded). Nothing is
// decided on a store call that failed (a store hiccup must not kill a
// healthy member finishing its final checkpoint). Then this launcher tells
// the hosting one it saw the completion, and waits for its own workers to
// exit, at most --finish-timeout.

void Job::apply_schedule() {
  if (opt_.schedule.empty()) return;
  double progress = 0;
  with_store([&] {
    if (auto p = kv_->try_get("elastic/progress")) progress = std::stod(*p);
  });
  int target = opt_.nproc;
  for (const auto& [e, c] : opt_.schedule)
    if (progress >= e) target = c;
  int active = static_cast<int>(sup_.count() - terminating_.size());
  if (active != target)
    log_info("launch: schedule at epoch " + std::to_string(progress) + ": " + std::to_string(active) + " -> " +
             std::to_string(target) + " workers");
  for (; active < target; ++active) start_worker(next_index_++, false);
  while (active > target) {
    // The newest workers leave first (SIGTERM: finish the step, leave cleanly).
    pid_t newest = 0;
    int best = -1;
    for (const auto& [pid, idx] : sup_.children())
      if (!terminating_.count(pid) && idx > best) best = idx, newest = pid;
    if (!newest) break;
    sup_.signal(newest, SIGTERM);
    terminating_.insert(newest);
    --active;
  }
}

void Job::on_round(const Coordinator::Result& r) {
  alive_ = r.alive;
  if (r.new_round) {
    log_info("launch: membership round " + std::to_string(r.round.number) + ": workers [" +
             format_members(r.round.members) + "] (" + r.reason + ")");
    enter(Phase::Running, "round " + std::to_string(r.round.number));
    if (page_) {
      const std::string kind = r.round.number == 1                                ? "start"
                               : !r.crashed.empty()                               ? "crash"
                               : !r.lost.empty()                                  ? "hang"
                               : r.reason.find("left") != std::string::npos       ? "leave"
                               : r.reason.find("joined") != std::string::npos     ? "join"
                                                                                  : "change";
      page_->board().member_event(static_cast<int>(r.round.members.size()), kind, r.reason);
    }
  }
  if (r.fell_below || r.below_minimum_timed_out) {
    // Members that completed leave the group: not a shortage. (They set
    // elastic/done before they leave, so this check cannot miss it.)
    bool done = false;
    with_store([&] { done = kv_->try_get("elastic/done").has_value(); });
    if (done) return complete("training completed");
  }
  if (r.fell_below && r.round.number > 0) {
    log_warn("launch: " + std::to_string(r.alive) + " workers alive, below the minimum of " +
             std::to_string(opt_.min_workers) + "; waiting up to " +
             std::to_string(opt_.rendezvous_timeout.count() / 1000) + " s for more to join");
    enter(Phase::Reforming, "below the minimum");
  }
  if (r.below_minimum_timed_out) {
    log_warn("launch: only " + std::to_string(r.alive) + " workers alive, below the minimum of " +
             std::to_string(opt_.min_workers) + ", for longer than the rendezvous timeout; stopping the job");
    stop(kExitTimeout, "fewer workers than --min-workers for longer than the rendezvous timeout", SIGTERM);
  }
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
      opt.cores = std::max(1, usable_cores() * opt.nproc / most);
    // The schedule counts this launcher's workers; a job of several hosts
    // gives its whole size with --max-workers (or its first round would
    // wait for more workers than the job takes, for ever).
    if (opt.start_workers > opt.max_workers)
      throw InvalidInput("--start-workers " + std::to_string(opt.start_workers) + " exceeds the job's most workers, " +
                         std::to_string(opt.max_workers) + " (the largest count of --elastic-schedule, which counts "
                         "this launcher's workers): give the job's size with --max-workers");
  }
  if (opt.nproc < 1) throw InvalidInput("--nproc must be >= 1, got " + std::to_string(opt.nproc));
  if (opt.self_exe.empty()) throw InvalidInput("launch: the limbo binary path is unknown");
  if (!opt.program.empty()) program_path(opt.program[0]);  // a program that is not there: said before anything starts
  Job job(std::move(opt));
  return job.run();
}

}  // namespace limbo::elastic
