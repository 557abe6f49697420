#include "elastic/coordinator.h"

#include <algorithm>
#include <sstream>

namespace limbo::elastic {

std::string format_members(const std::vector<int64_t>& ids) {
  std::string s;
  for (auto id : ids) s += (s.empty() ? "" : ",") + std::to_string(id);
  return s;
}

std::vector<int64_t> parse_members(const std::string& s) {
  std::vector<int64_t> out;
  std::stringstream ss(s);
  for (std::string item; std::getline(ss, item, ',');)
    if (!item.empty()) out.push_back(std::stoll(item));
  return out;
}

Coordinator::Coordinator(std::shared_ptr<comm::KvStore> store, CoordinatorOptions opt, Clock clock)
    : store_(std::move(store)), opt_(opt), clock_(std::move(clock)) {
  // Members beat four times per timeout (read once when they register).
  store_->set("elastic/heartbeat_interval_ms", std::to_string(std::max<int64_t>(10, opt_.heartbeat_timeout.count() / 4)));
  store_->set("elastic/heartbeat_timeout_ms", std::to_string(opt_.heartbeat_timeout.count()));
  resume();
}

// Picks up where a previous coordinator (on a launcher since lost) left
// off: its last round and abort, and the end of its event log. A round or
// event it wrote without the counter that follows (it died between the
// two writes) is found by probing, so numbers are never reused.
void Coordinator::resume() {
  events_ = store_->add("elastic/events", 0);
  while (store_->try_get("elastic/event/" + std::to_string(events_ + 1))) ++events_;
  int64_t k = 0;
  if (auto v = store_->try_get("elastic/round")) k = std::stoll(*v);
  const int64_t announced = k;
  while (store_->try_get("elastic/round/" + std::to_string(k + 1))) ++k;
  if (k > announced) {
    // The predecessor wrote round k's members but not `elastic/round` or
    // its event: members wait on those, so they are written now (a store
    // error here fails the take-over, which is tried again).
    store_->set("elastic/round", std::to_string(k));
    const auto last = events_ > 0 ? store_->try_get("elastic/event/" + std::to_string(events_)) : std::nullopt;
    if (last != "round " + std::to_string(k)) publish_event("round " + std::to_string(k));
    else store_->set("elastic/events", std::to_string(events_));
  }
  if (k > 0) {
    current_.number = k;
    if (auto m = store_->try_get("elastic/round/" + std::to_string(k))) current_.members = parse_members(*m);
  }
  if (auto a = store_->try_get("elastic/abort")) aborted_round_ = std::stoll(*a);
  resumed_ = current_.number > 0;
}

// The ids under `prefix` ("elastic/hb/" -> {id: value}).
std::map<int64_t, std::string> Coordinator::ids_under(const std::string& prefix) {
  std::map<int64_t, std::string> out;
  for (auto& [key, value] : store_->list(prefix)) {
    try {
      size_t used = 0;
      const std::string tail = key.substr(prefix.size());
      const int64_t id = std::stoll(tail, &used);
      if (used == tail.size()) out[id] = std::move(value);
    } catch (const std::exception&) {
      // not a member's key (e.g. a Gloo key under a round's prefix)
    }
  }
  return out;
}

// The coordinator is the log's only writer and numbers it itself: a store
// error before event n is written leaves n free for the retry, so members
// waiting for event n never face a gap. The count `events` is only where
// new members start reading.
void Coordinator::publish_event(const std::string& what) {
  const int64_t n = events_ + 1;
  store_->set("elastic/event/" + std::to_string(n), what);
  events_ = n;
  store_->set("elastic/events", std::to_string(n));
}

Coordinator::Result Coordinator::poll() {
  try {
    return poll_once();
  } catch (...) {
    failed_ = true;
    throw;
  }
}

Coordinator::Result Coordinator::poll_once() {
  const auto now = clock_();
  Result r;
  // Four reads, however many members: who joined, left, died, and beat.
  const auto joined = ids_under("elastic/join/");
  const auto left_keys = ids_under("elastic/left/");
  const auto dead_keys = ids_under("elastic/dead/");
  const auto beats = ids_under("elastic/hb/");
  // Silence is measured only over time this coordinator could see the
  // store: after polls that failed for a while (the store out of reach)
  // every member starts a fresh timeout, so an outage of the store is not
  // taken for the loss of every member.
  //
  // The same holds when the store takes no writes while it still answers
  // reads (an etcd cluster whose leader was stopped, until it elects
  // another): then no member's heartbeat advances. Silence counts only while
  // some member's heartbeat advances (within half a timeout); when beats
  // come again after everyone was quiet that long, every member starts a
  // fresh timeout.
  std::map<int64_t, int64_t> beat_of;
  bool advanced = false;
  for (const auto& [id, unused] : joined) {
    auto hb = beats.find(id);
    int64_t beat = 0;
    try {
      beat = hb == beats.end() ? 0 : std::stoll(hb->second);
    } catch (const std::exception&) {
    }
    beat_of[id] = beat;
    auto it = heartbeats_.find(id);
    advanced = advanced || (it != heartbeats_.end() && it->second.first != beat);
  }
  const bool everyone_quiet =
      last_any_beat_ != std::chrono::steady_clock::time_point{} && now - last_any_beat_ > opt_.heartbeat_timeout / 2;
  const bool gap = (failed_ && now - last_poll_ > opt_.heartbeat_timeout / 2) || (advanced && everyone_quiet);
  if (advanced || last_any_beat_ == std::chrono::steady_clock::time_point{}) last_any_beat_ = now;
  std::vector<int64_t> alive;
  std::set<int64_t> left;
  for (const auto& [id, unused] : joined) {
    if (dead_.count(id) || dead_keys.count(id)) continue;
    if (left_keys.count(id)) {
      left.insert(id);
      continue;
    }
    const int64_t beat = beat_of[id];
    auto it = heartbeats_.find(id);
    if (it != heartbeats_.end() && it->second.first != beat) beat_since_resume_.insert(id);
    if (it == heartbeats_.end() || it->second.first != beat || gap) {
      heartbeats_[id] = {beat, now};
    } else if (now - it->second.second > opt_.heartbeat_timeout && !everyone_quiet) {
      continue;  // silent for too long (crashed, stopped or cut off) while others beat
    }
    alive.push_back(id);
  }
  failed_ = false;
  last_poll_ = now;
  if (resumed_ && resumed_at_ == std::chrono::steady_clock::time_point{}) resumed_at_ = now;
  r.alive = static_cast<int>(alive.size());

  // A member of the current round that went silent without leaving may
  // still hold its connections open (a stopped process): the others would
  // wait in their collective until its timeout. Tell them to abort it.
  std::vector<int64_t> silent;
  for (auto id : current_.members)
    if (!left.count(id) && !std::binary_search(alive.begin(), alive.end(), id)) silent.push_back(id);
  if (!silent.empty() && aborted_round_ < current_.number) {
    // Written before it is remembered: a store error here is retried by
    // the next poll.
    store_->set("elastic/abort", std::to_string(current_.number));
    publish_event("abort " + std::to_string(current_.number));
    aborted_round_ = current_.number;
    r.aborted = silent;
  }
  if (static_cast<int>(alive.size()) > opt_.max_workers) alive.resize(opt_.max_workers);

  // A member that failed in (or wants to leave) the current round asks for
  // the next one; requests about older rounds are already answered.
  const bool asked = current_.number > 0 &&
                     store_->try_get("elastic/want/" + std::to_string(current_.number)).has_value();
  const bool differs = alive != current_.members;
  const int needed = current_.number == 0 ? std::max(opt_.min_workers, opt_.initial_workers)
                                          : opt_.min_workers;
  if (static_cast<int>(alive.size()) < needed) {
    if (!below_) {
      below_ = true;
      below_since_ = now;
      r.fell_below = true;
    }
    r.below_minimum_timed_out = now - below_since_ > opt_.rendezvous_timeout;
    r.round = current_;
    return r;
  }
  below_ = false;
  // Taken over from a lost coordinator: until every member of the current
  // round has beaten once or a heartbeat timeout has passed, who is alive
  // is not known yet; a round written now could list members lost with
  // the old coordinator's host, and fail.
  if (resumed_) {
    bool all_beat = true;
    for (auto id : current_.members)  // (one that left or died is known)
      all_beat = all_beat && (beat_since_resume_.count(id) || !std::binary_search(alive.begin(), alive.end(), id));
    if (!all_beat && now - resumed_at_ <= opt_.heartbeat_timeout) {
      r.round = current_;
      return r;
    }
    resumed_ = false;
  }
  if (differs || asked) {
    std::vector<int64_t> added, removed;
    std::set_difference(alive.begin(), alive.end(), current_.members.begin(),
                        current_.members.end(), std::back_inserter(added));
    std::set_difference(current_.members.begin(), current_.members.end(), alive.begin(),
                        alive.end(), std::back_inserter(removed));
    std::vector<int64_t> gone, lost;
    for (auto id : removed) (left.count(id) ? gone : lost).push_back(id);
    r.lost = lost;
    for (auto id : lost)
      if (dead_.count(id)) r.crashed.push_back(id);
    if (!added.empty()) r.reason += "joined " + format_members(added);
    if (!gone.empty()) r.reason += std::string(r.reason.empty() ? "" : "; ") + "left " + format_members(gone);
    if (!lost.empty()) r.reason += std::string(r.reason.empty() ? "" : "; ") + "lost " + format_members(lost);
    if (r.reason.empty()) r.reason = "requested by a member";
    const int64_t next = current_.number + 1;
    store_->set("elastic/round/" + std::to_string(next), format_members(alive));
    store_->set("elastic/round", std::to_string(next));
    publish_event("round " + std::to_string(next));
    current_.number = next;  // only once every key is written (a store error: the next poll writes it again)
    current_.members = alive;
    r.new_round = true;
  }
  r.round = current_;
  return r;
}

}  // namespace limbo::elastic
