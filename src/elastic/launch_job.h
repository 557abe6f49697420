// The launcher's job (elastic/launcher.h), as its two units share it:
// launcher.cc (set-up, the event loop, workers, the coordinator and the
// store) and launch_ending.cc (how the job ends: completion, stops, the
// final files, the exit code). Internal to the launcher.
#pragma once

#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>

#include "comm/kv_store.h"
#include "comm/shm_group.h"
#include "common/process.h"
#include "common/throttled_log.h"
#include "common/timing.h"
#include "elastic/beats.h"
#include "elastic/coordinator.h"
#include "elastic/election.h"
#include "elastic/event_relay.h"
#include "elastic/launcher.h"
#include "status/server.h"

namespace limbo::elastic {


// One job as this launcher sees it: a state machine over the phases of
// "How a job ends" (docs/elastic.md). Events (a signal, a worker's exit, a
// coordinator poll, the store's answers) move it between phases; each exit
// code is decided in one place.
//
//   Starting   workers started, no round yet
//   Running    a round of at least --min-workers exists
//   Reforming  fewer than --min-workers alive; waits up to --rdzv-timeout
//   Completing training completed (elastic/done, or a fixed-membership
//              worker ended with 0): stragglers are killed a second later;
//              exits 0 once its own workers are gone (the hosting launcher
//              also waits, at most 3 s, until every other launcher saw it)
//   Stopping   a signal, the minimum timeout or a fixed-membership failure:
//              workers get SIGTERM, then SIGKILL after the grace period
//   Lost       (not hosting) no answer from the rendezvous store for longer
//              than --rdzv-timeout: workers are stopped, exit 5
enum class Phase { Starting, Running, Reforming, Completing, Stopping, Lost };

inline const char* phase_name(Phase p) {
  switch (p) {
    case Phase::Starting: return "starting";
    case Phase::Running: return "running";
    case Phase::Reforming: return "re-forming";
    case Phase::Completing: return "completing";
    case Phase::Stopping: return "stopping";
    case Phase::Lost: return "lost";
  }
  return "?";
}

constexpr double kStragglerGrace = 1.0;  // s after completion before a member that has not left is killed
constexpr double kFrozenInTheEnding = 5.0;  // s a member that left may stand still before it is killed
constexpr double kAckGrace = 3.0;        // s the hosting launcher waits for the others to see completion
constexpr int kDoneKeptSeconds = 3600;   // s an etcd job's completion outlives its other keys

class Job {
 public:
  explicit Job(LaunchOptions opt);
  int run();

 private:
  // `relayed`: the hosting launcher stopped the job with `sig` (elastic/stop).
  void on_signal(int sig, bool relayed = false);
  void on_exit(const Supervisor::Exit& ex);
  void on_all_gone();
  void on_round(const Coordinator::Result& r);
  void tick();
  void poll_store(bool now = false);
  void complete_tick();
  void warned_tick();
  void stopping_tick();
  // Runs a call of the coordinator's: fenced out (etcd: another launcher
  // leads now), it steps down; a failed store call is logged (throttled)
  // and the next tick tries again.
  void with_coordinator(const std::function<void()>& f);
  // A stop: whether this launcher may exit now that its workers are gone.
  bool stop_ended();
  // The keeper at the end: every other launcher said it is done, or no
  // worker of the job has beaten for kAckGrace since `since`.
  bool others_done(Clock::time_point since);
  bool warned_job_completed(const std::string& what_now);
  void check_job_name();
  void apply_schedule();
  void enter(Phase p, const std::string& why);
  void complete(const std::string& why);
  void stop(int code, const std::string& why, int sig);
  bool finished();
  int finish();
  void remove_shard_homes();
  // Runs a store call; false (and the loss clock running) when the store
  // did not answer.
  bool with_store(const std::function<void()>& f);
  int64_t worker_id_of(pid_t pid);
  void start_worker(int index, bool resume);
  // etcd: runs the election and starts or drops this launcher's coordinator.
  void elect();
  // Keeps the store up at the end until the other launchers saw completion:
  // the hosting launcher, or (etcd) the one coordinating.
  bool keeper() const { return hosting_ || (election_ && election_->leading()); }
  void make_coordinator();
  void read_records();
  // No store call has gone through for a second: calls that can wait are
  // skipped, so that the loop keeps its pace while the loss clock runs.
  bool store_down() const { return seconds_since(last_contact_) > 1.0; }
  int64_t records_seen_ = 0;
  Clock::time_point last_records_{};

  LaunchOptions opt_;
  bool hosting_ = false;
  int port_ = 0;
  std::string rdzv_, run_dir_;
  int threads_ = 0;
  Supervisor sup_;
  std::shared_ptr<void> store_;
  std::shared_ptr<comm::KvStore> kv_;
  std::unique_ptr<Coordinator> coordinator_;
  std::unique_ptr<BeatListener> listener_;  // the coordinator's: every host's heartbeats
  std::unique_ptr<Election> election_;
  // This host's heartbeat table, each worker's slot in it, the thread
  // that relays it to the coordinator (elastic/beats.h), and the one that
  // relays the coordinator's events to the workers (elastic/event_relay.h).
  std::shared_ptr<LocalBeats> beats_table_;
  std::map<pid_t, int> slot_of_;
  std::unique_ptr<BeatSender> relay_;
  std::unique_ptr<EventRelay> event_relay_;
  std::unique_ptr<status::Server> page_;
  bool url_written_ = false;
  Phase phase_ = Phase::Starting;
  int result_ = 0;  // the exit code Stopping / an all-gone job ends with
  std::string exit_reason_;
  int user_signal_ = 0;
  bool warned_stop_ = false;  // Stopping on Slurm's warning (SIGUSR1)
  bool warned_completed_ = false;  // ... that found the job completed: its final files are checked
  Clock::time_point stopped_at_{};  // when this launcher entered Stopping
  Clock::time_point warned_at_{};  // when Slurm's warning came (the ending's bound: --warning-grace)
  Clock::time_point done_at_{}, last_contact_ = Clock::now(), last_done_check_{};
  std::string last_store_error_;
  int64_t launcher_id_ = 0;
  bool acked_ = false;
  std::set<pid_t> terminating_, killed_after_done_;
  // The ending: workers that took part in it (set `left`, or exited during
  // it without being killed as stragglers), each straggler's last heartbeat
  // and when it changed, and whether the ending outlasted --finish-timeout.
  std::set<pid_t> finishers_;
  std::map<pid_t, std::pair<std::string, Clock::time_point>> beats_;
  std::map<pid_t, std::pair<std::string, Clock::time_point>> left_beats_;  // (ending) members that left
  Clock::time_point last_beat_seen_{};
  bool finish_timed_out_ = false;
  std::filesystem::file_time_type started_ = std::filesystem::file_time_type::clock::now();
  bool final_files_written() const;
  std::string start_marker_;  // RUN_DIR/.launch-<host>-<pid>, written at the start
  int next_index_ = 0, restarts_ = 0;
  int alive_ = 0;  // workers alive in the job at the coordinator's last poll
  ThrottledLog poll_errors_;
};

}  // namespace limbo::elastic
