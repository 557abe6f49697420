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

EventRelay::EventRelay(std::shared_ptr<LocalBeats> table, std::function<std::shared_ptr<comm::KvStore>()> connect,
                       std::chrono::milliseconds wait)
    : table_(std::move(table)), connect_(std::move(connect)), wait_(wait) {
  thread_ = std::thread([this] { loop(); });
}

EventRelay::~EventRelay() {
  stop_ = true;
  if (thread_.joinable()) thread_.join();
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
      if (!s) s = connect_();
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
