#include "elastic/member.h"

#include "comm/hier_group.h"
#include "comm/shm_group.h"

#include <unistd.h>

#include <algorithm>
#include <limits>
#include <random>
#include <map>

#include "common/error.h"
#include "common/log.h"
#include "common/process.h"
#include "train/membership.h"

namespace limbo::elastic {
namespace {

using Clock = std::chrono::steady_clock;

int64_t to_int(const std::optional<std::string>& v) { return v ? std::stoll(*v) : 0; }

}  // namespace

// The host identity names the machine (boot id) and the namespaces,
// among them the pid namespace in which `pid` means this process.
std::string process_key(pid_t pid) { return comm::host_identity() + ":" + std::to_string(pid); }

std::string Member::job_tag() {
  std::random_device rd;
  char mine[17];
  std::snprintf(mine, sizeof mine, "%08x%08x", rd(), rd());
  return store_->compare_set("elastic/job_tag", "", mine);
}

Member::Member(std::shared_ptr<comm::KvStore> store, MemberOptions opt)
    : store_(std::move(store)), opt_(std::move(opt)) {
  id_ = store_->ticket("elastic/next_id");
  store_->set("elastic/host_pid/" + std::to_string(id_), process_key(::getpid()));
  if (auto ms = store_->try_get("elastic/heartbeat_interval_ms"))
    opt_.heartbeat_interval = std::chrono::milliseconds(std::max<int64_t>(1, std::stoll(*ms)));
  heartbeat_timeout_ = 4 * opt_.heartbeat_interval;
  if (auto ms = store_->try_get("elastic/heartbeat_timeout_ms"))
    heartbeat_timeout_ = std::chrono::milliseconds(std::max<int64_t>(1, std::stoll(*ms)));
  cut_off_after_ = opt_.cut_off_after.count() > 0 ? opt_.cut_off_after : heartbeat_timeout_;
  if (!opt_.connect) {
    // No call of these threads may wait longer than the heartbeat timeout:
    // past it the coordinator has counted this member gone anyway. The
    // embedded store's connection carries every thread's calls at once (a
    // parked wait holds up no other call): they share the training
    // thread's, each with its own timeout.
    const auto g = opt_.group;
    const auto t = heartbeat_timeout_;
    std::weak_ptr<comm::KvStore> shared = store_;
    opt_.connect = [g, t, shared]() -> std::shared_ptr<comm::KvStore> {
      if (auto s = shared.lock())
        if (auto view = s->share(t)) return view;
      return comm::connect_kv_store(g.store_host, g.store_port, t, g.token);
    };
  }
  started_ns_ = monotonic_ns();
  BeatSenderOptions bo;
  bo.interval = opt_.heartbeat_interval;
  bo.token = opt_.group.token;
  bo.connect = opt_.connect;
  if (opt_.beats && opt_.beat_slot >= 0 && opt_.beat_slot < LocalBeats::kSlots) {
    beats_ = opt_.beats;
    slot_ = opt_.beat_slot;
  } else {
    beats_ = LocalBeats::in_process();
    slot_ = beats_->acquire();
  }
  beats_->beat(slot_, id_);
  if (!opt_.beats) own_sender_ = std::make_unique<BeatSender>(beats_, bo, slot_);
  // The event log from here on: events before `seen` are summed up by the
  // round and abort keys read after it.
  const int64_t seen = store_->add("elastic/events", 0);
  latest_round_ = to_int(store_->try_get("elastic/round"));
  latest_abort_ = to_int(store_->try_get("elastic/abort"));
  store_->set("elastic/join/" + std::to_string(id_), "1");
  // Each thread has its own handle on the store (its own connection where
  // the store cannot carry several threads' calls on one), so that a long
  // store call on the training thread cannot delay an abort.
  // (Both are made before either thread starts: a failed connect must not
  // leave a running thread behind.)
  // With a launcher's table whose relay is current, the watch thread
  // reads the events there and makes its store connection only when it
  // must watch the store itself.
  auto publish_store = opt_.connect();
  std::shared_ptr<comm::KvStore> watch_store;
  if (!opt_.beats || !beats_->events_current(monotonic_ns())) watch_store = opt_.connect();
  heartbeat_ = std::thread([this] { beat_loop(); });
  publish_ = std::thread([this, s = std::move(publish_store)] { publish_loop(s); });
  watch_ = std::thread([this, s = std::move(watch_store), seen] { watch_loop(s, seen); });
}

Member::~Member() {
  stop_ = true;
  cv_.notify_all();
  { std::lock_guard<std::mutex> lock(sleep_mu_); }  // a sleeper has seen stop_ false and waits, or sees it true
  sleep_cv_.notify_all();
  if (heartbeat_.joinable()) heartbeat_.join();
  if (publish_.joinable()) publish_.join();
  if (watch_.joinable()) watch_.join();
}

void Member::sleep_while_running(std::chrono::milliseconds d) {
  std::unique_lock<std::mutex> lock(sleep_mu_);
  sleep_cv_.wait_until(lock, Clock::now() + d, [&] { return stop_.load(); });
}

// A beat is a store of this member's slot (no system call). This thread
// makes no store call: a store that answers slowly (an etcd member stopped)
// must not hold up a beat.
void Member::beat_loop() {
  name_this_thread("limbo-heartbeat");
  auto next = Clock::now();
  const int64_t interval = std::chrono::nanoseconds(opt_.heartbeat_interval).count();
  while (!stop_) {
    beats_->beat(slot_, id_);
    if (!own_sender_ && monotonic_ns() - std::max(beats_->sent_ns(), started_ns_) > 2 * interval) {
      // The launcher stopped relaying (it is gone, and this worker is
      // leaving): its beats go out directly, so that it is not taken for lost.
      log_info("worker " + std::to_string(id_) + ": its launcher relays no heartbeats; sending them itself");
      BeatSenderOptions bo;
      bo.interval = opt_.heartbeat_interval;
      bo.token = opt_.group.token;
      bo.connect = opt_.connect;
      own_sender_ = std::make_unique<BeatSender>(beats_, bo, slot_);
    }
    check_cut_off();
    next += opt_.heartbeat_interval;
    const auto now = Clock::now();
    if (next < now) next = now;  // late (e.g. the process was stopped): no burst of beats
    sleep_while_running(std::chrono::duration_cast<std::chrono::milliseconds>(next - now));
  }
}

// The progress and the queued status records, once a heartbeat interval, on
// their own store connection.
void Member::publish_loop(std::shared_ptr<comm::KvStore> s) {
  name_this_thread("limbo-publish");
  while (!stop_) {
    try {
      const double progress = progress_.load();
      if (progress != published_progress_) {
        s->set("elastic/progress", std::to_string(progress));
        published_progress_ = progress;
      }
      publish_records(*s);
    } catch (const std::exception& e) {
      // Best effort: the next interval tries again.
    }
    sleep_while_running(opt_.heartbeat_interval);
  }
}

// Cut off: no beat of this member acknowledged for cut_off_after (by the
// launcher's relay or by its own sender). Its group is aborted only when a
// collective of it is stuck as long too: while the peers answer, the
// member has lost nothing (the coordinator's host may only be paused) and
// trains on; should the coordinator have dropped it, the others abort the
// round and its next collective fails.
void Member::check_cut_off() {
  const int64_t acked = std::max({beats_->acked_ns(), own_sender_ ? own_sender_->acked_ns() : 0, started_ns_});
  const int64_t silent_ns = monotonic_ns() - acked;
  const int64_t limit_ns = std::chrono::nanoseconds(cut_off_after_).count();
  if (silent_ns <= limit_ns) {
    if (cut_off_.exchange(false))
      log_info("worker " + std::to_string(id_) + ": the coordinator hears its heartbeats again");
    aborted_cut_off_ = false;
    return;
  }
  if (!cut_off_.exchange(true))
    log_info("worker " + std::to_string(id_) + ": no heartbeat acknowledged by the coordinator for " +
             std::to_string(silent_ns / 1000000) + " ms; it goes on while its group answers");
  if (aborted_cut_off_ || !activity_->stuck_for(limit_ns)) return;
  aborted_cut_off_ = true;
  // The coordinator has counted this member gone by now.
  log_warn("worker " + std::to_string(id_) + ": no heartbeat acknowledged by the coordinator for " +
           std::to_string(silent_ns / 1000000) + " ms, and its group's collective stuck for " +
           std::to_string((monotonic_ns() - activity_->last_change_ns.load()) / 1000000) +
           " ms; this member is out of its round");
  abort_group_upto(std::numeric_limits<int64_t>::max(), "this member is cut off from the coordinator");
  cv_.notify_all();
}

// The coordinator's events: from the host's table while its launcher's
// relay is current (elastic/event_relay.h; woken the moment it writes),
// otherwise from the store's event log, in order. After five waits without
// an event it also reads the current round and abort, a safety net should
// an event ever be missing.
void Member::watch_loop(std::shared_ptr<comm::KvStore> s, int64_t seen) {
  name_this_thread("limbo-watch");
  int64_t n = seen;
  int quiet = 0;
  bool relayed = false;
  while (!stop_) {
    if (opt_.beats && beats_->events_current(monotonic_ns())) {
      const auto e = beats_->events();
      if (e.round > latest_round_.load()) on_event("round " + std::to_string(e.round));
      if (e.abort > latest_abort_.load()) on_event("abort " + std::to_string(e.abort));
      if (e.done && !completed_) {
        completed_ = true;
        std::lock_guard<std::mutex> lock(mu_);
        cv_.notify_all();
      }
      relayed = true;
      beats_->wait_events(e.seq, std::chrono::milliseconds(50));
      continue;
    }
    try {
      if (!s) s = opt_.connect();
      if (relayed) {
        // Back to the store (the relay is not current): from its state now.
        relayed = false;
        n = s->add("elastic/events", 0);
        if (auto k = s->try_get("elastic/round")) on_event("round " + *k);
        if (auto k = s->try_get("elastic/abort")) on_event("abort " + *k);
      }
      const std::string key = "elastic/event/" + std::to_string(n + 1);
      if (s->wait_for(key, opt_.watch_wait)) {
        if (auto ev = s->try_get(key)) on_event(*ev);
        ++n;
        quiet = 0;
      } else if (++quiet % 5 == 0) {
        if (auto k = s->try_get("elastic/round")) on_event("round " + *k);
        if (auto k = s->try_get("elastic/abort")) on_event("abort " + *k);
        // Training completed while this member waits (for a round, or in a
        // group's formation): no round will come after it.
        if (!completed_ && s->try_get("elastic/done")) {
          completed_ = true;
          std::lock_guard<std::mutex> lock(mu_);
          cv_.notify_all();
        }
      }
    } catch (const std::exception& e) {
      s.reset();  // a new connection next time
      sleep_while_running(std::chrono::milliseconds(20));  // the store is out of reach: try again
    }
  }
}

// The status records queued by publish_record, each under the next number
// of the job's record ring; a store error keeps the rest for the next beat.
void Member::publish_records(comm::KvStore& s) {
  while (true) {
    std::string rec;
    {
      std::lock_guard<std::mutex> lock(records_mu_);
      if (records_.empty()) return;
      rec = records_.front();
    }
    const int64_t n = s.add("elastic/records", 1);
    s.set("elastic/record/" + std::to_string(n % kRecordRing), std::to_string(n) + " " + rec);
    std::lock_guard<std::mutex> lock(records_mu_);
    if (!records_.empty()) records_.pop_front();
  }
}

void Member::on_event(const std::string& event) {
  const auto space = event.find(' ');
  int64_t k = 0;
  try {
    if (space == std::string::npos) throw std::invalid_argument("no round");
    k = std::stoll(event.substr(space + 1));
  } catch (const std::exception&) {
    log_warn("worker " + std::to_string(id_) + ": ignored a malformed membership event '" + event + "'");
    return;
  }
  if (event.compare(0, space, "round") == 0) {
    int64_t cur = latest_round_.load();
    while (cur < k && !latest_round_.compare_exchange_weak(cur, k)) {
    }
  } else if (event.compare(0, space, "abort") == 0) {
    int64_t cur = latest_abort_.load();
    while (cur < k && !latest_abort_.compare_exchange_weak(cur, k)) {
    }
    abort_group_upto(k, "a member of round " + std::to_string(k) + " went silent");
  }
  std::lock_guard<std::mutex> lock(mu_);
  cv_.notify_all();
}

void Member::abort_group_upto(int64_t k, const std::string& why) {
  std::shared_ptr<comm::Collective> g;
  int64_t round = 0;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (group_round_ > 0 && k >= group_round_) {
      g = group_.lock();
      group_.reset();
      round = group_round_;
    }
  }
  if (g) {
    log_warn("worker " + std::to_string(id_) + ": " + why + "; aborting the collectives of round " +
             std::to_string(round));
    g->abort();
  }
}

int Member::rank_in(const Round& round) const {
  auto it = std::find(round.members.begin(), round.members.end(), id_);
  return it == round.members.end() ? -1 : static_cast<int>(it - round.members.begin());
}

Round Member::wait_round(int64_t after) {
  const auto start = Clock::now();
  const auto deadline = start + opt_.round_timeout;
  bool told = false;
  while (Clock::now() < deadline) {
    if (completed_)
      throw train::CompletedElsewhere("worker " + std::to_string(id_) +
                                      ": training completed on the other members while this one waited for a round");
    const int64_t k = latest_round_.load();
    if (k > after) {
      try {
        auto m = store_->try_get("elastic/round/" + std::to_string(k));
        Round r{k, m ? parse_members(*m) : std::vector<int64_t>{}};
        if (rank_in(r) >= 0) return r;
        after = k;  // a round without us (e.g. over the maximum, or cut off): wait for the next
      } catch (const Error& e) {
        sleep_while_running(std::chrono::milliseconds(20));  // the store is out of reach for now
      }
      continue;
    }
    if (opt_.interrupted && opt_.interrupted() && Clock::now() - start > std::chrono::seconds(1))
      throw train::Interrupted("worker " + std::to_string(id_) +
                               ": asked to stop while waiting for a membership round");
    if (!told && Clock::now() - start > std::chrono::seconds(5)) {
      log_info("worker " + std::to_string(id_) + ": waiting for a membership round (too few "
               "workers for the minimum, or the store out of reach?)");
      told = true;
    }
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait_for(lock, std::chrono::milliseconds(100),
                 [&] { return latest_round_.load() > after || stop_ || completed_.load(); });
  }
  throw Timeout("worker " + std::to_string(id_) + " waited " +
                std::to_string(opt_.round_timeout.count() / 1000) +
                " s for a membership round; the job is below its minimum worker count or the "
                "launcher is gone");
}

bool Member::best_effort(const std::string& what, const std::function<void()>& f) {
  for (int attempt = 0; attempt < 3; ++attempt) {
    try {
      f();
      return true;
    } catch (const Error& e) {
      if (attempt == 2) log_warn("worker " + std::to_string(id_) + ": could not " + what + ": " + e.what());
      else std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
  }
  return false;
}

void Member::request_round(int64_t current) {
  best_effort("ask for a new round", [&] {
    store_->set("elastic/want/" + std::to_string(current), std::to_string(id_));
  });
}

void Member::publish_record(std::string record) {
  std::lock_guard<std::mutex> lock(records_mu_);
  records_.push_back(std::move(record));
  while (records_.size() > 64) records_.pop_front();
}

// Handed to the publish thread: a store out of reach must not hold up a
// training step (progress only drives --elastic-schedule).
void Member::publish_progress(double epoch) { progress_.store(epoch); }

void Member::publish_done() {
  best_effort("publish that training completed", [&] { store_->set("elastic/done", "1"); });
}

// Retried until the store takes it (at most the round timeout): a launcher
// kills a member that did not leave after training completed only while the
// store answers and the member's heartbeat stands still, but a member whose
// `left` never arrived would count as lost for the coordinator.
void Member::leave() {
  const auto start = Clock::now();
  for (int attempt = 0;; ++attempt) {
    try {
      store_->set("elastic/left/" + std::to_string(id_), "1");
      return;
    } catch (const Error& e) {
      if (Clock::now() - start > opt_.round_timeout || stop_) {
        log_warn("worker " + std::to_string(id_) + ": could not leave: " + e.what());
        return;
      }
      if (attempt == 2) log_warn("worker " + std::to_string(id_) + ": the store does not take 'left' (" +
                                 e.what() + "); retrying");
      sleep_while_running(std::chrono::milliseconds(50));
    }
  }
}

bool Member::completed() {
  if (completed_) return true;
  try {
    return completed_ = store_->try_get("elastic/done").has_value();
  } catch (const Error&) {
    return false;
  }
}

void Member::publish_final(int64_t storage) {
  best_effort("publish that the final checkpoint and summary are written",
              [&] { store_->set("elastic/final/" + std::to_string(storage), "1"); });
}

bool Member::wait_final(int64_t storage, const std::vector<int64_t>& earlier) {
  const std::string key = "elastic/final/" + std::to_string(storage);
  const auto start = Clock::now();
  auto last_ok = start;
  while (!stop_) {
    try {
      if (store_->try_get(key)) return true;
      bool any_alive = false;
      for (int64_t id : earlier) {
        const std::string sid = std::to_string(id);
        if (store_->try_get("elastic/dead/" + sid) || store_->try_get("elastic/silent/" + sid)) continue;
        any_alive = true;
      }
      last_ok = Clock::now();
      if (!any_alive) return false;
    } catch (const Error& e) {
      if (Clock::now() - last_ok > opt_.round_timeout) {
        log_warn("worker " + std::to_string(id_) + ": the store was out of reach for " +
                 std::to_string(opt_.round_timeout.count() / 1000) + " s while waiting for the final "
                 "checkpoint (" + e.what() + ")");
        return false;
      }
    }
    sleep_while_running(std::chrono::milliseconds(50));
  }
  return false;
}

std::shared_ptr<comm::Collective> Member::form_group(const Round& round) {
  comm::GroupOptions go = opt_.group;
  const int64_t k = round.number;
  go.prefix = "elastic/round/" + std::to_string(k);
  go.cancelled = [this, k] {
    // (Not on a silent coordinator alone: its host may only be paused, and
    // the formation goes on once it answers.)
    return latest_round_.load() > k || latest_abort_.load() >= k || completed_.load();
  };
  std::shared_ptr<comm::Collective> g = std::make_shared<WatchedGroup>(
      std::shared_ptr<comm::Collective>(comm::make_group(go, rank_in(round), static_cast<int>(round.members.size()))),
      activity_);
  {
    std::lock_guard<std::mutex> lock(mu_);
    group_ = g;
    group_round_ = k;
  }
  // An abort that came between the end of formation and the line above.
  if (latest_abort_.load() >= k) abort_group_upto(k, "round " + std::to_string(k) + " was aborted");
  return g;
}

}  // namespace limbo::elastic
