#include "test_util.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <sched.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>
#include <zlib.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <vector>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <stdexcept>
#include <thread>

namespace limbo::testing {

TempDir::TempDir() {
  char tmpl[] = "/tmp/limbo-test-XXXXXX";
  if (!::mkdtemp(tmpl)) throw std::runtime_error("mkdtemp failed");
  path_ = tmpl;
}

TempDir::~TempDir() {
  std::error_code ec;
  std::filesystem::remove_all(path_, ec);
}

void write_bytes(const std::string& path, const std::string& bytes, bool gzip) {
  if (gzip) {
    gzFile f = gzopen(path.c_str(), "wb");
    if (!f) throw std::runtime_error("gzopen " + path);
    gzwrite(f, bytes.data(), static_cast<unsigned>(bytes.size()));
    gzclose(f);
  } else {
    std::ofstream out(path, std::ios::binary);
    out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  }
}

std::string idx_bytes(const std::vector<int32_t>& dims, const std::vector<uint8_t>& data) {
  std::string s = {0, 0, 0x08, static_cast<char>(dims.size())};
  for (int32_t d : dims)
    for (int shift = 24; shift >= 0; shift -= 8) s.push_back(static_cast<char>((d >> shift) & 0xff));
  s.append(data.begin(), data.end());
  return s;
}

std::string slurp(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

namespace {
const char* const kCpuRoot = "/sys/fs/cgroup/cpu";

void write_sys(const std::string& path, const std::string& value) {
  std::ofstream out(path);
  out << value;
  out.flush();
  if (!out) throw std::runtime_error("cannot write '" + value + "' to " + path);
}
}  // namespace

bool CpuLimit::available() {
  return ::access((std::string(kCpuRoot) + "/cgroup.procs").c_str(), W_OK) == 0;
}

CpuLimit::CpuLimit(const std::string& name, double fraction, int period_us)
    : dir_(std::string(kCpuRoot) + "/" + name), period_us_(period_us) {
  ::mkdir(dir_.c_str(), 0755);
  write_sys(dir_ + "/cpu.cfs_quota_us", "-1");  // the period changes only while unlimited
  write_sys(dir_ + "/cpu.cfs_period_us", std::to_string(period_us));
  set(fraction);
}

void CpuLimit::set(double fraction) {
  const long quota = fraction >= 1 ? -1 : std::max(1000L, std::lround(fraction * period_us_));
  write_sys(dir_ + "/cpu.cfs_quota_us", std::to_string(quota));
}

void CpuLimit::add(pid_t pid) { write_sys(dir_ + "/cgroup.procs", std::to_string(pid)); }

CpuLimit::~CpuLimit() {
  std::ifstream in(dir_ + "/cgroup.procs");
  for (std::string pid; std::getline(in, pid);) {
    std::ofstream root(std::string(kCpuRoot) + "/cgroup.procs");
    root << pid;  // it may have exited meanwhile
  }
  ::rmdir(dir_.c_str());
}

bool have_python_torch() {
  static const bool have = std::system("/usr/bin/python3 -c 'import torch' >/dev/null 2>&1") == 0;
  return have;
}

int run_python(const std::string& script, const std::vector<std::string>& args, std::string* out) {
  std::string cmd = std::string("/usr/bin/python3 ") + LIMBO_SOURCE_DIR + "/tests/python/" + script;
  for (const auto& a : args) cmd += " '" + a + "'";
  cmd += " 2>&1";
  FILE* p = ::popen(cmd.c_str(), "r");
  if (!p) return -1;
  std::string text;
  char buf[512];
  while (std::fgets(buf, sizeof buf, p)) text += buf;
  const int rc = ::pclose(p);
  if (out) *out = text;
  return WIFEXITED(rc) ? WEXITSTATUS(rc) : -1;
}

pid_t spawn_limbo(const std::vector<std::string>& args, const std::string& log) {
  std::vector<std::string> argv = {LIMBO_BINARY};
  argv.insert(argv.end(), args.begin(), args.end());
  return spawn_process(argv, log);
}

pid_t spawn_process(const std::vector<std::string>& args, const std::string& log, bool die_with_test) {
  pid_t pid = ::fork();
  if (pid < 0) throw std::runtime_error("fork failed");
  if (pid == 0) {
    if (die_with_test) ::prctl(PR_SET_PDEATHSIG, SIGKILL);
    int fd = ::open(log.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    ::dup2(fd, 1);
    ::dup2(fd, 2);
    std::vector<char*> argv;
    std::vector<std::string> copy = args;
    for (auto& a : copy) argv.push_back(a.data());
    argv.push_back(nullptr);
    ::execv(copy[0].c_str(), argv.data());
    ::_exit(127);
  }
  return pid;
}

ProcessResult wait_child(pid_t pid, const std::string& log, double timeout_s) {
  int status = 0;
  ProcessResult r;
  if (timeout_s > 0) {
    auto end = std::chrono::steady_clock::now() + std::chrono::duration<double>(timeout_s);
    while (::waitpid(pid, &status, WNOHANG) == 0) {
      if (std::chrono::steady_clock::now() > end) {
        ::kill(pid, SIGKILL);
        ::waitpid(pid, &status, 0);
        r.timed_out = true;
        break;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
  } else {
    ::waitpid(pid, &status, 0);
  }
  if (WIFEXITED(status)) r.exit_code = WEXITSTATUS(status);
  if (WIFSIGNALED(status)) r.signal = WTERMSIG(status);
  r.output = slurp(log);
  return r;
}

int connect_loopback(int port) {
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(static_cast<uint16_t>(port));
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (fd < 0 || ::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0)
    throw std::runtime_error("cannot connect to 127.0.0.1:" + std::to_string(port));
  return fd;
}

ConnectionFlood::ConnectionFlood(int port, size_t held) : port_(port), held_(held) {
  thread_ = std::thread([this] {
    std::vector<int> fds;
    size_t next = 0;
    while (!stop_) {
      const size_t want = fds.size() < held_ ? held_ - fds.size() : 50;
      for (size_t i = 0; i < want && !stop_; ++i) {
        int fd = -1;
        try {
          fd = connect_loopback(port_);
        } catch (const std::exception&) {
          continue;  // the listen queue is full for a moment
        }
        opened_ += 1;
        if (fds.size() < held_) {
          fds.push_back(fd);
        } else {
          ::close(fds[next]);
          fds[next] = fd;
          next = (next + 1) % fds.size();
        }
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    for (int fd : fds) ::close(fd);
  });
}

ConnectionFlood::~ConnectionFlood() {
  stop_ = true;
  thread_.join();
}

void ConnectionFlood::wait_full() const {
  while (opened_.load() < static_cast<int64_t>(held_)) std::this_thread::sleep_for(std::chrono::milliseconds(10));
}

KillOnExit::~KillOnExit() {
  for (pid_t p : pids) {
    int status = 0;
    if (p > 0 && ::waitpid(p, &status, WNOHANG) == 0) {
      ::kill(p, SIGKILL);
      ::waitpid(p, &status, 0);
    }
  }
}

ProcessResult run_limbo(const std::vector<std::string>& args) {
  char tmpl[] = "/tmp/limbo-log-XXXXXX";
  int fd = ::mkstemp(tmpl);
  ::close(fd);
  auto r = wait_child(spawn_limbo(args, tmpl), tmpl);
  std::remove(tmpl);
  return r;
}

bool wait_for_text(const std::string& file, const std::string& needle, double timeout_s) {
  auto end = std::chrono::steady_clock::now() + std::chrono::duration<double>(timeout_s);
  while (std::chrono::steady_clock::now() < end) {
    if (slurp(file).find(needle) != std::string::npos) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  return false;
}

std::optional<std::string> in_new_pid_namespace(const std::function<std::string()>& f) {
  int fds[2];
  if (::pipe(fds) != 0) return std::nullopt;
  const pid_t child = ::fork();
  if (child < 0) {
    ::close(fds[0]);
    ::close(fds[1]);
    return std::nullopt;
  }
  if (child == 0) {
    ::close(fds[0]);
    if (::unshare(CLONE_NEWPID) != 0) ::_exit(2);
    const pid_t inner = ::fork();  // pid 1 of the new namespace
    if (inner == 0) {
      const std::string out = f();
      ::_exit(::write(fds[1], out.data(), out.size()) == static_cast<ssize_t>(out.size()) ? 0 : 3);
    }
    int st = 0;
    ::waitpid(inner, &st, 0);
    ::_exit(WIFEXITED(st) ? WEXITSTATUS(st) : 4);
  }
  ::close(fds[1]);
  std::string out;
  char buf[512];
  for (ssize_t n; (n = ::read(fds[0], buf, sizeof buf)) > 0;) out.append(buf, static_cast<size_t>(n));
  ::close(fds[0]);
  int st = 0;
  ::waitpid(child, &st, 0);
  if (!WIFEXITED(st) || WEXITSTATUS(st) != 0) return std::nullopt;
  return out;
}

}  // namespace limbo::testing
