#include "elastic/event_relay.h"

#include "common/log.h"
#include "common/process.h"

namespace limbo::elastic {

std::pair<std::string, int64_t> parse_event(const std::string& event) {
  const auto space = event.find(' ');
  if (space == std::string::npos) return {"", 0};
  try {
    size_t used = 0;
    const std::string number = event.substr(space + 1);
    const int64_t k = std::stoll(number, &used);
    if (used != number.size()) return {"", 0};
    return {event.substr(0, space), k};
  } catch (const std::exception&) {
    return {"", 0};
  }
}

namespace {
int64_t stored_int(const std::optional<std::string>& v) {
  try {
    return v ? std::stoll(*v) : 0;
  } catch (const std::exception&) {
    return 0;
  }
}
}  // namespace

EventRelay::EventRelay(std::shared_ptr<LocalBeats> table, std::function<std::shared_ptr<comm::KvStore>()> connect,
                       std::chrono::milliseconds wait)
    : table_(std::move(table)), connect_(std::move(connect)), wait_(wait) {
  thread_ = std::thread([this] { loop(); });
  checker_ = std::thread([this] { check_loop(); });
}

// Over a store with streams (etcd): the event log followed on one stream
// held open, where waiting for each event would open a new watch (and a
// new connection) every wait; the stream is reopened (from where it was)
// when it idles for five waits. Current means what the table holds is
// true as of a read: a stream may deliver nothing while looking open (held
// by an etcd member cut off from its cluster, or a proxy that buffers it),
// so a checker on a connection of its own reads the log's count and
// `elastic/done` every wait (verify()). A stream behind the count gets its
// missing events relayed from point reads at once, and is reopened when it
// is still behind at the next check. False when the store has no streams,
// or the stream broke (the caller goes on without).
bool EventRelay::follow(comm::KvStore& s) {
  const int64_t idle_ms = 5 * wait_.count();
  bool started = false;
  streamed_ = -1;  // the checker waits for the stream to open
  const bool ok = s.follow(
      "elastic/event/", std::chrono::milliseconds(idle_ms),
      [&] {
        if (!started) {  // before the stream opens: the state it starts from
          started = true;
          const int64_t n = stored_int(s.try_get("elastic/events"));
          const int64_t round = stored_int(s.try_get("elastic/round"));
          const int64_t abort = stored_int(s.try_get("elastic/abort"));
          const bool done = s.try_get("elastic/done").has_value();
          table_->relay_events(round, abort, done, monotonic_ns(), wait_.count());
          streamed_ = n;
        }
        return stop_.load();
      },
      [&](const std::string& key, const std::string& value) {
        const auto [kind, k] = parse_event(value);
        if (kind == "round") table_->relay_events(k, 0, false, monotonic_ns(), wait_.count());
        else if (kind == "abort") table_->relay_events(0, k, false, monotonic_ns(), wait_.count());
        const auto n = stored_int(key.substr(key.rfind('/') + 1));
        if (n > streamed_.load()) streamed_ = n;
      });
  streamed_ = -1;
  return ok && started;
}

// The checker's look, every wait while a stream is followed: the table is
// marked current only by a read that agrees with it.
void EventRelay::verify(comm::KvStore& c, int64_t* behind_at) {
  const int64_t streamed = streamed_.load();
  if (streamed < 0) {  // no stream open (the loop's own waits mark the table)
    *behind_at = -1;
    return;
  }
  const int64_t count = stored_int(c.try_get("elastic/events"));
  const bool done = c.try_get("elastic/done").has_value();
  if (count <= streamed) {
    *behind_at = -1;
    table_->relay_events(0, 0, done, monotonic_ns(), wait_.count());
    return;
  }
  // Behind: the missing events from point reads, now (harmless should the
  // stream bring them too).
  for (int64_t n = streamed + 1; n <= count; ++n) {
    const auto [kind, k] = parse_event(c.try_get("elastic/event/" + std::to_string(n)).value_or(""));
    if (kind == "round") table_->relay_events(k, 0, done, monotonic_ns(), wait_.count());
    else if (kind == "abort") table_->relay_events(0, k, done, monotonic_ns(), wait_.count());
  }
  if (*behind_at >= 0 && streamed < *behind_at) {
    // Still behind what it lacked a wait ago: the stream delivers nothing.
    log_warn("launch: the store's event stream delivered nothing for " + std::to_string(wait_.count()) +
             " ms while events were written; opening it again");
    std::lock_guard<std::mutex> lock(mu_);
    if (current_) current_->interrupt_follow();
    *behind_at = -1;
    return;
  }
  *behind_at = count;
}

void EventRelay::check_loop() {
  name_this_thread("limbo-ev-check");
  std::shared_ptr<comm::KvStore> c;
  int64_t behind_at = -1;
  while (!stop_) {
    std::unique_lock<std::mutex> lock(check_mu_);
    check_cv_.wait_for(lock, wait_, [&] { return stop_.load(); });
    lock.unlock();
    if (stop_) return;
    if (streamed_.load() < 0) continue;
    try {
      if (!c) c = connect_();
      verify(*c, &behind_at);
    } catch (const std::exception&) {
      c.reset();  // not marked: the table ages, and workers fall back to the store
    }
  }
}

void EventRelay::request_stop() {
  stop_ = true;
  std::lock_guard<std::mutex> lock(mu_);
  if (current_) current_->interrupt_follow();
}

EventRelay::~EventRelay() {
  request_stop();
  {
    std::lock_guard<std::mutex> lock(check_mu_);
    check_cv_.notify_all();
  }
  if (thread_.joinable()) thread_.join();
  if (checker_.joinable()) checker_.join();
}


// The event log in order, as a member's watch reads it; each store answer
// is marked in the table (it is current), each event raises its round or
// abort there. From a fresh start (or after a store failure) the round,
// abort and done keys give the state the log's earlier events left.
void EventRelay::loop() {
  name_this_thread("limbo-events");
  std::shared_ptr<comm::KvStore> s;
  int64_t n = 0;
  bool fresh = true;
  const int64_t wait_ms = wait_.count();
  while (!stop_) {
    try {
      if (!s) {
        s = connect_();
        std::lock_guard<std::mutex> lock(mu_);
        current_ = s;
        if (stop_) return;
      }
      if (follow(*s)) return;
      if (fresh) {
        n = s->add("elastic/events", 0);
        const int64_t round = stored_int(s->try_get("elastic/round"));
        const int64_t abort = stored_int(s->try_get("elastic/abort"));
        const bool done = s->try_get("elastic/done").has_value();
        table_->relay_events(round, abort, done, monotonic_ns(), wait_ms);
        fresh = false;
      }
      const std::string key = "elastic/event/" + std::to_string(n + 1);
      if (s->wait_for(key, wait_)) {
        const auto ev = s->try_get(key);
        const auto [kind, k] = parse_event(ev.value_or(""));
        if (kind == "round") table_->relay_events(k, 0, false, monotonic_ns(), wait_ms);
        else if (kind == "abort") table_->relay_events(0, k, false, monotonic_ns(), wait_ms);
        else log_warn("launch: ignored a malformed membership event '" + ev.value_or("") + "'");
        ++n;
      } else {
        // Quiet: `elastic/done` (written by a member, not logged), the
        // round and abort keys (a safety net should an event be missing),
        // every wait: the table is current as of these reads.
        const bool done = s->try_get("elastic/done").has_value();
        const int64_t round = stored_int(s->try_get("elastic/round"));
        const int64_t abort = stored_int(s->try_get("elastic/abort"));
        table_->relay_events(round, abort, done, monotonic_ns(), wait_ms);
      }
    } catch (const std::exception& e) {
      // Not marked current: after two waits the workers watch the store
      // themselves. A new connection, and the state read again.
      s.reset();
      fresh = true;
      for (int i = 0; i < 5 && !stop_; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
  }
}

}  // namespace limbo::elastic
