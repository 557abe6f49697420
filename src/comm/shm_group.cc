#include "comm/shm_group.h"

#include <dirent.h>
#include <fcntl.h>
#include <linux/futex.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <sys/syscall.h>
#include <unistd.h>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <random>
#include <thread>

#include "comm/compression.h"
#include "comm/kv_store.h"
#include "comm/store.h"
#include "common/error.h"
#include "common/log.h"

namespace limbo::comm {
namespace {

using Clock = std::chrono::steady_clock;

constexpr uint64_t kMagic = 0x6c696d626f73686dULL;  // "limboshm"
constexpr int kMaxMembers = 1024;
constexpr int64_t kSlotBytes = 8 << 20;     // a member's slot, where /dev/shm has room
constexpr int64_t kMinSlotBytes = 256 << 10;  // the smallest slot tried before Gloo
constexpr const char* kNamePrefix = "limbo-shm-";

struct Header {
  uint64_t magic;
  int64_t members;
  int64_t slot_bytes;
  int64_t total_bytes;
  alignas(64) std::atomic<uint32_t> arrived;
  alignas(64) std::atomic<uint32_t> generation;
  std::atomic<uint32_t> aborted;
  int32_t pids[kMaxMembers];
};
static_assert(std::atomic<uint32_t>::is_always_lock_free, "shared-memory barrier needs lock-free atomics");

constexpr int64_t kHeaderBytes = (sizeof(Header) + 4095) / 4096 * 4096;

void futex_wait(std::atomic<uint32_t>* addr, uint32_t value, std::chrono::microseconds timeout) {
  timespec ts{static_cast<time_t>(timeout.count() / 1000000), static_cast<long>(timeout.count() % 1000000) * 1000};
  ::syscall(SYS_futex, reinterpret_cast<uint32_t*>(addr), FUTEX_WAIT, value, &ts, nullptr, 0);
}

void futex_wake(std::atomic<uint32_t>* addr) {
  ::syscall(SYS_futex, reinterpret_cast<uint32_t*>(addr), FUTEX_WAKE, INT32_MAX, nullptr, nullptr, 0);
}

inline void cpu_relax() {
#if defined(__x86_64__)
  _mm_pause();
#endif
}

}  // namespace

bool process_alive(pid_t pid) {
  if (pid <= 0) return true;
  if (::kill(pid, 0) != 0 && errno == ESRCH) return false;
  std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
  std::string line;
  if (!std::getline(stat, line)) return true;  // no /proc: trust kill()
  const auto close = line.rfind(')');
  return close == std::string::npos || close + 2 >= line.size() || line[close + 2] != 'Z';
}

namespace {

// out = a (op) b, element-wise; out may be a.
template <typename T>
__attribute__((optimize("O3"))) void add3(T* out, const T* a, const T* __restrict b, int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = a[i] + b[i];
}

template <typename T>
__attribute__((optimize("O3"))) void max3(T* out, const T* a, const T* __restrict b, int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = std::max(a[i], b[i]);
}

class ShmGroup : public Collective {
 public:
  ShmGroup(GroupOptions opt, int rank, int size, void* base, int64_t bytes)
      : opt_(std::move(opt)), rank_(rank), size_(size), base_(static_cast<uint8_t*>(base)), bytes_(bytes),
        h_(static_cast<Header*>(base)) {}
  ~ShmGroup() override { ::munmap(base_, static_cast<size_t>(bytes_)); }

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  const char* transport() const override { return "shared-memory"; }

  // Everyone has mapped the segment (formation: `cancelled` is polled).
  void attach_barrier() {
    forming_ = true;
    barrier();
    forming_ = false;
  }

  void allreduce_sum(torch::Tensor& t) override {
    switch (t.scalar_type()) {
      case torch::kFloat32: return reduce<float>(t, add3<float>);
      case torch::kFloat64: return reduce<double>(t, add3<double>);
      case torch::kInt64: return reduce<int64_t>(t, add3<int64_t>);
      case torch::kInt32: return reduce<int32_t>(t, add3<int32_t>);
      default: throw Error("shared-memory all-reduce: unsupported dtype " + std::string(c10::toString(t.scalar_type())));
    }
  }
  void allreduce_sum_16(torch::Tensor& t) override {
    if (t.scalar_type() == torch::kHalf)
      return reduce<uint16_t>(t, [](uint16_t* out, const uint16_t* a, const uint16_t* b, int64_t n) { sum_fp16(out, a, b, n); });
    if (t.scalar_type() == torch::kBFloat16)
      return reduce<uint16_t>(t, [](uint16_t* out, const uint16_t* a, const uint16_t* b, int64_t n) { sum_bf16(out, a, b, n); });
    throw Error("allreduce_sum_16 needs a kHalf or kBFloat16 tensor");
  }
  void allreduce_max(torch::Tensor& t) override {
    switch (t.scalar_type()) {
      case torch::kFloat32: return reduce<float>(t, max3<float>);
      case torch::kFloat64: return reduce<double>(t, max3<double>);
      case torch::kInt64: return reduce<int64_t>(t, max3<int64_t>);
      case torch::kInt32: return reduce<int32_t>(t, max3<int32_t>);
      default: throw Error("shared-memory max: unsupported dtype " + std::string(c10::toString(t.scalar_type())));
    }
  }
  void broadcast(torch::Tensor& t, int root) override {
    check_usable();
    if (root < 0 || root >= size_) throw Error("broadcast from member " + std::to_string(root) + " of " + std::to_string(size_));
    if (size_ == 1) return;
    torch::Tensor c = t.is_contiguous() ? t : t.contiguous();
    uint8_t* data = static_cast<uint8_t*>(c.data_ptr());
    const int64_t n = c.numel() * c.element_size();
    for (int64_t off = 0; off < n; off += h_->slot_bytes) {
      const int64_t m = std::min(h_->slot_bytes, n - off);
      uint8_t* area = next_result();
      if (rank_ == root) std::memcpy(area, data + off, static_cast<size_t>(m));
      barrier();
      if (rank_ != root) std::memcpy(data + off, area, static_cast<size_t>(m));
    }
    if (!c.is_same(t)) t.copy_(c);
  }
  // Pieces of at most a slot, as reduce(): each member copies into its slot
  // the parts of the piece that other members' shards hold, then sums its
  // own shard's part across the slots in member order (the additions
  // allreduce_sum makes) and keeps it; nothing comes back out.
  bool reduce_scatter_sums_everywhere() const override { return false; }
  void reduce_scatter_sum(torch::Tensor& t, const std::vector<int64_t>& bounds) override {
    check_shards(t, bounds, size_, "shared-memory reduce-scatter");
    if (t.scalar_type() != torch::kFloat32) throw Error("shared-memory reduce-scatter takes float32");
    check_usable();
    if (size_ == 1) return;
    float* data = t.data_ptr<float>();
    const int64_t n = t.numel(), per = h_->slot_bytes / static_cast<int64_t>(sizeof(float));
    const int64_t lo = bounds[rank_], hi = bounds[rank_ + 1];
    for (int64_t off = 0; off < n; off += per) {
      const int64_t m = std::min(per, n - off);
      // This member's shard within the piece: [b, e), relative to it.
      const int64_t b = std::clamp(lo - off, int64_t{0}, m), e = std::clamp(hi - off, int64_t{0}, m);
      float* piece = data + off;
      float* mine = reinterpret_cast<float*>(slot(rank_));
      std::memcpy(mine, piece, static_cast<size_t>(b) * sizeof(float));
      std::memcpy(mine + e, piece + e, static_cast<size_t>(m - e) * sizeof(float));
      barrier();
      float* result = reinterpret_cast<float*>(next_result());  // the turns stay the same on every member
      if (e > b && size_ == 2) {
        // a + b = b + a exactly: the sum goes straight into the tensor.
        add3<float>(piece + b, piece + b, reinterpret_cast<const float*>(slot(1 - rank_)) + b, e - b);
      } else if (e > b) {
        auto term = [&](int r) { return r == rank_ ? piece + b : reinterpret_cast<const float*>(slot(r)) + b; };
        add3<float>(result + b, term(0), term(1), e - b);
        for (int r = 2; r < size_; ++r) add3<float>(result + b, result + b, term(r), e - b);
        std::memcpy(piece + b, result + b, static_cast<size_t>(e - b) * sizeof(float));
      }
      barrier();  // the slots are read before the next piece overwrites them
    }
  }

  // Pieces of at most a slot: each member writes its shard's part of the
  // piece into a result area; after one barrier everyone copies the others'
  // parts out (the turns of the areas as broadcast()).
  void all_gather(torch::Tensor& t, const std::vector<int64_t>& bounds) override {
    check_shards(t, bounds, size_, "shared-memory all-gather");
    check_usable();
    if (size_ == 1) return;
    const int64_t es = t.element_size();
    uint8_t* data = static_cast<uint8_t*>(t.data_ptr());
    const int64_t n = t.numel() * es, per = h_->slot_bytes;
    const int64_t lo = bounds[rank_] * es, hi = bounds[rank_ + 1] * es;
    for (int64_t off = 0; off < n; off += per) {
      const int64_t m = std::min(per, n - off);
      const int64_t b = std::clamp(lo - off, int64_t{0}, m), e = std::clamp(hi - off, int64_t{0}, m);
      uint8_t* area = next_result();
      if (e > b) std::memcpy(area + b, data + off + b, static_cast<size_t>(e - b));
      barrier();
      std::memcpy(data + off, area, static_cast<size_t>(b));
      std::memcpy(data + off + e, area + e, static_cast<size_t>(m - e));
    }
  }

  void abort() override {
    aborted_.store(true);
    h_->aborted.store(1);
    futex_wake(&h_->generation);
  }

 private:
  uint8_t* slot(int r) const { return base_ + kHeaderBytes + static_cast<int64_t>(r) * h_->slot_bytes; }
  // Two result areas after the slots, used by turns: a piece's result is
  // written to one while members still copying the previous piece's read
  // the other. The turn after next comes only once every member has put its
  // next piece in (the first barrier of a piece), after it copied the
  // previous result out: two barriers a piece suffice.
  uint8_t* next_result() { return slot(size_ + static_cast<int>(pieces_++ & 1)); }

  // Pieces of at most a slot. Each member reduces its own share of a piece
  // across the members in member order, so it copies into its slot only the
  // others' shares (its own it reads from its tensor), then the reduced
  // piece comes out of a result area.
  template <typename T, typename Combine>
  void reduce(torch::Tensor& t, Combine combine) {
    check_usable();
    if (size_ == 1) return;
    torch::Tensor c = t.is_contiguous() ? t : t.contiguous();
    T* data = static_cast<T*>(c.data_ptr());
    const int64_t n = c.numel(), per = h_->slot_bytes / static_cast<int64_t>(sizeof(T));
    for (int64_t off = 0; off < n; off += per) {
      const int64_t m = std::min(per, n - off);
      T* result = reinterpret_cast<T*>(next_result());
      T* piece = data + off;
      const int64_t share = (m + size_ - 1) / size_;
      const int64_t chunk = (share + 15) / 16 * 16;  // whole cache lines
      const int64_t b = std::min(m, rank_ * chunk), e = std::min(m, b + chunk);
      T* mine = reinterpret_cast<T*>(slot(rank_));
      std::memcpy(mine, piece, static_cast<size_t>(b) * sizeof(T));
      std::memcpy(mine + e, piece + e, static_cast<size_t>(m - e) * sizeof(T));
      barrier();
      if (e > b) {
        auto term = [&](int r) { return r == rank_ ? piece + b : reinterpret_cast<const T*>(slot(r)) + b; };
        combine(result + b, term(0), term(1), e - b);
        for (int r = 2; r < size_; ++r) combine(result + b, result + b, term(r), e - b);
      }
      barrier();
      std::memcpy(piece, result, static_cast<size_t>(m) * sizeof(T));
    }
    if (!c.is_same(t)) t.copy_(c);
  }

  void check_usable() {
    if (aborted_.load() || h_->aborted.load())
      throw PeerFailure("group '" + opt_.prefix + "' was aborted (a member stopped answering or is gone)");
  }

  void barrier() {
    const uint32_t gen = h_->generation.load(std::memory_order_acquire);
    if (h_->arrived.fetch_add(1, std::memory_order_acq_rel) + 1 == static_cast<uint32_t>(size_)) {
      h_->arrived.store(0, std::memory_order_relaxed);
      h_->generation.fetch_add(1, std::memory_order_acq_rel);
      futex_wake(&h_->generation);
      return;
    }
    const auto start = Clock::now();
    auto next_check = start;
    for (int spin = 0; h_->generation.load(std::memory_order_acquire) == gen; ++spin) {
      if (spin < 256) {  // the others are usually microseconds away
        cpu_relax();
        continue;
      }
      check_usable();
      futex_wait(&h_->generation, gen, std::chrono::microseconds(5000));
      // Completed while this member slept: the others may have gone on, and
      // one may have ended (or died) since; that is no failure of this one.
      if (h_->generation.load(std::memory_order_acquire) != gen) break;
      const auto now = Clock::now();
      if (now >= next_check) {
        check_peers();
        if (forming_ && opt_.cancelled && opt_.cancelled())
          throw PeerFailure("group '" + opt_.prefix + "': formation cancelled (the round was replaced)");
        next_check = now + std::chrono::milliseconds(20);
      }
      if (now - start > opt_.timeout)
        throw Timeout("group '" + opt_.prefix + "': a shared-memory collective waited " +
                      std::to_string(opt_.timeout.count()) + " ms for the other members");
    }
  }

  // A member whose process is gone fails everyone's collectives.
  void check_peers() {
    for (int r = 0; r < size_; ++r) {
      if (r == rank_) continue;
      const pid_t pid = h_->pids[r];
      if (pid > 0 && !process_alive(pid)) {
        h_->aborted.store(1);
        futex_wake(&h_->generation);
        throw PeerFailure("group '" + opt_.prefix + "': member " + std::to_string(r) + " (pid " +
                          std::to_string(pid) + ") is gone");
      }
    }
  }

  GroupOptions opt_;
  int rank_, size_;
  uint8_t* base_;
  int64_t bytes_;
  Header* h_;
  std::atomic<bool> aborted_{false};
  bool forming_ = false;
  uint64_t pieces_ = 0;  // pieces so far: the same on every member
};

std::string random_hex() {
  std::random_device rd;
  char buf[17];
  std::snprintf(buf, sizeof buf, "%08x%08x", rd(), rd());
  return buf;
}

std::string read_first_line(const std::string& path) {
  std::ifstream f(path);
  std::string line;
  std::getline(f, line);
  return line;
}

}  // namespace

std::shared_ptr<KvStore> group_store(const GroupOptions& opt) {
  if (opt.connect_store) return opt.connect_store();
  if (opt.share_client) return std::shared_ptr<KvStore>(kv_store_on(*opt.share_client, opt.timeout));
  return std::shared_ptr<KvStore>(connect_kv_store(opt.store_host, opt.store_port, opt.timeout, opt.token));
}

std::string wait_group_key(KvStore& kv, const std::string& key, const GroupOptions& opt) {
  const auto deadline = Clock::now() + opt.timeout;
  for (;;) {
    if (opt.cancelled && opt.cancelled())
      throw PeerFailure("group '" + opt.prefix + "': formation cancelled (the round was replaced)");
    if (kv.wait_for(key, std::chrono::milliseconds(100))) {
      if (auto v = kv.try_get(key)) return *v;
    }
    if (Clock::now() > deadline)
      throw Timeout("group '" + opt.prefix + "': no '" + key + "' in " + kv.describe() + " after " +
                    std::to_string(opt.timeout.count()) + " ms");
  }
}

std::string host_identity() {
  char host[256] = {0};
  ::gethostname(host, sizeof host - 1);
  std::string id = std::string(host) + "/" + read_first_line("/proc/sys/kernel/random/boot_id");
  for (const char* ns : {"/proc/self/ns/net", "/proc/self/ns/mnt", "/proc/self/ns/ipc", "/proc/self/ns/pid"}) {
    struct stat st {};
    if (::stat(ns, &st) == 0) id += "/" + std::to_string(st.st_ino);
  }
  return id;
}

std::unique_ptr<Collective> make_shm_group(const GroupOptions& opt, int rank, int size) {
  if (size < 1 || rank < 0 || rank >= size)
    throw InvalidInput("bad rank " + std::to_string(rank) + " for a group of " + std::to_string(size));
  if (size > kMaxMembers) return nullptr;
  auto kv = group_store(opt);
  const std::string key = opt.prefix + "/shm/name";
  // size + 2 slots: one per member and 2 result areas.
  auto total_for = [size](int64_t per) { return kHeaderBytes + static_cast<int64_t>(size + 2) * per; };
  std::string name;
  int64_t slot = kSlotBytes, total = 0;
  void* base = nullptr;
  if (rank == 0) {
    name = "/" + segment_prefix(::getpid()) + random_hex();
    std::string why;
    const int fd = ::shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
    if (fd < 0) {
      why = std::string("shm_open: ") + std::strerror(errno);
    } else {
      // Slots of 8 MiB, halved while the segment does not fit the free
      // space (a container's /dev/shm is often 64 MiB): more pieces per
      // collective, still through memory. The pages are reserved now: a
      // tmpfs too small for them would otherwise kill a member with SIGBUS
      // at its first touch.
      struct statvfs vfs {};
      const int64_t room = ::fstatvfs(fd, &vfs) == 0 ? static_cast<int64_t>(vfs.f_bavail) * static_cast<int64_t>(vfs.f_frsize)
                                                    : INT64_MAX;
      while (slot > kMinSlotBytes && total_for(slot) > room) slot /= 2;
      int rc = 0;
      for (;; slot /= 2) {
        total = total_for(slot);
        rc = ::ftruncate(fd, total) == 0 ? ::posix_fallocate(fd, 0, total) : errno;
        if (rc != ENOSPC || slot / 2 < kMinSlotBytes) break;  // another process took the room meanwhile: smaller
      }
      if (rc != 0) {
        why = std::string("reserving ") + std::to_string(total >> 20) + " MiB in /dev/shm: " + std::strerror(rc);
      } else {
        base = ::mmap(nullptr, static_cast<size_t>(total), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
        if (base == MAP_FAILED) {
          why = std::string("mmap: ") + std::strerror(errno);
          base = nullptr;
        }
      }
      ::close(fd);
    }
    if (!base) {
      if (fd >= 0) ::shm_unlink(name.c_str());
      log_warn("group '" + opt.prefix + "': no shared-memory segment (" + why + "); the members use Gloo");
      kv->set(key, "none");
      return nullptr;
    }
    auto* h = new (base) Header{};
    h->magic = kMagic;
    h->members = size;
    h->slot_bytes = slot;
    h->total_bytes = total;
    kv->set(key, name + " " + std::to_string(h->slot_bytes));
  } else {
    const std::string value = wait_group_key(*kv, key, opt);
    if (value == "none") return nullptr;
    const auto space = value.find(' ');
    slot = space == std::string::npos ? 0 : std::atoll(value.c_str() + space + 1);
    name = value.substr(0, space);
    if (slot < 1 || slot % 64 != 0) throw PeerFailure("group '" + opt.prefix + "': member 0 published a bad segment '" + value + "'");
    total = total_for(slot);
    const int fd = ::shm_open(name.c_str(), O_RDWR, 0);
    if (fd < 0) throw PeerFailure("group '" + opt.prefix + "': cannot open its segment " + name + ": " + std::strerror(errno));
    base = ::mmap(nullptr, static_cast<size_t>(total), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    ::close(fd);
    if (base == MAP_FAILED) throw PeerFailure("group '" + opt.prefix + "': cannot map " + name + ": " + std::strerror(errno));
    const auto* h = static_cast<const Header*>(base);
    if (h->magic != kMagic || h->members != size || h->total_bytes != total || h->slot_bytes != slot) {
      ::munmap(base, static_cast<size_t>(total));
      throw PeerFailure("group '" + opt.prefix + "': segment " + name + " is not this group's");
    }
  }
  static_cast<Header*>(base)->pids[rank] = static_cast<int32_t>(::getpid());
  auto g = std::make_unique<ShmGroup>(opt, rank, size, base, total);
  try {
    g->attach_barrier();
  } catch (...) {
    if (rank == 0) ::shm_unlink(name.c_str());
    throw;
  }
  if (rank == 0) ::shm_unlink(name.c_str());  // every member has it mapped
  return g;
}

namespace {

// This process's pid namespace (the inode of /proc/self/ns/pid; 0 where
// there is none to read).
uint64_t pid_namespace() {
  struct stat st {};
  return ::stat("/proc/self/ns/pid", &st) == 0 ? static_cast<uint64_t>(st.st_ino) : 0;
}

}  // namespace

std::string segment_prefix(pid_t pid) {
  return std::string(kNamePrefix) + std::to_string(pid) + "-ns" + std::to_string(pid_namespace()) + "-";
}

int remove_stale_segments() {
  DIR* d = ::opendir("/dev/shm");
  if (!d) return 0;
  int removed = 0;
  while (dirent* e = ::readdir(d)) {
    const std::string name = e->d_name;
    if (name.rfind(kNamePrefix, 0) != 0) continue;
    const pid_t pid = static_cast<pid_t>(std::atoll(name.c_str() + std::strlen(kNamePrefix)));
    // A pid is only meaningful in its own namespace: names made in another
    // one (a container that shares this /dev/shm) are left to it.
    if (pid <= 0 || name.rfind(segment_prefix(pid), 0) != 0) continue;
    if (!process_alive(pid) && ::shm_unlink(("/" + name).c_str()) == 0) ++removed;
  }
  ::closedir(d);
  return removed;
}

}  // namespace limbo::comm
