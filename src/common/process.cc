#include "common/process.h"

#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <sstream>
#include <thread>

#include "common/error.h"

namespace limbo {

pid_t spawn_program(const std::string& exe, const std::vector<std::string>& args, int parent_death_signal,
                    const std::vector<std::string>& env, bool own_group) {
  std::vector<std::string> all = {exe};
  all.insert(all.end(), args.begin(), args.end());
  // The child's environment, built before fork (nothing allocates after it).
  std::vector<std::string> vars;
  for (char** e = environ; *e; ++e) {
    const std::string v = *e;
    const auto eq = v.find('=');
    bool replaced = false;
    for (const auto& x : env) replaced = replaced || x.compare(0, x.find('=') + 1, v, 0, eq + 1) == 0;
    if (!replaced) vars.push_back(v);
  }
  vars.insert(vars.end(), env.begin(), env.end());
  std::vector<char*> envp;
  for (auto& v : vars) envp.push_back(v.data());
  envp.push_back(nullptr);
  std::vector<char*> argv;
  for (auto& a : all) argv.push_back(a.data());
  argv.push_back(nullptr);
  const pid_t parent = ::getpid();
  pid_t pid = ::fork();
  if (pid < 0) throw Error("fork failed: " + std::string(std::strerror(errno)));
  if (pid == 0) {
    if (own_group) ::setpgid(0, 0);
    if (parent_death_signal != 0) {
      ::prctl(PR_SET_PDEATHSIG, parent_death_signal);
      if (::getppid() != parent) ::raise(parent_death_signal);  // the parent died before prctl
    }
    ::execve(exe.c_str(), argv.data(), envp.data());
    std::fprintf(stderr, "launch: cannot exec %s: %s\n", exe.c_str(), std::strerror(errno));
    ::_exit(127);
  }
  if (own_group) ::setpgid(pid, pid);  // also here: no signal to the group may come before the child's own call
  return pid;
}

int exit_code_of(int status) {
  if (WIFEXITED(status)) return WEXITSTATUS(status);
  if (WIFSIGNALED(status)) return 128 + WTERMSIG(status);
  return 1;
}

namespace {

// The file's first line, "" when it cannot be read.
std::string first_line(const std::string& path) {
  std::ifstream f(path);
  std::string line;
  std::getline(f, line);
  return line;
}

// One group's quota in cores (0: none or unreadable).
double group_quota(const std::string& dir, bool v2) {
  double quota = 0, period = 0;
  if (v2) {  // "max 100000" or "50000 100000"
    std::istringstream in(first_line(dir + "/cpu.max"));
    std::string q;
    if (!(in >> q >> period) || q == "max") return 0;
    quota = std::atof(q.c_str());
  } else {
    const std::string q = first_line(dir + "/cpu.cfs_quota_us"), p = first_line(dir + "/cpu.cfs_period_us");
    if (q.empty() || p.empty()) return 0;
    quota = std::atof(q.c_str());
    period = std::atof(p.c_str());
  }
  return quota > 0 && period > 0 ? quota / period : 0;
}

bool has_group(const std::string& dir) { return static_cast<bool>(std::ifstream(dir + "/cgroup.procs")); }

}  // namespace

double cgroup_cpu_quota(const std::string& path, const std::string& root, bool v2) {
  if (!has_group(root)) return 0;
  // A container without a cgroup namespace sees its host's name for its
  // group ("/docker/ID") while its mount is that group itself: the mount's
  // own quota then.
  if (!has_group(root + (path == "/" ? "" : path))) return group_quota(root, v2);
  double least = 0;
  for (std::string p = path;;) {  // the group, then each group above it up to the root
    const double q = group_quota(root + (p == "/" ? "" : p), v2);
    if (q > 0 && (least == 0 || q < least)) least = q;
    if (p.empty() || p == "/") break;
    const auto slash = p.rfind('/');
    p = slash == 0 || slash == std::string::npos ? "/" : p.substr(0, slash);
  }
  return least;
}

int threads_per_worker(const std::vector<std::string>& train_args, int cores, int workers) {
  for (const auto& a : train_args)
    if (a.rfind("train.threads=", 0) == 0) return 0;
  if (const char* env = std::getenv("LIMBO_THREADS"); env && std::atoi(env) > 0) return std::atoi(env);
  return std::max(1, (cores > 0 ? cores : usable_cores()) / std::max(1, workers));
}

int usable_cores() {
  int cores = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  cpu_set_t set;
  CPU_ZERO(&set);
  if (::sched_getaffinity(0, sizeof(set), &set) == 0 && CPU_COUNT(&set) > 0) cores = std::min(cores, CPU_COUNT(&set));
  std::ifstream f("/proc/self/cgroup");
  std::string v1, v2;
  for (std::string line; std::getline(f, line);) {  // "ID:CONTROLLERS:PATH"
    const auto a = line.find(':'), b = line.find(':', a + 1);
    if (a == std::string::npos || b == std::string::npos) continue;
    const std::string controllers = line.substr(a + 1, b - a - 1), path = line.substr(b + 1);
    std::istringstream names(controllers);
    for (std::string c; std::getline(names, c, ',');)
      if (c == "cpu") v1 = path;
    if (line.compare(0, a + 1, "0:") == 0 && controllers.empty()) v2 = path;
  }
  double quota = 0;
  if (!v1.empty()) {
    quota = cgroup_cpu_quota(v1, "/sys/fs/cgroup/cpu", false);
    if (quota == 0) quota = cgroup_cpu_quota(v1, "/sys/fs/cgroup/cpu,cpuacct", false);
  } else if (!v2.empty()) {
    quota = cgroup_cpu_quota(v2, "/sys/fs/cgroup", true);
  }
  if (quota > 0) cores = std::min(cores, std::max(1, static_cast<int>(quota + 1e-9)));
  return cores;
}

std::string describe_status(int status) {
  if (WIFSIGNALED(status)) return "killed by signal " + std::to_string(WTERMSIG(status));
  return "exit code " + std::to_string(exit_code_of(status));
}

namespace {

// Each signal's arrival (its place in the order of arrivals; 0: none since
// the last take_signal() of it): two signals within one look of the
// launcher (SIGUSR1, then SIGTERM) are both taken, in order.
constexpr int kSignals[] = {SIGINT, SIGTERM, SIGUSR1};
std::atomic<uint64_t> g_arrivals{0};
std::atomic<uint64_t> g_arrived[3] = {};
std::atomic<int> g_first_signal{0};  // the first one
void on_signal(int sig) {
  for (int i = 0; i < 3; ++i) {
    uint64_t none = 0;
    if (kSignals[i] == sig) g_arrived[i].compare_exchange_strong(none, ++g_arrivals);
  }
  int none = 0;
  g_first_signal.compare_exchange_strong(none, sig);
}

}  // namespace

Supervisor::Supervisor() {
  struct sigaction sa {};
  sa.sa_handler = on_signal;
  ::sigaction(SIGINT, &sa, nullptr);
  ::sigaction(SIGTERM, &sa, nullptr);
  ::sigaction(SIGUSR1, &sa, nullptr);  // Slurm's warning ahead of preemption or the time limit
}

Supervisor::~Supervisor() {
  for (const auto& [pid, c] : children_) ::kill(-pid, SIGKILL);
  for (const auto& [pid, c] : children_) ::waitpid(pid, nullptr, 0);
}

pid_t Supervisor::start(const std::string& exe, const std::vector<std::string>& args, const std::string& role,
                        int index, const std::vector<std::string>& env) {
  const pid_t pid = spawn_program(exe, args, SIGTERM, env, true);
  children_[pid] = Child{role, index};
  return pid;
}

std::optional<Supervisor::Exit> Supervisor::poll(pid_t only) {
  const auto now = std::chrono::steady_clock::now();
  for (auto& [pid, c] : children_) {
    if (c.stopping && now >= c.kill_at) {
      ::kill(-pid, SIGKILL);
      c.kill_at = std::chrono::steady_clock::time_point::max();
    }
  }
  int status = 0;
  for (;;) {
    // Seen before it is reaped: while the child is a zombie its process
    // group cannot be a new process's, so what it started and left running
    // (a DataLoader's workers, a helper holding the launcher's output open)
    // is killed with no risk of hitting anything else.
    siginfo_t info{};
    if (::waitid(only < 0 ? P_ALL : P_PID, only < 0 ? 0 : static_cast<id_t>(only), &info,
                 WEXITED | WNOHANG | WNOWAIT) != 0 || info.si_pid == 0)
      return std::nullopt;
    const pid_t seen = info.si_pid;
    if (children_.count(seen)) ::kill(-seen, SIGKILL);
    const pid_t pid = ::waitpid(seen, &status, WNOHANG);
    if (pid <= 0) return std::nullopt;
    auto it = children_.find(pid);
    if (it == children_.end()) continue;  // not ours (or already forgotten)
    Exit e{pid, status, it->second.role, it->second.index, it->second.stopping};
    children_.erase(it);
    return e;
  }
}

int Supervisor::take_signal() {
  int first = -1;
  for (int i = 0; i < 3; ++i) {
    const uint64_t at = g_arrived[i].load();
    if (at != 0 && (first < 0 || at < g_arrived[first].load())) first = i;
  }
  if (first < 0) return 0;
  g_arrived[first] = 0;
  return kSignals[first];
}
int Supervisor::first_signal() const { return g_first_signal.load(); }

void Supervisor::signal(pid_t pid, int sig) {
  if (children_.count(pid)) ::kill(pid, sig);
}

void Supervisor::signal_all(int sig, const std::string& role) {
  for (const auto& [pid, c] : children_)
    if (role.empty() || c.role == role) ::kill(pid, sig);
}

void Supervisor::begin_stop(int sig, std::chrono::milliseconds grace, const std::string& role) {
  const auto kill_at = std::chrono::steady_clock::now() + grace;
  for (auto& [pid, c] : children_) {
    if (!role.empty() && c.role != role) continue;
    ::kill(pid, sig);
    if (!c.stopping || kill_at < c.kill_at) c.kill_at = kill_at;
    c.stopping = true;
  }
}

void Supervisor::hold_kills() {
  for (auto& [pid, c] : children_) c.kill_at = std::chrono::steady_clock::time_point::max();
}

std::vector<Supervisor::Exit> Supervisor::stop(int sig, std::chrono::milliseconds grace, const std::string& role) {
  begin_stop(sig, grace, role);
  std::vector<Exit> out;
  while (count(role) > 0) {
    bool reaped = false;
    for (const auto& [pid, idx] : children(role)) {
      if (auto e = poll(pid)) {
        out.push_back(*e);
        reaped = true;
      }
    }
    if (!reaped) std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return out;
}

size_t Supervisor::count(const std::string& role) const {
  size_t n = 0;
  for (const auto& [pid, c] : children_) n += role.empty() || c.role == role;
  return n;
}

std::map<pid_t, int> Supervisor::children(const std::string& role) const {
  std::map<pid_t, int> out;
  for (const auto& [pid, c] : children_)
    if (role.empty() || c.role == role) out[pid] = c.index;
  return out;
}

void name_this_thread(const char* name) {
  char buf[16];
  std::snprintf(buf, sizeof buf, "%s", name);
  ::pthread_setname_np(::pthread_self(), buf);
}

}  // namespace limbo
