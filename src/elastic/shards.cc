#include "elastic/shards.h"

#include <dirent.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <thread>
#include <cerrno>
#include <cstring>
#include <map>
#include <set>

#include "comm/shm_group.h"
#include "common/error.h"
#include "common/log.h"

namespace limbo::elastic {
namespace {

constexpr uint64_t kMagic = 0x6c696d626f7a6572ULL;  // "limbozer"
constexpr int64_t kLine = 16;                       // floats in a 64-byte line

bool running(pid_t pid) { return pid > 0 && comm::process_alive(pid); }

}  // namespace

struct ShardHome::Header {
  uint64_t magic;
  char host[512];
  int64_t n, lo, hi, states;
  int32_t pid;
  std::atomic<int64_t> step[2];
  int64_t optimizer_steps[2];
  int64_t has_state[2];
  // A home with a log (logged != 0): version 0 only, and the log of step
  // log_step (-1: none) with its rate and skip; `cursor` elements updated.
  int64_t logged;
  std::atomic<int64_t> log_step, cursor;
  // The chunk whose new values the scratch holds whole (-1: none).
  std::atomic<int64_t> scratch_at;
  // The process finishing the update (0: none): one at a time.
  std::atomic<int32_t> finisher;
  // Parts given back (ShardHome::Part bits), and the step slot 0 holds
  // whole before version 0 is committed (-1: none).
  std::atomic<int64_t> given_back, weights_step;
  double log_lr;
  int64_t log_skip;
};

std::vector<int64_t> shard_bounds(int64_t n, int world) {
  if (world < 1) throw Error("shard_bounds: a group of " + std::to_string(world));
  const int64_t lines = (n + kLine - 1) / kLine;
  std::vector<int64_t> b(static_cast<size_t>(world) + 1);
  for (int r = 0; r <= world; ++r) b[r] = std::min(n, lines * r / world * kLine);
  b[world] = n;
  return b;
}

namespace {
int64_t header_bytes() { return (static_cast<int64_t>(sizeof(ShardHome::Header)) + 4095) / 4096 * 4096; }
constexpr int64_t kChunk = int64_t{1} << 16;  // floats of a chunk of roll_forward (256 KiB a slot)
// Floats after the header: two versions, or one, the log and the scratch.
int64_t data_floats(int64_t size, int64_t states, bool logged) {
  return logged ? size * (states + 1) + kChunk * states : size * 2 * states;
}
}  // namespace

ShardHome::ShardHome(const std::string& name, int64_t n, int64_t lo, int64_t hi, int states, bool logged) {
  bytes_ = header_bytes() + static_cast<int64_t>(sizeof(float)) * data_floats(hi - lo, states, logged);
  if (!name.empty()) {
    const int fd = ::shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
    std::string why;
    if (fd < 0) {
      why = std::string("shm_open: ") + std::strerror(errno);
    } else {
      // Two versions: reserved now (a full /dev/shm fails here, not at a
      // write). With a log: only checked for room, so that its pages cost
      // memory as they are first written (the weights first, the state at
      // the first update): a model that a member holds only in shards is
      // whole in this process while its home is made.
      int rc = ::ftruncate(fd, bytes_) == 0 ? 0 : errno;
      if (rc == 0 && !logged) rc = ::posix_fallocate(fd, 0, bytes_);
      struct statvfs fs {};
      if (rc == 0 && logged && ::fstatvfs(fd, &fs) == 0 &&
          static_cast<int64_t>(fs.f_bavail) * static_cast<int64_t>(fs.f_frsize) < bytes_)
        rc = ENOSPC;
      if (rc == 0) {
        void* p = ::mmap(nullptr, static_cast<size_t>(bytes_), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
        if (p != MAP_FAILED) {
          base_ = static_cast<uint8_t*>(p);
          mapped_ = true;
          name_ = name;
        } else {
          why = std::string("mmap: ") + std::strerror(errno);
        }
      } else {
        why = "reserving " + std::to_string(bytes_ >> 20) + " MiB in /dev/shm: " + std::strerror(rc);
      }
      ::close(fd);
      if (!mapped_) ::shm_unlink(name.c_str());
    }
    if (!mapped_)
      log_warn("the optimizer state's shard stays in this process's memory (" + why +
               "): a crash of this worker loses it");
  }
  if (!mapped_) {
    private_.assign(static_cast<size_t>((bytes_ + 3) / 4), 0.0f);
    base_ = reinterpret_cast<uint8_t*>(private_.data());
  }
  h_ = new (base_) Header{};
  const std::string host = comm::host_identity();
  std::strncpy(h_->host, host.c_str(), sizeof h_->host - 1);
  h_->n = n;
  h_->lo = lo;
  h_->hi = hi;
  h_->states = states;
  h_->pid = static_cast<int32_t>(::getpid());
  h_->step[0].store(-1);
  h_->step[1].store(-1);
  h_->logged = logged ? 1 : 0;
  h_->log_step.store(-1);
  h_->cursor.store(0);
  h_->scratch_at.store(-1);
  h_->finisher.store(0);
  h_->given_back.store(0);
  h_->weights_step.store(-1);
  h_->magic = kMagic;
}

std::unique_ptr<ShardHome> ShardHome::open(const std::string& name) {
  const int fd = ::shm_open(name.c_str(), O_RDWR, 0);
  if (fd < 0) return nullptr;
  struct stat st {};
  void* p = MAP_FAILED;
  if (::fstat(fd, &st) == 0 && st.st_size >= static_cast<off_t>(sizeof(Header)))
    p = ::mmap(nullptr, static_cast<size_t>(st.st_size), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  ::close(fd);
  if (p == MAP_FAILED) return nullptr;
  std::unique_ptr<ShardHome> home(new ShardHome());
  home->base_ = static_cast<uint8_t*>(p);
  home->bytes_ = st.st_size;
  home->mapped_ = true;
  home->name_ = name;
  home->h_ = reinterpret_cast<Header*>(p);
  const Header* h = home->h_;
  const bool ok = h->magic == kMagic && std::string(h->host, strnlen(h->host, sizeof h->host)) == comm::host_identity() &&
                  h->lo >= 0 && h->lo <= h->hi && h->hi <= h->n && h->states >= 0 && h->states <= 3 &&  // AdamW's two, and the weights (shard_weights)
                  header_bytes() + 4 * data_floats(h->hi - h->lo, h->states, h->logged != 0) <= st.st_size;
  if (!ok) home->h_ = nullptr;  // the destructor unmaps it
  return ok ? std::move(home) : nullptr;
}

ShardHome::~ShardHome() {
  if (mapped_) ::munmap(base_, static_cast<size_t>(bytes_));
}

int64_t ShardHome::n() const { return h_->n; }
int64_t ShardHome::lo() const { return h_->lo; }
int64_t ShardHome::hi() const { return h_->hi; }
int ShardHome::states() const { return static_cast<int>(h_->states); }
pid_t ShardHome::owner() const { return h_->pid; }

int ShardHome::version_of(int64_t step) const {
  if (h_->logged) {
    // Under way (a cursor past 0 with the log of the next step): neither.
    const bool held = h_->step[0].load(std::memory_order_acquire) == step &&
                      (h_->cursor.load(std::memory_order_acquire) == 0 ||
                       h_->log_step.load(std::memory_order_acquire) <= step);
    return held ? 0 : -1;
  }
  for (int v = 0; v < 2; ++v)
    if (h_->step[v].load(std::memory_order_acquire) == step) return v;
  return -1;
}

float* ShardHome::state(int v, int i) {
  return reinterpret_cast<float*>(base_ + header_bytes()) + (v * states() + i) * size();
}

bool ShardHome::logged() const { return h_->logged != 0; }
float* ShardHome::log() { return reinterpret_cast<float*>(base_ + header_bytes()) + states() * size(); }
int64_t ShardHome::log_step() const { return h_->log_step.load(std::memory_order_acquire); }
int64_t ShardHome::cursor() const { return h_->cursor.load(std::memory_order_acquire); }

void ShardHome::begin_log() {
  h_->log_step.store(-1, std::memory_order_release);
  h_->cursor.store(0, std::memory_order_release);
  h_->scratch_at.store(-1, std::memory_order_release);
}

void ShardHome::log_written(int64_t step, double lr, bool skip) {
  h_->log_lr = lr;
  h_->log_skip = skip ? 1 : 0;
  h_->log_step.store(step, std::memory_order_release);
}

bool ShardHome::roll_forward(int64_t step, const Update& update, bool first_state_is_weights) {
  // One process finishes a home (the members of its host that adopt a
  // dead member's home all try): the others wait for it, or take over
  // from one that died meanwhile.
  const int32_t me = static_cast<int32_t>(::getpid());
  const auto t0 = std::chrono::steady_clock::now();
  for (;;) {
    if (version_of(step) >= 0) return true;
    if (log_step() != step || h_->step[0].load(std::memory_order_acquire) != step - 1) return false;
    int32_t cur = h_->finisher.load(std::memory_order_acquire);
    if ((cur == 0 || cur == me || !running(cur)) && h_->finisher.compare_exchange_strong(cur, me)) break;
    if (std::chrono::steady_clock::now() - t0 > std::chrono::seconds(30))
      throw Error("the update of the shard home " + name_ + " to step " + std::to_string(step) + " is held by pid " +
                  std::to_string(cur) + ", which does not finish it");
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  if (version_of(step) >= 0) {  // finished while this process waited
    h_->finisher.store(0, std::memory_order_release);
    return true;
  }
  const bool had = h_->has_state[0] != 0;
  const bool skip = h_->log_skip != 0;
  if (!skip) {
    float* scratch = log() + size();
    std::vector<float*> out(static_cast<size_t>(states()));
    for (int i = 0; i < states(); ++i) out[static_cast<size_t>(i)] = scratch + i * kChunk;
    // Chunks of a fixed size for a home (whoever finishes it cuts the same
    // ones): up to kChunk, at least 8 a shard (16-float lines).
    const int64_t chunk = std::clamp<int64_t>((size() / 8 + 15) / 16 * 16, 16, kChunk);
    for (int64_t at = cursor(); at < size(); at = std::min(size(), at + chunk)) {
      const int64_t e = std::min(size(), at + chunk);
      if (h_->scratch_at.load(std::memory_order_acquire) != at) {  // else: computed whole before a death
        update(at, e, h_->optimizer_steps[0], had, h_->log_lr, out);
        h_->scratch_at.store(at, std::memory_order_release);
      }
      for (int i = 0; i < states(); ++i)
        std::memcpy(state(0, i) + at, out[static_cast<size_t>(i)], sizeof(float) * static_cast<size_t>(e - at));
      h_->cursor.store(e, std::memory_order_release);
    }
  }
  // The state exists after an update whenever the optimizer keeps any.
  const bool has = had || (!skip && states() > (first_state_is_weights ? 1 : 0));
  h_->optimizer_steps[0] += skip ? 0 : 1;
  h_->has_state[0] = has ? 1 : 0;
  h_->step[0].store(step, std::memory_order_release);
  h_->cursor.store(0, std::memory_order_release);
  h_->log_step.store(-1, std::memory_order_release);
  h_->scratch_at.store(-1, std::memory_order_release);
  h_->finisher.store(0, std::memory_order_release);
  return true;
}
int64_t ShardHome::optimizer_steps(int v) const { return h_->optimizer_steps[v]; }
bool ShardHome::has_state(int v) const { return h_->has_state[v] != 0; }

void ShardHome::begin(int v) { h_->step[v].store(-1, std::memory_order_release); }

void ShardHome::commit(int v, int64_t step, int64_t optimizer_steps, bool has_state) {
  h_->optimizer_steps[v] = optimizer_steps;
  h_->has_state[v] = has_state ? 1 : 0;
  h_->step[v].store(step, std::memory_order_release);
}

void ShardHome::give_back(Part part) {
  if (!h_->logged) return;
  const uintptr_t page = static_cast<uintptr_t>(::sysconf(_SC_PAGESIZE));
  auto drop = [&](const void* a, const void* b) {
    // Whole pages only: a private home is heap memory, whose next page is
    // not its own.
    const uintptr_t from = (reinterpret_cast<uintptr_t>(a) + page - 1) / page * page;
    const uintptr_t to = reinterpret_cast<uintptr_t>(b) / page * page;
    // Shared memory: its pages go back to the system (MADV_REMOVE punches
    // the segment); this process's memory: dropped as anonymous pages.
    if (to > from) ::madvise(reinterpret_cast<void*>(from), to - from, mapped_ ? MADV_REMOVE : MADV_DONTNEED);
  };
  const uint8_t* end = base_ + bytes_;
  if (part == kWeights) drop(state(0, 0), state(0, 1));
  if (part == kState) drop(state(0, 1), end);
  if (part == kLog) drop(log(), end);
  h_->given_back.fetch_or(part == kState ? (kState | kLog) : part);
}

bool ShardHome::holds_weights(int64_t step) const {
  return !(h_->given_back.load() & kWeights) && (version_of(step) >= 0 || h_->weights_step.load() == step);
}

bool ShardHome::holds_state(int64_t step) const { return !(h_->given_back.load() & kState) && version_of(step) >= 0; }

void ShardHome::commit_weights(int64_t step) { h_->weights_step.store(step, std::memory_order_release); }

void ShardHome::drop_state() {
  give_back(kState);
  h_->has_state[0] = 0;
}

void ShardHome::unlink() {
  if (!name_.empty()) ::shm_unlink(name_.c_str());
}

namespace {

// The member id in a home's name (prefix, then "m<id>-r<round>..."), or -1.
int64_t member_of(const std::string& name, const std::string& prefix) {
  size_t at = prefix.size();
  if (name.size() <= at + 1 || name[at] != 'm') return -1;
  int64_t id = 0;
  bool digits = false;
  for (++at; at < name.size() && name[at] >= '0' && name[at] <= '9'; ++at) {
    id = id * 10 + (name[at] - '0');
    digits = true;
  }
  return digits && at < name.size() && name[at] == '-' ? id : -1;
}

}  // namespace

std::vector<std::unique_ptr<ShardHome>> open_departed_homes(const std::string& prefix,
                                                            const std::vector<int64_t>& members) {
  std::vector<std::unique_ptr<ShardHome>> out;
  DIR* d = ::opendir("/dev/shm");
  if (!d) return out;
  while (dirent* e = ::readdir(d)) {
    const std::string name = e->d_name;
    if (name.rfind(prefix, 0) != 0) continue;
    const int64_t member = member_of(name, prefix);
    const bool in_round = member >= 0 && std::find(members.begin(), members.end(), member) != members.end();
    auto home = ShardHome::open("/" + name);
    if (!home || home->owner() == ::getpid()) continue;
    // Dead, or alive but out of the round: a frozen (SIGSTOPped) member
    // keeps its process, and its home holds the same committed versions.
    if (!running(home->owner()) || (member >= 0 && !in_round)) out.push_back(std::move(home));
  }
  ::closedir(d);
  return out;
}

int remove_orphaned_homes(const std::string& keep_tag) {
  const std::string base = "limbo-zero-";
  constexpr size_t kTag = 16;  // Member::job_tag(): 16 hex digits
  std::map<std::string, std::vector<std::string>> names;
  std::set<std::string> alive;
  DIR* d = ::opendir("/dev/shm");
  if (!d) return 0;
  while (dirent* e = ::readdir(d)) {
    const std::string name = e->d_name;
    if (name.rfind(base, 0) != 0 || name.size() < base.size() + kTag + 2) continue;
    const std::string tag = name.substr(base.size(), kTag);
    if (tag == keep_tag) continue;
    auto home = ShardHome::open("/" + name);
    if (!home) continue;  // another host's (a shared /dev/shm), or not a home
    names[tag].push_back(name);
    if (running(home->owner())) alive.insert(tag);
  }
  ::closedir(d);
  int removed = 0;
  for (const auto& [tag, list] : names) {
    if (alive.count(tag)) continue;
    for (const auto& name : list) removed += ::shm_unlink(("/" + name).c_str()) == 0;
  }
  return removed;
}

int remove_homes(const std::string& prefix) {
  DIR* d = ::opendir("/dev/shm");
  if (!d) return 0;
  int removed = 0;
  while (dirent* e = ::readdir(d)) {
    const std::string name = e->d_name;
    if (name.rfind(prefix, 0) == 0 && ::shm_unlink(("/" + name).c_str()) == 0) ++removed;
  }
  ::closedir(d);
  return removed;
}

}  // namespace limbo::elastic
