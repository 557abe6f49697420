#include "common/process.h"

#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>

#include "common/error.h"

namespace limbo {

pid_t spawn_program(const std::string& exe, const std::vector<std::string>& args) {
  std::vector<std::string> all = {exe};
  all.insert(all.end(), args.begin(), args.end());
  pid_t pid = ::fork();
  if (pid < 0) throw Error("fork failed: " + std::string(std::strerror(errno)));
  if (pid == 0) {
    std::vector<char*> argv;
    for (auto& a : all) argv.push_back(a.data());
    argv.push_back(nullptr);
    ::execv(exe.c_str(), argv.data());
    std::fprintf(stderr, "launch: cannot exec %s: %s\n", exe.c_str(), std::strerror(errno));
    ::_exit(127);
  }
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

}  // namespace limbo
