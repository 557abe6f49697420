#include "elastic/shards.h"

#include <dirent.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
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
};

std::vector<int64_t> shard_bounds(int64_t n, int world) {
  if (world < 1) throw Error("shard_bounds: a group of " + std::to_string(world));
  const int64_t lines = (n + kLine - 1) / kLine;
  std::vector<int64_t> b(static_cast<size_t>(world) + 1);
  for (int r = 0; r <= world; ++r) b[r] = std::min(n, lines * r / world * kLine);
  b[world] = n;
  return b;
}

ShardHome::ShardHome(const std::string& name, int64_t n, int64_t lo, int64_t hi, int states) {
  const int64_t header = (static_cast<int64_t>(sizeof(Header)) + 4095) / 4096 * 4096;
  bytes_ = header + 2 * static_cast<int64_t>(sizeof(float)) * (hi - lo) * states;
  if (!name.empty()) {
    const int fd = ::shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
    std::string why;
    if (fd < 0) {
      why = std::string("shm_open: ") + std::strerror(errno);
    } else {
      const int rc = ::ftruncate(fd, bytes_) == 0 ? ::posix_fallocate(fd, 0, bytes_) : errno;
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
  const int64_t header = (static_cast<int64_t>(sizeof(Header)) + 4095) / 4096 * 4096;
  const bool ok = h->magic == kMagic && std::string(h->host, strnlen(h->host, sizeof h->host)) == comm::host_identity() &&
                  h->lo >= 0 && h->lo <= h->hi && h->hi <= h->n && h->states >= 0 && h->states <= 3 &&  // AdamW's two, and the weights (shard_weights)
                  header + 2 * 4 * (h->hi - h->lo) * h->states <= st.st_size;
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
  for (int v = 0; v < 2; ++v)
    if (h_->step[v].load(std::memory_order_acquire) == step) return v;
  return -1;
}

float* ShardHome::state(int v, int i) {
  const int64_t header = (static_cast<int64_t>(sizeof(Header)) + 4095) / 4096 * 4096;
  return reinterpret_cast<float*>(base_ + header) + (v * states() + i) * size();
}
int64_t ShardHome::optimizer_steps(int v) const { return h_->optimizer_steps[v]; }
bool ShardHome::has_state(int v) const { return h_->has_state[v] != 0; }

void ShardHome::begin(int v) { h_->step[v].store(-1, std::memory_order_release); }

void ShardHome::commit(int v, int64_t step, int64_t optimizer_steps, bool has_state) {
  h_->optimizer_steps[v] = optimizer_steps;
  h_->has_state[v] = has_state ? 1 : 0;
  h_->step[v].store(step, std::memory_order_release);
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
