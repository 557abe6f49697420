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

Coordinator::Coordinator(std::shared_ptr<comm::KvStore> store, CoordinatorOptions opt,
                         std::shared_ptr<BeatTable> beats, Clock clock)
    : store_(std::move(store)), opt_(opt), clock_(std::move(clock)), beats_(std::move(beats)) {
  // What the table holds already (a table an earlier coordinator of this
  // process read); from here on only its changes.
  for (const auto& [id, beat] : beats_->read()) seen_[id] = beat;
  // Members beat four times per timeout (read once when they register).
  store_->set("elastic/heartbeat_interval_ms", std::to_string(std::max<int64_t>(10, opt_.heartbeat_timeout.count() / 4)));
  store_->set("elastic/heartbeat_timeout_ms", std::to_string(opt_.heartbeat_timeout.count()));
  if (!opt_.beat_address.empty()) store_->set("elastic/beat_addr", opt_.beat_address);
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
  // The silence marks an earlier coordinator wrote: erased once their
  // member beats again, as this one's are (a stale mark would hand a
  // healthy writer's files to a second writer).
  const std::string silent = "elastic/silent/";
  for (const auto& [key, value] : store_->list(silent)) {
    const std::string tail = key.substr(silent.size());
    if (!tail.empty() && tail.size() <= 18 && tail.find_first_not_of("0123456789") == std::string::npos)
      marked_silent_.insert(std::stoll(tail));
  }
}

namespace {
// What a poll reads: who joined, left, and died (marked by a launcher),
// and which rounds a member asked to replace (`want/<k>`).
const std::vector<std::string> kMemberPrefixes = {"elastic/join/", "elastic/left/", "elastic/dead/",
                                                  "elastic/want/"};
}  // namespace

// The member keys that changed since the last poll (over the embedded
// store: only those; over a store that cannot tell, all of them).
void Coordinator::read_members() {
  auto ch = store_->changes_since(kMemberPrefixes, revision_);
  if (ch.full) {
    joined_.clear();
    left_keys_.clear();
    dead_keys_.clear();
    wanted_.clear();
  }
  if (ch.full) everyone_next_ = true;
  for (const auto& [key, value] : ch.written) note_key(key, &value);
  for (const auto& key : ch.erased) note_key(key, nullptr);
  revision_ = ch.revision;
}

// One member key written (value) or erased (nullptr).
void Coordinator::note_key(const std::string& key, const std::string* value) {
  for (size_t kind = 0; kind < kMemberPrefixes.size(); ++kind) {
    const std::string& prefix = kMemberPrefixes[kind];
    if (key.compare(0, prefix.size(), prefix) != 0) continue;
    const std::string tail = key.substr(prefix.size());
    if (tail.empty() || tail.size() > 18 || tail.find_first_not_of("0123456789") != std::string::npos)
      return;  // not a member's key
    const int64_t id = std::stoll(tail);
    if (kind == 3) {
      if (value) wanted_.insert(id);
      else wanted_.erase(id);
      return;
    }
    auto& ids = kind == 0 ? joined_ : kind == 1 ? left_keys_ : dead_keys_;
    if (value) ids.insert(id);
    else ids.erase(id);
    pending_.push_back(id);
    return;
  }
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

// Who is alive at `now`: joined, not left, not marked dead, and its
// heartbeat changed within the timeout.
//
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
//
// A poll costs what changed, not the members there are: it looks at the
// members whose beat or keys changed and those whose deadline (last beat
// + timeout) passed; at 50,000 members a walk over all of them twice a
// poll was most of the coordinator's time.
Coordinator::Liveness Coordinator::liveness(Time now, bool ending) {
  Looked at;
  at.now = now;
  at.real_now = std::chrono::steady_clock::now();
  at.ending = ending;
  bool advanced = false;
  for (const auto& [id, beat] : beats_->take_changes()) {
    auto& s = seen_[id];
    if (beat.counter <= s.counter) continue;  // (a worker the table forgot and heard again: only newer counts)
    s = beat;
    pending_.push_back(id);
    auto h = heartbeats_.find(id);
    advanced = advanced || (h != heartbeats_.end() && h->second.counter != beat.counter && joined_.count(id));
  }
  at.everyone_quiet = last_any_beat_ != Time{} && now - last_any_beat_ > opt_.heartbeat_timeout / 2;
  at.gap = (failed_ && now - last_poll_ > opt_.heartbeat_timeout / 2) || (advanced && at.everyone_quiet);
  if (advanced || last_any_beat_ == Time{}) last_any_beat_ = now;
  const bool grace = resumed_at_ != Time{} && now - resumed_at_ < kTakeOverGraceTimeouts * opt_.heartbeat_timeout;
  const bool everyone = everyone_next_ || look_at_everyone_ || at.gap || at.everyone_quiet != last_quiet_ ||
                        ending != last_ending_ || grace || last_grace_;
  everyone_next_ = false;
  last_quiet_ = at.everyone_quiet;
  last_ending_ = ending;
  last_grace_ = grace;
  if (everyone) {
    due_ = {};
    for (auto& [id, h] : heartbeats_) h.due = Time{};
    pending_.assign(joined_.begin(), joined_.end());
    for (const auto& [id, s] : state_)
      if (!joined_.count(id)) pending_.push_back(id);
  } else if (!at.everyone_quiet) {  // (while everyone is quiet, no one falls silent)
    while (!due_.empty() && due_.top().first < now) {
      const auto [t, id] = due_.top();
      due_.pop();
      auto h = heartbeats_.find(id);
      if (h == heartbeats_.end() || h->second.due != t) continue;
      h->second.due = Time{};
      pending_.push_back(id);
    }
  }
  for (int64_t id : pending_) {
    const State s = look_at(id, at);
    set_state(id, s);
    if (s == State::Alive || (s == State::Left && ending)) {
      Heard& h = heartbeats_[id];
      if (h.due == Time{}) {
        h.due = h.date + opt_.heartbeat_timeout;
        due_.emplace(h.due, id);
      }
    }
  }
  pending_.clear();
  Liveness l;
  if (alive_changed_) {
    alive_list_.assign(alive_.begin(), alive_.end());
    alive_changed_ = false;
  }
  l.alive = alive_list_;
  l.left = left_;
  l.silent = silent_;
  return l;
}

// Where member `id` stands at `at.now`, its beat dated on the way.
Coordinator::State Coordinator::look_at(int64_t id, const Looked& at) {
  if (!joined_.count(id) || dead_.count(id) || dead_keys_.count(id)) return State::Out;
  if (left_keys_.count(id) && !at.ending) return State::Left;
  const auto seen = seen_.find(id);
  const int64_t beat = seen == seen_.end() ? 0 : seen->second.counter;
  auto [it, first] = heartbeats_.try_emplace(id);
  Heard& h = it->second;
  if (!first && h.counter != beat) beat_since_resume_.insert(id);
  if (first || at.gap) {
    h.counter = beat;
    h.date = at.now;
  } else if (h.counter != beat) {
    // When the member made its last beat, on this coordinator's clock
    // (`now`, less the beat's age).
    const auto made = at.now - std::max<std::chrono::steady_clock::duration>(
                                   std::chrono::steady_clock::duration::zero(), at.real_now - seen->second.at);
    h.counter = beat;
    h.date = std::max(h.date, made);
  }
  // After a take-over, a member's relay finds the new coordinator's
  // address a few intervals late (it asks again only once acknowledgements
  // stop): one not yet heard from since is given three timeouts, not one,
  // so that a take-over evicts no live host (a bounded wait).
  const bool finding_us = resumed_at_ != Time{} && !beat_since_resume_.count(id) &&
                          at.now - resumed_at_ < kTakeOverGraceTimeouts * opt_.heartbeat_timeout;
  if (at.now - h.date > opt_.heartbeat_timeout && !at.everyone_quiet && !finding_us)
    return State::Silent;  // silent for too long (crashed, stopped or cut off) while others beat
  if (left_keys_.count(id)) return State::Left;  // (ending) left, and still beating
  return State::Alive;
}

void Coordinator::set_state(int64_t id, State s) {
  auto it = state_.find(id);
  const State was = it == state_.end() ? State::Out : it->second;
  if (was == s) return;
  auto set_of = [&](State x) -> std::set<int64_t>* {
    return x == State::Alive ? &alive_ : x == State::Left ? &left_ : x == State::Silent ? &silent_ : nullptr;
  };
  if (auto* from = set_of(was)) from->erase(id);
  if (auto* to = set_of(s)) to->insert(id);
  alive_changed_ = alive_changed_ || was == State::Alive || s == State::Alive;
  if (s == State::Out) state_.erase(id);
  else state_[id] = s;
}

// A member of the current round that went silent without leaving may
// still hold its connections open (a stopped process): the others would
// wait in their collective until its timeout. Tell them to abort it.
void Coordinator::abort_silent(const Liveness& l, Result& r) {
  if (l.alive == current_.members || aborted_round_ >= current_.number) return;
  std::vector<int64_t> silent;
  for (auto id : current_.members)
    if (!l.left.count(id) && !std::binary_search(l.alive.begin(), l.alive.end(), id)) silent.push_back(id);
  if (silent.empty() || aborted_round_ >= current_.number) return;
  // Written before it is remembered: a store error here is retried by the
  // next poll.
  store_->set("elastic/abort", std::to_string(current_.number));
  publish_event("abort " + std::to_string(current_.number));
  aborted_round_ = current_.number;
  r.aborted = silent;
}

// `silent/<id>` for each member found silent, erased when it beats again
// (best effort: a store error leaves it for the next poll).
void Coordinator::mark_silent(const Liveness& l) {
  for (auto id : l.silent)
    if (!marked_silent_.count(id)) {
      store_->set("elastic/silent/" + std::to_string(id), "1");
      marked_silent_.insert(id);
    }
  for (auto it = marked_silent_.begin(); it != marked_silent_.end();) {
    // Erased once the member beats again (alive, or left and beating in
    // the ending); kept for one never heard from since (a lost host).
    const bool beating = std::binary_search(l.alive.begin(), l.alive.end(), *it) || l.left.count(*it) > 0;
    if (l.silent.count(*it) || !beating) {
      ++it;
      continue;
    }
    store_->erase("elastic/silent/" + std::to_string(*it));
    it = marked_silent_.erase(it);
  }
}

// Too few members for a round (the first one waits for initial_workers):
// true, with the time below the minimum noted in `r`.
bool Coordinator::below_minimum(size_t alive, Time now, Result& r) {
  const int needed = current_.number == 0 ? std::max(opt_.min_workers, opt_.initial_workers)
                     : stopping_         ? 1
                                         : opt_.min_workers;
  if (static_cast<int>(alive) >= needed) {
    below_ = false;
    return false;
  }
  if (!below_) {
    below_ = true;
    below_since_ = now;
    r.fell_below = true;
  }
  r.below_minimum_timed_out = now - below_since_ > opt_.rendezvous_timeout;
  return true;
}

// Taken over from a lost coordinator: until every member of the current
// round has beaten once or a heartbeat timeout has passed, who is alive is
// not known yet; a round written now could list members lost with the old
// coordinator's host, and fail.
bool Coordinator::settling(const std::vector<int64_t>& alive, Time now) {
  if (!resumed_) return false;
  bool all_beat = true;
  for (auto id : current_.members)  // (one that left or died is known)
    all_beat = all_beat && (beat_since_resume_.count(id) || !std::binary_search(alive.begin(), alive.end(), id));
  if (!all_beat && now - resumed_at_ <= opt_.heartbeat_timeout) return true;
  resumed_ = false;
  return false;
}

// The next round: `alive`, with the reason (who joined, left, was lost).
void Coordinator::write_round(const Liveness& l, Result& r) {
  std::vector<int64_t> added, removed;
  std::set_difference(l.alive.begin(), l.alive.end(), current_.members.begin(), current_.members.end(),
                      std::back_inserter(added));
  std::set_difference(current_.members.begin(), current_.members.end(), l.alive.begin(), l.alive.end(),
                      std::back_inserter(removed));
  std::vector<int64_t> gone, lost;
  for (auto id : removed) (l.left.count(id) ? gone : lost).push_back(id);
  r.lost = lost;
  for (auto id : lost)
    if (dead_.count(id)) r.crashed.push_back(id);
  if (!added.empty()) r.reason += "joined " + format_members(added);
  if (!gone.empty()) r.reason += std::string(r.reason.empty() ? "" : "; ") + "left " + format_members(gone);
  if (!lost.empty()) r.reason += std::string(r.reason.empty() ? "" : "; ") + "lost " + format_members(lost);
  if (r.reason.empty()) r.reason = "requested by a member";
  const int64_t next = current_.number + 1;
  store_->set("elastic/round/" + std::to_string(next), format_members(l.alive));
  store_->set("elastic/round", std::to_string(next));
  publish_event("round " + std::to_string(next));
  current_.number = next;  // only once every key is written (a store error: the next poll writes it again)
  current_.members = l.alive;
  r.new_round = true;
}

void Coordinator::poll_ending() {
  const auto now = clock_();
  read_members();
  Liveness l = liveness(now, /*ending=*/true);
  failed_ = false;
  last_poll_ = now;
  mark_silent(l);
}

Coordinator::Result Coordinator::poll_once() {
  const auto now = clock_();
  Result r;
  read_members();
  if (resumed_ && resumed_at_ == Time{}) resumed_at_ = now;
  Liveness l = liveness(now);
  failed_ = false;
  last_poll_ = now;
  r.alive = static_cast<int>(l.alive.size());
  abort_silent(l, r);
  mark_silent(l);
  if (static_cast<int>(l.alive.size()) > opt_.max_workers) l.alive.resize(opt_.max_workers);
  // A member that failed in (or wants to leave) the current round asks for
  // the next one; requests about older rounds are already answered.
  // (Read with the member keys: no call of its own each poll.)
  const bool asked = current_.number > 0 && wanted_.count(current_.number) > 0;
  r.round = current_;
  if (below_minimum(l.alive.size(), now, r) || settling(l.alive, now)) return r;
  if (l.alive != current_.members || asked) write_round(l, r);
  r.round = current_;
  return r;
}

}  // namespace limbo::elastic
