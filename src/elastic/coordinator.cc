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
  events_ = store_->add("elastic/events", 0);
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
  const auto now = clock_();
  Result r;
  const int64_t registered = store_->add("elastic/next_id", 0);
  std::vector<int64_t> alive;
  std::set<int64_t> left;
  for (int64_t id = 1; id <= registered; ++id) {
    if (!store_->try_get("elastic/join/" + std::to_string(id))) continue;
    if (dead_.count(id)) continue;
    if (store_->try_get("elastic/left/" + std::to_string(id))) {
      left.insert(id);
      continue;
    }
    auto hb = store_->try_get("elastic/hb/" + std::to_string(id));
    int64_t beat = hb ? std::stoll(*hb) : 0;
    auto it = heartbeats_.find(id);
    if (it == heartbeats_.end() || it->second.first != beat) {
      heartbeats_[id] = {beat, now};
    } else if (now - it->second.second > opt_.heartbeat_timeout) {
      continue;  // silent for too long (crashed, stopped or cut off)
    }
    alive.push_back(id);
  }
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
