// Helpers shared by the test executables: temporary folders, small IDX
// files, and running the limbo binary as a real child process.
#pragma once

#include <signal.h>
#include <sys/types.h>

#include <cstdint>
#include <functional>
#include <optional>
#include <atomic>
#include <thread>
#include <string>
#include <vector>

namespace limbo::testing {

// A fresh directory under /tmp, removed (recursively) on destruction.
class TempDir {
 public:
  TempDir();
  ~TempDir();
  const std::string& path() const { return path_; }
  std::string file(const std::string& name) const { return path_ + "/" + name; }

 private:
  std::string path_;
};

void write_bytes(const std::string& path, const std::string& bytes, bool gzip);
// IDX bytes: magic 0x0000 08 <ndims>, big-endian dims, then the data.
std::string idx_bytes(const std::vector<int32_t>& dims, const std::vector<uint8_t>& data);

struct ProcessResult {
  int exit_code = -1;  // -1 when killed by a signal
  int signal = 0;
  std::string output;  // stdout + stderr
  bool timed_out = false;
};

// Runs the limbo binary with arguments; waits for it.
ProcessResult run_limbo(const std::vector<std::string>& args);

// Starts any program (argv[0] is a path); combined output goes to `log`.
// With die_with_test, it is killed when the thread that started it ends
// (PR_SET_PDEATHSIG), so a test killed by its timeout leaves no daemon.
pid_t spawn_process(const std::vector<std::string>& argv, const std::string& log, bool die_with_test = false);

// Starts the limbo binary; returns its pid; its combined output goes to `log`.
pid_t spawn_limbo(const std::vector<std::string>& args, const std::string& log);
// Waits until `needle` appears in the file or the timeout passes.
bool wait_for_text(const std::string& file, const std::string& needle, double timeout_s);
// Waits for a child; with timeout_s > 0, SIGKILLs it after that long and
// reports signal 9 with timed_out set.
ProcessResult wait_child(pid_t pid, const std::string& log, double timeout_s = 0);

// Runs `f` in a child process that is the first one (pid 1) of a new pid
// namespace, with every other namespace shared, and returns what it
// returned; nullopt where no pid namespace can be made (not root).
std::optional<std::string> in_new_pid_namespace(const std::function<std::string()>& f);

// SIGKILLs (and reaps) the children still running when it goes out of
// scope, so a failed assertion leaves no process behind.
struct KillOnExit {
  std::vector<pid_t> pids;
  ~KillOnExit();
};

std::string slurp(const std::string& path);

// A cgroup v1 cpu group (root) holding its processes to `fraction` of one
// core: how a slow member is made in tests, rather than with sleeps. The
// group is removed (its processes moved back) when it goes out of scope.
class CpuLimit {
 public:
  static bool available();
  CpuLimit(const std::string& name, double fraction, int period_us = 100000);
  ~CpuLimit();
  CpuLimit(const CpuLimit&) = delete;
  CpuLimit& operator=(const CpuLimit&) = delete;
  void add(pid_t pid);
  void set(double fraction);

 private:
  std::string dir_;
  int period_us_;
};

// PyTorch for Python as an oracle: whether /usr/bin/python3 imports torch,
// and a run of one of tests/python/*.py with arguments (stdout and stderr in
// *out; returns the exit status).
bool have_python_torch();
int run_python(const std::string& script, const std::vector<std::string>& args, std::string* out);

// A plain TCP connection to 127.0.0.1:port (for clients that misbehave).
int connect_loopback(int port);

// A flood of silent connections to 127.0.0.1:port from a thread of its own:
// `held` are kept open, and every 50 ms the oldest 50 are closed and
// opened again, until the object is destroyed.
class ConnectionFlood {
 public:
  ConnectionFlood(int port, size_t held = 1000);
  ~ConnectionFlood();
  int64_t opened() const { return opened_.load(); }
  // Waits until the first `held` connections are open.
  void wait_full() const;

 private:
  int port_;
  size_t held_;
  std::atomic<bool> stop_{false};
  std::atomic<int64_t> opened_{0};
  std::thread thread_;
};

}  // namespace limbo::testing
