#include "elastic/event_relay.h"

#include "common/log.h"

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
int64_t to_int(const std::optional<std::string>& v) {
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
}

// Over a store with streams (etcd): the event log followed on one stream
// held open, where waiting for each event would open a new watch (and a
// new connection) every wait. The stream is reopened (from where it was)
// only when it idles for five waits; the relay then marks itself current
// (so the table says it may be up to that late: workers fall back to the
// store after twice that), reads `elastic/done` (not in the log), and every
// fifth time the round and abort keys too (a safety net). The state is
// read once the stream runs; raising to the same values twice is harmless.
// False when the store has no streams, or the stream broke (the caller
// goes on without).
bool EventRelay::follow(comm::KvStore& s) {
  const int64_t idle_ms = 5 * wait_.count();
  bool started = false;
  int idle = 0;
  auto last = monotonic_ns();
  auto read_state = [&](bool all) {
    int64_t round = 0, abort = 0;
    if (all) {
      round = to_int(s.try_get("elastic/round"));
      abort = to_int(s.try_get("elastic/abort"));
    }
    const bool done = s.try_get("elastic/done").has_value();
    table_->relay_events(round, abort, done, monotonic_ns(), idle_ms);
  };
  const bool ok = s.follow(
      "elastic/event/", std::chrono::milliseconds(idle_ms),
      [&] {
        // Before the stream opens, after each answer, and when it idled.
        if (!started) {
          started = true;
          read_state(true);
          last = monotonic_ns();
        } else if (monotonic_ns() - last >= idle_ms * 1000000 * 9 / 10) {
          read_state(++idle % 5 == 0);
          last = monotonic_ns();
        }
        return stop_.load();
      },
      [&](const std::string&, const std::string& value) {
        const auto [kind, k] = parse_event(value);
        if (kind == "round") table_->relay_events(k, 0, false, monotonic_ns(), idle_ms);
        else if (kind == "abort") table_->relay_events(0, k, false, monotonic_ns(), idle_ms);
        last = monotonic_ns();
      });
  return ok && started;
}

void EventRelay::request_stop() {
  stop_ = true;
  std::lock_guard<std::mutex> lock(mu_);
  if (current_) current_->interrupt_follow();
}

EventRelay::~EventRelay() {
  request_stop();
  if (thread_.joinable()) thread_.join();
}


// The event log in order, as a member's watch reads it; each store answer
// is marked in the table (it is current), each event raises its round or
// abort there. From a fresh start (or after a store failure) the round,
// abort and done keys give the state the log's earlier events left.
void EventRelay::loop() {
  std::shared_ptr<comm::KvStore> s;
  int64_t n = 0;
  int quiet = 0;
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
        const int64_t round = to_int(s->try_get("elastic/round"));
        const int64_t abort = to_int(s->try_get("elastic/abort"));
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
        quiet = 0;
      } else {
        // Quiet: `elastic/done` (written by a member, not logged) every
        // wait; the round and abort keys every fifth.
        const bool done = s->try_get("elastic/done").has_value();
        int64_t round = 0, abort = 0;
        if (++quiet % 5 == 0) {
          round = to_int(s->try_get("elastic/round"));
          abort = to_int(s->try_get("elastic/abort"));
        }
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
