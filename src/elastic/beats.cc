#include "elastic/beats.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/mman.h>
#include <linux/futex.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <charconv>
#include <climits>
#include <cstring>
#include <sstream>
#include <string_view>
#include <thread>

#include "comm/auth.h"
#include "common/process.h"
#include "elastic/beat_wire.h"
#include "common/error.h"
#include "common/log.h"

namespace limbo::elastic {

int64_t monotonic_ns() {
  timespec ts{};
  ::clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<int64_t>(ts.tv_sec) * 1000000000 + ts.tv_nsec;
}

namespace {

constexpr uint64_t kTableMagic = 0x33746165426f626cULL;  // "lboBeat3"

}  // namespace

using namespace wire;

// ---------- LocalBeats ----------

struct LocalBeats::Shared {
  uint64_t magic;
  std::atomic<int64_t> sent_ns, acked_ns;
  // The relayed events (LocalBeats::Events); ev_seq is a futex word.
  std::atomic<int64_t> ev_round, ev_abort, ev_done, ev_read_ns, ev_wait_ms;
  std::atomic<uint32_t> ev_seq;
  // A sequence lock per slot: odd while its writer (the worker beating, or
  // the launcher clearing it for the next worker) changes it, so that a
  // reader never takes one worker's id with another's counter.
  struct Slot {
    std::atomic<int64_t> version, id, counter, beat_ns;
  } slots[kSlots];
};

std::shared_ptr<LocalBeats> LocalBeats::create() {
  std::shared_ptr<LocalBeats> t(new LocalBeats);
  const std::string name = "/limbo-beats-" + std::to_string(::getpid()) + "-" + to_hex(comm::random_bytes(4));
  const int fd = ::shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
  if (fd < 0) throw Error("cannot create the heartbeat table " + name + ": " + std::strerror(errno));
  t->bytes_ = sizeof(Shared);
  void* p = ::ftruncate(fd, static_cast<off_t>(t->bytes_)) == 0
                ? ::mmap(nullptr, t->bytes_, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0)
                : MAP_FAILED;
  ::close(fd);
  if (p == MAP_FAILED) {
    ::shm_unlink(name.c_str());
    throw Error("cannot map the heartbeat table " + name + ": " + std::strerror(errno));
  }
  t->s_ = new (p) Shared{};  // zeroed by ftruncate; the atomics start at 0
  t->s_->magic = kTableMagic;
  t->name_ = name;
  t->owner_ = t->mapped_ = true;
  t->used_.assign(kSlots, false);
  return t;
}

std::shared_ptr<LocalBeats> LocalBeats::in_process() {
  std::shared_ptr<LocalBeats> t(new LocalBeats);
  t->s_ = new Shared{};
  t->s_->magic = kTableMagic;
  t->used_.assign(kSlots, false);
  return t;
}

std::shared_ptr<LocalBeats> LocalBeats::open(const std::string& name) {
  const int fd = ::shm_open(name.c_str(), O_RDWR, 0);
  if (fd < 0) throw Error("cannot open the heartbeat table " + name + ": " + std::strerror(errno));
  void* p = ::mmap(nullptr, sizeof(Shared), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  ::close(fd);
  if (p == MAP_FAILED) throw Error("cannot map the heartbeat table " + name + ": " + std::strerror(errno));
  std::shared_ptr<LocalBeats> t(new LocalBeats);
  t->s_ = static_cast<Shared*>(p);
  t->bytes_ = sizeof(Shared);
  t->name_ = name;
  t->mapped_ = true;
  if (t->s_->magic != kTableMagic) throw Error(name + " is not a heartbeat table");
  return t;
}

LocalBeats::~LocalBeats() {
  if (!s_) return;
  if (mapped_) {
    ::munmap(s_, bytes_);
    if (owner_) ::shm_unlink(name_.c_str());
  } else {
    delete s_;
  }
}

int LocalBeats::acquire() {
  for (int i = 0; i < static_cast<int>(used_.size()); ++i)
    if (!used_[i]) {
      used_[i] = true;
      return i;
    }
  return -1;
}

namespace {

// A slot's writer: the version odd around the change (one writer at a time:
// the worker that holds the slot, or its launcher after it exited).
template <class F>
void write_slot(std::atomic<int64_t>& version, F&& change) {
  const int64_t v = version.load(std::memory_order_relaxed);
  version.store(v + 1, std::memory_order_relaxed);
  std::atomic_thread_fence(std::memory_order_release);
  change();
  version.store(v + 2, std::memory_order_release);
}

}  // namespace

void LocalBeats::release(int slot) {
  if (slot < 0 || slot >= static_cast<int>(used_.size())) return;
  auto& s = s_->slots[slot];
  // Its worker may have been killed in the middle of a beat, leaving the
  // version odd: the release starts from the next odd number and ends even,
  // so that the slot's next holder is read again.
  auto& v = s.version;
  v.store(v.load(std::memory_order_relaxed) | 1, std::memory_order_relaxed);
  std::atomic_thread_fence(std::memory_order_release);
  s.id.store(0, std::memory_order_relaxed);
  s.counter.store(0, std::memory_order_relaxed);
  v.store(v.load(std::memory_order_relaxed) + 1, std::memory_order_release);
  used_[slot] = false;
}

void LocalBeats::beat(int slot, int64_t id) {
  auto& s = s_->slots[slot];
  write_slot(s.version, [&] {
    s.id.store(id, std::memory_order_relaxed);
    s.beat_ns.store(monotonic_ns(), std::memory_order_relaxed);
    s.counter.store(s.counter.load(std::memory_order_relaxed) + 1, std::memory_order_relaxed);
  });
}

void LocalBeats::testing_cut_beat(int slot) {
  auto& v = s_->slots[slot].version;
  v.store(v.load(std::memory_order_relaxed) + 1, std::memory_order_release);
}

int64_t LocalBeats::counter(int slot) const { return entry(slot).counter; }

LocalBeats::Entry LocalBeats::entry(int slot) const {
  const auto& s = s_->slots[slot];
  // A change takes a few stores; a writer frozen in the middle of one
  // (SIGSTOP) never ends it, and its slot then reads as empty: the frozen
  // worker is not relayed, and found silent, as it should be.
  for (int tries = 0; tries < 64; ++tries) {
    const int64_t v = s.version.load(std::memory_order_acquire);
    if (v & 1) {
      std::this_thread::yield();
      continue;
    }
    Entry e;
    e.id = s.id.load(std::memory_order_relaxed);
    e.counter = s.counter.load(std::memory_order_relaxed);
    e.beat_ns = s.beat_ns.load(std::memory_order_relaxed);
    std::atomic_thread_fence(std::memory_order_acquire);
    if (s.version.load(std::memory_order_relaxed) == v) return e;
  }
  return Entry{};
}

std::vector<LocalBeats::Entry> LocalBeats::entries() const {
  std::vector<Entry> out;
  for (int i = 0; i < kSlots; ++i) {
    Entry e = entry(i);
    if (e.id > 0 && e.counter > 0) out.push_back(e);
  }
  return out;
}

void LocalBeats::mark_sent(int64_t ns) { s_->sent_ns.store(ns); }
void LocalBeats::mark_acked(int64_t ns) { s_->acked_ns.store(ns); }
int64_t LocalBeats::sent_ns() const { return s_->sent_ns.load(); }
int64_t LocalBeats::acked_ns() const { return s_->acked_ns.load(); }

namespace {

void raise_to(std::atomic<int64_t>& a, int64_t v, bool* changed) {
  int64_t cur = a.load();
  while (cur < v)
    if (a.compare_exchange_weak(cur, v)) {
      *changed = true;
      return;
    }
}

long futex(const std::atomic<uint32_t>& word, int op, uint32_t value, const timespec* timeout) {
  // Not FUTEX_PRIVATE_FLAG: the word is shared between processes.
  return ::syscall(SYS_futex, reinterpret_cast<const uint32_t*>(&word), op, value, timeout, nullptr, 0);
}

}  // namespace

void LocalBeats::relay_events(int64_t round, int64_t abort, bool done, int64_t now_ns, int64_t wait_ms) {
  bool changed = false;
  raise_to(s_->ev_round, round, &changed);
  raise_to(s_->ev_abort, abort, &changed);
  raise_to(s_->ev_done, done ? 1 : 0, &changed);
  s_->ev_wait_ms.store(wait_ms);
  s_->ev_read_ns.store(now_ns);
  if (changed) {
    s_->ev_seq.fetch_add(1);
    futex(s_->ev_seq, FUTEX_WAKE, INT32_MAX, nullptr);
  }
}

LocalBeats::Events LocalBeats::events() const {
  Events e;
  e.seq = s_->ev_seq.load();  // first: a change after it is seen by the next wait
  e.round = s_->ev_round.load();
  e.abort = s_->ev_abort.load();
  e.done = s_->ev_done.load() != 0;
  e.read_ns = s_->ev_read_ns.load();
  e.wait_ms = s_->ev_wait_ms.load();
  return e;
}

void LocalBeats::wait_events(uint32_t seq, std::chrono::milliseconds timeout) const {
  const timespec ts{static_cast<time_t>(timeout.count() / 1000), static_cast<long>(timeout.count() % 1000) * 1000000};
  futex(s_->ev_seq, FUTEX_WAIT, seq, &ts);  // (returns at once when the word moved on)
}

bool LocalBeats::events_current(int64_t now_ns) const {
  const int64_t read = s_->ev_read_ns.load();
  const int64_t allowed = (2 * s_->ev_wait_ms.load() + 500) * 1000000;
  return read > 0 && now_ns - read < allowed;
}

// ---------- BeatTable ----------

void BeatTable::note(int64_t id, int64_t counter, Time at) {
  std::lock_guard<std::mutex> lock(mu_);
  note_locked(id, counter, at, std::chrono::steady_clock::now());
}

void BeatTable::note_all(const std::vector<Beat>& beats) {
  const auto now = std::chrono::steady_clock::now();
  std::lock_guard<std::mutex> lock(mu_);
  for (const auto& b : beats) note_locked(b.id, b.counter, b.at, now);
}

void BeatTable::note_locked(int64_t id, int64_t counter, Time at, Time now) {
  auto [it, fresh] = seen_.try_emplace(id);
  Held& h = it->second;
  if (!fresh && counter <= h.seen.counter) return;
  h.seen = {counter, at};
  h.arrived = last_ = now;
  if (fresh) {
    h.pos = order_.insert(order_.end(), id);
  } else {
    order_.splice(order_.end(), order_, h.pos);
  }
  if (!h.changed) {
    h.changed = true;
    changed_.push_back(id);
  }
  // Workers not heard from for forget_after_, the oldest first: at most
  // one a beat beyond the first (amortised O(1)).
  while (!order_.empty() && order_.front() != id) {
    auto old = seen_.find(order_.front());
    if (now - old->second.arrived <= forget_after_ || old->second.changed) break;
    seen_.erase(old);
    order_.pop_front();
  }
}

std::vector<std::pair<int64_t, BeatTable::Seen>> BeatTable::take_changes() {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<std::pair<int64_t, Seen>> out;
  out.reserve(changed_.size());
  for (int64_t id : changed_) {
    auto& h = seen_.at(id);
    h.changed = false;
    out.emplace_back(id, h.seen);
  }
  changed_.clear();
  return out;
}

std::map<int64_t, BeatTable::Seen> BeatTable::read() const {
  std::lock_guard<std::mutex> lock(mu_);
  std::map<int64_t, Seen> out;
  for (const auto& [id, h] : seen_) out.emplace(id, h.seen);
  return out;
}

size_t BeatTable::size() const {
  std::lock_guard<std::mutex> lock(mu_);
  return seen_.size();
}

BeatTable::Time BeatTable::last_arrival() const {
  std::lock_guard<std::mutex> lock(mu_);
  return last_;
}

// ---------- BeatSender ----------

BeatSender::BeatSender(std::shared_ptr<LocalBeats> table, BeatSenderOptions opt, int only_slot)
    : table_(std::move(table)), opt_(std::move(opt)), only_slot_(only_slot), nonce_(to_hex(comm::random_bytes(8))) {
  fd_ = ::socket(AF_INET, SOCK_DGRAM | SOCK_CLOEXEC, 0);
  if (fd_ < 0) throw Error(std::string("cannot open a heartbeat socket: ") + std::strerror(errno));
  resolver_ = std::thread([this] { resolve_loop(); });
  thread_ = std::thread([this] { loop(); });
}

BeatSender::~BeatSender() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
  if (resolver_.joinable()) resolver_.join();
  ::close(fd_);
}

// Reads the listener's address whenever the send thread asks.
void BeatSender::resolve_loop() {
  name_this_thread("limbo-resolve");
  while (true) {
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [&] { return stop_ || want_; });
      if (stop_) return;
    }
    resolve();
    std::lock_guard<std::mutex> lock(mu_);
    want_ = false;
  }
}

// Reads the listener's address from the store; a new, usable one is handed
// to the send thread. Nothing while there is none (no coordinator yet, or
// the store out of reach).
void BeatSender::resolve() {
  std::optional<std::string> v;
  try {
    if (!store_) store_ = opt_.connect();
    v = store_->try_get("elastic/beat_addr");
  } catch (const std::exception&) {
    store_.reset();  // a new connection next time
    return;
  }
  if (!v || *v == resolved_text_) return;
  std::istringstream in(*v);
  std::string hostport, nonce;
  in >> hostport >> nonce;
  const auto colon = hostport.rfind(':');
  sockaddr_in a{};
  if (colon == std::string::npos || nonce.empty() ||
      !resolve_udp(hostport.substr(0, colon), std::atoi(hostport.c_str() + colon + 1), &a)) {
    log_warn("heartbeats: cannot use the coordinator's address '" + *v + "'");
    return;
  }
  resolved_text_ = *v;
  std::lock_guard<std::mutex> lock(mu_);
  new_text_ = *v;
  new_nonce_ = nonce;
  new_addr_ = a;
  have_new_ = true;
}

// Takes an address the resolve thread found (send thread).
bool BeatSender::take_resolved() {
  std::lock_guard<std::mutex> lock(mu_);
  if (!have_new_) return false;
  have_new_ = false;
  if (::connect(fd_, reinterpret_cast<sockaddr*>(&new_addr_), sizeof new_addr_) != 0) return false;
  addr_text_ = new_text_;
  coord_nonce_ = new_nonce_;
  return true;
}

std::string beat_datagram(const std::string& token, const std::string& coord_nonce, const std::string& sender_nonce,
                          int64_t seq, const LocalBeats::Entry* entries, size_t count, int64_t now_ns) {
  std::string body = "LB1 " + coord_nonce + " " + sender_nonce + " " + std::to_string(seq);
  for (size_t i = 0; i < std::min<size_t>(count, kEntriesPerDatagram); ++i) {
    const auto& e = entries[i];
    body += "\n" + std::to_string(e.id) + " " + std::to_string(e.counter) + " " +
            std::to_string(std::max<int64_t>(0, (now_ns - e.beat_ns) / 1000));
  }
  return seal(token, body);
}

void BeatSender::send(const std::vector<LocalBeats::Entry>& entries, int64_t now) {
  for (size_t first = 0; first < entries.size(); first += kEntriesPerDatagram) {
    const std::string msg = beat_datagram(opt_.token, coord_nonce_, nonce_, ++seq_, entries.data() + first,
                                          entries.size() - first, now);
    ::send(fd_, msg.data(), msg.size(), MSG_DONTWAIT);  // a full buffer or a refusal: the next interval tries again
  }
}

void BeatSender::receive_acks(std::chrono::milliseconds wait) {
  char buf[512];
  pollfd p{fd_, POLLIN, 0};
  if (::poll(&p, 1, static_cast<int>(std::max<int64_t>(0, wait.count()))) <= 0) return;
  while (true) {
    const ssize_t n = ::recv(fd_, buf, sizeof buf, MSG_DONTWAIT);
    if (n <= 0) return;
    std::string body;
    if (!unseal(opt_.token, std::string(buf, static_cast<size_t>(n)), &body)) continue;
    std::istringstream in(body);
    std::string magic, coord, sender;
    int64_t seq = 0;
    // From the listener this sender sends to, for a datagram it sent, and
    // newer than the last one acknowledged: a recorded acknowledgement
    // replayed counts never again, and one from a former coordinator not at
    // all (either would keep a cut-off relay "acknowledged").
    if (!(in >> magic >> coord >> sender >> seq) || magic != "LA2" || coord != coord_nonce_ || sender != nonce_ ||
        seq > seq_ || seq <= acked_seq_)
      continue;
    acked_seq_ = seq;
    const int64_t now = monotonic_ns();
    acked_ns_ = now;
    if (only_slot_ < 0) table_->mark_acked(now);
  }
}

void BeatSender::loop() {
  name_this_thread("limbo-beat-out");
  const int64_t interval = std::chrono::nanoseconds(opt_.interval).count();
  int64_t next = monotonic_ns();
  while (!stop_) {
    take_resolved();
    const int64_t now = monotonic_ns();
    // No address yet, or no answer for three intervals (the coordinator
    // moved, or is gone): ask for the address again, once an interval
    // while the answers stay away (a take-over's new address is found
    // within an interval of being written, not three), and go on sending to
    // the one there is meanwhile.
    const bool unanswered = now - acked_ns_.load() > 3 * interval;
    if ((addr_text_.empty() || unanswered) && now - asked_ns_ > interval) {
      asked_ns_ = now;
      {
        std::lock_guard<std::mutex> lock(mu_);
        want_ = true;
      }
      cv_.notify_all();
    }
    if (!addr_text_.empty()) {
      auto entries = only_slot_ >= 0 ? std::vector<LocalBeats::Entry>{table_->entry(only_slot_)} : table_->entries();
      entries.erase(std::remove_if(entries.begin(), entries.end(), [](const auto& e) { return e.id <= 0 || e.counter <= 0; }),
                    entries.end());
      if (!entries.empty()) send(entries, now);
    }
    if (only_slot_ < 0) table_->mark_sent(now);  // the relay runs (read by its workers)
    next += interval;
    if (next < monotonic_ns()) next = monotonic_ns();  // late (stopped, starved): no burst
    while (!stop_) {
      const int64_t left = next - monotonic_ns();
      if (left <= 0) break;
      receive_acks(std::chrono::milliseconds(std::min<int64_t>(left / 1000000 + 1, 20)));
      if (addr_text_.empty() && take_resolved()) break;  // the first address: send at once
    }
  }
}

}  // namespace limbo::elastic
