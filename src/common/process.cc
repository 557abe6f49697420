#include "common/process.h"

#include <pthread.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstring>
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
