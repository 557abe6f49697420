// Child processes for the launchers: start a program, read its exit status,
// and the Supervisor both launchers share (spawn, poll, forward signals,
// stop with a grace period).
#pragma once

#include <sys/types.h>

#include <chrono>
#include <map>
#include <optional>
#include <string>
#include <vector>

namespace limbo {

// Starts `exe` with arguments `args` (argv[0] is `exe`); returns its pid.
// Throws limbo::Error when fork fails; a failed exec exits the child with 127.
// With `parent_death_signal`, the child gets that signal when the parent
// dies (PR_SET_PDEATHSIG), however it dies. `env`: "NAME=VALUE" entries
// added to (or replacing those of) this process's environment. With
// `own_group`, the child leads a process group of its own (what it starts
// can then be ended with it: kill(-pid, ...)).
pid_t spawn_program(const std::string& exe, const std::vector<std::string>& args, int parent_death_signal = 0,
                    const std::vector<std::string>& env = {}, bool own_group = false);

// Names the calling thread (at most 15 characters shown) for top -H, gdb,
// /proc/PID/task/TID/comm and the benches' CPU accounting.
void name_this_thread(const char* name);

// The cores this process may use: the CPUs of its affinity mask (taskset,
// a cpuset), capped by the CPU quota of its cgroup and of every group above
// it (v1: cpu.cfs_quota_us / cpu.cfs_period_us; v2: cpu.max), rounded down
// and at least 1. A container or a cgroup held to half a core gets 1, not
// every core of its host: more compute threads than the quota only spin
// and wait out its throttled periods. What the launchers split among their
// workers and what `limbo train` takes by default.
int usable_cores();
// The intra-op threads each of `workers` workers of a launcher gets: 0 when
// the training arguments set train.threads themselves; LIMBO_THREADS from
// the launcher's environment when set (the user's choice); else `cores`
// (0: usable_cores()) split evenly, at least 1.
int threads_per_worker(const std::vector<std::string>& train_args, int cores, int workers);
// The quota in cores (0: none) of the group `path` ("/a/b", as
// /proc/self/cgroup names it) and every group above it: the smallest, read
// under `root` (the v1 cpu controller's mount: cpu.cfs_quota_us and
// cpu.cfs_period_us; with `v2`, the unified hierarchy's: cpu.max). A path
// the mount does not hold (a container's own group mounted as the root, its
// name the host's) reads the root's quota.
double cgroup_cpu_quota(const std::string& path, const std::string& root, bool v2);

// A waitpid() status as a shell would report it: the exit code, or 128 + signal.
int exit_code_of(int status);
// "exit code N" or "killed by signal N".
std::string describe_status(int status);

// The children of one launcher, each with a role ("worker", "shard", ...)
// and an index. Not thread-safe: the launcher's main loop owns it.
//
// Signals: constructing a Supervisor installs handlers for SIGINT, SIGTERM
// and SIGUSR1 that only record the signal (take_signal()); the launcher decides
// what its children get. Each child leads its own process group: when it
// ends, however it ends, what it started and left running is SIGKILLed with
// it (poll()), and the SIGKILL at the end of a stop's grace period goes to
// the whole group. The destructor SIGKILLs and reaps every child still
// running, so no path out of a launcher leaves processes behind; and a
// launcher that is itself killed leaves none either: its children get
// SIGTERM from the kernel when it dies (a worker leaves the job cleanly).
class Supervisor {
 public:
  struct Exit {
    pid_t pid = 0;
    int status = 0;  // as from waitpid
    std::string role;
    int index = 0;
    bool stopped_by_us = false;  // it was running when stop() / begin_stop() signalled it
    int code() const { return exit_code_of(status); }
  };

  Supervisor();
  ~Supervisor();
  Supervisor(const Supervisor&) = delete;
  Supervisor& operator=(const Supervisor&) = delete;

  pid_t start(const std::string& exe, const std::vector<std::string>& args, const std::string& role, int index,
              const std::vector<std::string>& env = {});

  // Reaps one exited child (of `only`, when given) without blocking; also
  // SIGKILLs children whose stop grace period has passed.
  std::optional<Exit> poll(pid_t only = -1);

  // The next SIGINT / SIGTERM / SIGUSR1 received and not taken yet, in the
  // order they came (0: none); a signal repeated before it is taken counts once.
  int take_signal();
  // The first such signal ever received (0: none).
  int first_signal() const;

  void signal(pid_t pid, int sig);
  // Sends `sig` to every running child of `role` ("" = all).
  void signal_all(int sig, const std::string& role = "");
  // Sends `sig` to the children of `role` now and SIGKILL to those still
  // running `grace` later (done by poll()); does not wait.
  void begin_stop(int sig, std::chrono::milliseconds grace, const std::string& role = "");
  // Takes back the SIGKILLs that begin_stop() scheduled (the signal
  // itself was sent).
  void hold_kills();
  // begin_stop(), then waits until every child of `role` has exited;
  // returns their exits.
  std::vector<Exit> stop(int sig, std::chrono::milliseconds grace, const std::string& role = "");

  bool running(pid_t pid) const { return children_.count(pid) > 0; }
  size_t count(const std::string& role = "") const;
  // pid -> index of the running children of `role`.
  std::map<pid_t, int> children(const std::string& role = "") const;

 private:
  struct Child {
    std::string role;
    int index = 0;
    bool stopping = false;
    std::chrono::steady_clock::time_point kill_at = std::chrono::steady_clock::time_point::max();
  };
  std::map<pid_t, Child> children_;
};

}  // namespace limbo
