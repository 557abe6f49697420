// How a launcher's job ends (docs/elastic.md, "How a job ends"): training
// completed, a stop (signal, minimum timeout, failure), Slurm's warning,
// the final files, and the exit code, decided in one place (finish()).
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

void Job::complete(const std::string& why) {
  if (phase_ == Phase::Completing) return;
  done_at_ = Clock::now();
  log_info("launch: training completed");
  enter(Phase::Completing, why);
}

void Job::stop(int code, const std::string& why, int sig) {
  if (phase_ != Phase::Stopping) stopped_at_ = Clock::now();
  result_ = code;
  exit_reason_ = why;
  sup_.begin_stop(sig, opt_.kill_grace);  // SIGKILL after the grace period
  enter(Phase::Stopping, why);
}

// While the job stops, the coordinator (the hosting launcher's, or under
// etcd the elected one's) still writes rounds: a member whose signal came
// after the others had left (each host's launcher gets its own) leaves in a
// round of its own, and if it writes the run directory, checkpoints first.
// The rounds keep the phase (stopping).
void Job::stopping_tick() {
  if (!coordinator_) return;
  with_coordinator([&] {
    const auto r = coordinator_->poll();
    alive_ = r.alive;
    if (r.new_round)
      log_info("launch: membership round " + std::to_string(r.round.number) + ": workers [" +
               format_members(r.round.members) + "] (" + r.reason + "; the job is stopping)");
  });
}

// Feeds this launcher's page with the records rank 0 published since the
// last read (twice a second; one list call).

void Job::warned_tick() {
  if (seconds_since(last_done_check_) < 0.1) return;
  last_done_check_ = Clock::now();
  if (!warned_job_completed("its ending (final evaluation, checkpoint and summary) goes on through the warning"))
    return;
  sup_.hold_kills();  // (the ending's bound is --warning-grace, in complete_tick)
}

// A stop on Slurm's warning that finds `elastic/done`: the job completed
// as the warning came, and ends as a completed one (its final files checked
// by finish()). False while the store says otherwise or does not answer.
bool Job::warned_job_completed(const std::string& what_now) {
  bool done = false;
  if (!with_store([&] { done = kv_->try_get("elastic/done").has_value(); }) || !done) return false;
  warned_stop_ = false;
  warned_completed_ = true;
  result_ = 0;
  exit_reason_.clear();
  log_info("launch: training completed as Slurm's warning came; " + what_now);
  complete("training completed (elastic/done)");
  return true;
}

// Completion, and contact with the store (a non-hosting launcher that
// cannot reach it for --rdzv-timeout has lost the job).

void Job::complete_tick() {
  if (!opt_.elastic) return;
  const bool warned_out = warned_at_ != Clock::time_point{} &&
                          seconds_since(warned_at_) > opt_.warning_grace.count() / 1000.0;
  if (!finish_timed_out_ && (warned_out || seconds_since(done_at_) > opt_.finish_timeout.count() / 1000.0)) {
    finish_timed_out_ = true;
    log_warn(warned_out ? "launch: the job's ending went on for --warning-grace (" +
                              std::to_string(opt_.warning_grace.count() / 1000) +
                              " s) after Slurm's warning; killing the " + std::to_string(sup_.count()) +
                              " workers still running"
                        : "launch: the job's ending took longer than --finish-timeout (" +
                              std::to_string(opt_.finish_timeout.count() / 1000) + " s); killing the " +
                              std::to_string(sup_.count()) + " workers still running");
    for (const auto& [pid, idx] : sup_.children()) {
      sup_.signal(pid, SIGKILL);
      killed_after_done_.insert(pid);
    }
  }
  // The coordinator still watches the members' beats: a member frozen in
  // its ending is marked silent, and the next member of its storage writes
  // the final files in its place.
  if (coordinator_) {
    try {
      coordinator_->poll_ending();
    } catch (const comm::FencedOut& e) {
      election_->step_down(e.what());
      coordinator_.reset();
      listener_.reset();
    } catch (const std::exception&) {
      // a store call that failed: the next tick polls again
    }
  }
  if (seconds_since(done_at_) < kStragglerGrace) return;
  // The store gone for longer than the hosting launcher waits for the
  // others at the end: nothing can be asked any more.
  const bool store_gone = seconds_since(last_contact_) > kAckGrace;
  for (const auto& [pid, idx] : sup_.children()) {
    if (killed_after_done_.count(pid)) continue;
    // Its heartbeat, from this host's table.
    const auto slot = slot_of_.find(pid);
    const std::string beat = slot == slot_of_.end() ? "" : std::to_string(beats_table_->counter(slot->second));
    if (auto w = left_beats_.find(pid); w != left_beats_.end()) {
      // Left, writing its final files: watched by its beats alone (no store
      // call) until it exits. One whose beats stand still (frozen) has been
      // replaced by the next member of its storage; it is killed, so that it
      // can never write beside that one.
      if (w->second.first != beat) {
        w->second = {beat, Clock::now()};
      } else if (seconds_since(w->second.second) > kFrozenInTheEnding) {
        log_warn("launch: worker pid " + std::to_string(pid) +
                 " stopped beating in the job's ending (frozen); killing it (the next member writes its files)");
        sup_.signal(pid, SIGKILL);
        killed_after_done_.insert(pid);
      }
      continue;
    }
    const std::string want = process_key(pid);
    int64_t id = 0;
    bool left = false;
    const bool answered = with_store([&] {
      const std::string prefix = "elastic/host_pid/";
      for (const auto& [key, value] : kv_->list(prefix))
        if (value == want) id = std::strtoll(key.c_str() + prefix.size(), nullptr, 10);
      if (!id) return;
      left = kv_->try_get("elastic/left/" + std::to_string(id)).has_value();
    });
    if (!answered && !store_gone) continue;
    if (left) {
      finishers_.insert(pid);
      left_beats_[pid] = {beat, Clock::now()};
      continue;
    }
    auto it = beats_.find(pid);
    if (answered && id && (it == beats_.end() || it->second.first != beat)) {
      beats_[pid] = {beat, Clock::now()};  // beating: finishing its last step, or a slow store
      continue;
    }
    if (answered && id && seconds_since(it->second.second) < kStragglerGrace) continue;
    log_warn("launch: worker pid " + std::to_string(pid) + " (id " + std::to_string(id) +
             ") did not finish with the others (stopped or hung); killing it");
    sup_.signal(pid, SIGKILL);
    killed_after_done_.insert(pid);
  }
}

// The run directory holds a summary and a checkpoint written since this
// launcher started (the job's own, not an earlier run's).
bool Job::final_files_written() const {
  // Compared with a file this launcher wrote into the run directory when it
  // started: the same file system stamps both (no clock skew between the
  // hosts that share a directory over NFS).
  std::error_code ec;
  const auto start = start_marker_.empty() ? started_ : std::filesystem::last_write_time(start_marker_, ec);
  if (ec) return true;  // the marker is gone (removed by hand): nothing to judge by
  for (const char* f : {"/summary.json", "/checkpoint.pt"}) {
    const auto t = std::filesystem::last_write_time(run_dir_ + f, ec);
    if (ec || t < start) return false;
  }
  return true;
}

bool Job::finished() {
  if (sup_.count() > 0) return false;
  if (phase_ == Phase::Stopping && opt_.elastic && warned_stop_) {
    // Every worker exited before warned_tick() saw the completion (the
    // review: a job that completed as the warning came exited 75 and was
    // requeued): one last look.
    warned_job_completed("its workers have ended");
  }
  if (phase_ == Phase::Stopping && opt_.elastic) return stop_ended();
  if (phase_ == Phase::Stopping || phase_ == Phase::Lost) return true;
  if (phase_ != Phase::Completing) return false;
  if (!opt_.elastic) return true;
  // This launcher's workers are gone: it tells the keeper, which keeps the
  // store up while the others' workers may still need it to finish (final
  // checkpoints, the final key, leaving).
  if (!keeper()) {
    if (!acked_) acked_ = with_store([&] { kv_->set("elastic/launcher_done/" + std::to_string(launcher_id_), "1"); });
    return true;
  }
  // The keeper (the hosting launcher, or under etcd the coordinating one)
  // waits until every other launcher has said so, or until no worker of the
  // job has beaten for kAckGrace (their launchers are gone or cut off), at
  // most --finish-timeout.
  if (seconds_since(done_at_) > opt_.finish_timeout.count() / 1000.0) return true;
  return others_done(done_at_);
}

bool Job::others_done(Clock::time_point since) {
  bool all = true;
  const bool answered = with_store([&] {
    const int64_t n = kv_->add("elastic/launchers", 0);
    for (int64_t l = 1; l <= n && all; ++l)
      if (l != launcher_id_ && !kv_->try_get("elastic/launcher_done/" + std::to_string(l))) all = false;
  });
  // Any worker's heartbeat heard (the coordinator's listener, while it runs).
  if (listener_) last_beat_seen_ = std::max(last_beat_seen_, listener_->table()->last_arrival());
  if (!answered) return seconds_since(last_contact_) > kAckGrace;
  return all || seconds_since(std::max(last_beat_seen_, since)) > kAckGrace;
}

// A stop whose workers here are gone. A launcher on another host says so
// and exits; the hosting launcher keeps the store up (and its coordinator
// writing rounds) while the others' workers leave, as at the end of
// training: until each launcher said so, or no worker has beaten for
// kAckGrace, at most the workers' grace period and kAckGrace after the stop.
bool Job::stop_ended() {
  if (!hosting_) {
    if (!acked_ && !opt_.etcd && !store_down())
      acked_ = with_store([&] { kv_->set("elastic/launcher_done/" + std::to_string(launcher_id_), "1"); });
    return true;
  }
  if (seconds_since(stopped_at_) > opt_.kill_grace.count() / 1000.0 + kAckGrace) return true;
  return others_done(stopped_at_);
}

// The job's shard homes on this host (elastic/shards.h): they outlive
// their workers for the survivors, not the job.
void Job::remove_shard_homes() {
  if (!opt_.elastic) return;
  std::optional<std::string> tag;
  with_store([&] { tag = kv_->try_get("elastic/job_tag"); });
  if (tag && !tag->empty()) remove_homes("limbo-zero-" + *tag + "-");
}

int Job::finish() {
  remove_shard_homes();
  if (phase_ == Phase::Completing) {
    int code = 0;
    if (finish_timed_out_) {
      code = kExitTimeout;
      log_warn("launch: exit code " + std::to_string(code) + ": training completed, but the ending (final "
               "evaluation, checkpoint and summary) outlasted --finish-timeout; the last checkpoint in the run "
               "directory is the newest state");
    } else if (!run_dir_.empty() && (!finishers_.empty() || warned_completed_) && !final_files_written()) {
      // Training completed, but no member wrote the final checkpoint and
      // summary here (each member that could died while the job ended):
      // the job has not delivered its result.
      code = kExitFailure;
      log_warn("launch: exit code " + std::to_string(code) + ": training completed, but " + run_dir_ +
               " has no final checkpoint and summary (the members that write them died while the job ended); "
               "the last checkpoint there is the newest state (--resume)");
    }
    if (code != 0 && user_signal_ == SIGUSR1) {
      // Warned ahead of preemption, and the ending did not deliver: the
      // requeued job resumes from the last checkpoint and ends again.
      log_warn("launch: exit code " + std::to_string(kExitPreempted) + " instead of " + std::to_string(code) +
               ": Slurm's warning (SIGUSR1) came while the job ended; requeue the job, or run it again with "
               "--resume");
      code = kExitPreempted;
    }
    if (!killed_after_done_.empty() && code == 0) record_killed(run_dir_, killed_after_done_);
    if (election_ && election_->leading()) {
      // The job's keys go with it, but for `elastic/done` after a good
      // ending, kept for kDoneKeptSeconds: a launcher cut off from etcd that
      // missed the completion sees it when it gets through, instead of
      // starting its workers into a fresh job of the same name (from
      // scratch); and a launcher started again with this name is told the
      // job completed. After a failed ending the name is free at once, for
      // --resume.
      try {
        comm::EtcdClient c(*opt_.etcd, std::chrono::seconds(2));
        c.erase(opt_.etcd->prefix(), true);
        if (code == 0) c.put(opt_.etcd->prefix() + "elastic/done", "1", c.grant_lease(kDoneKeptSeconds));
        election_->resign();
      } catch (const Error& e) {
        log_warn(std::string("launch: could not delete the job's keys in etcd: ") + e.what());
      }
    }
    if (!start_marker_.empty()) std::remove(start_marker_.c_str());
    return code;
  }
  if (!start_marker_.empty()) std::remove(start_marker_.c_str());
  if (user_signal_ == SIGUSR1 && phase_ == Phase::Stopping) {
    log_warn("launch: exit code " + std::to_string(kExitPreempted) +
             ": stopped by SIGUSR1 (ahead of preemption or the time limit) before training completed; requeue "
             "the job, or run it again with --resume");
    return kExitPreempted;
  }
  if (user_signal_ && phase_ == Phase::Stopping) {
    log_warn("launch: exit code " + std::to_string(128 + user_signal_) + ": stopped by signal " +
             std::to_string(user_signal_) + " before training completed (resume with --resume)");
    return 128 + user_signal_;
  }
  log_warn("launch: exit code " + std::to_string(result_) + ": " + exit_reason_);
  return result_;
}


}  // namespace limbo::elastic
