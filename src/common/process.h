// Child processes for the launchers: start a program, read its exit status.
#pragma once

#include <sys/types.h>

#include <string>
#include <vector>

namespace limbo {

// Starts `exe` with arguments `args` (argv[0] is `exe`); returns its pid.
// Throws limbo::Error when fork fails; a failed exec exits the child with 127.
pid_t spawn_program(const std::string& exe, const std::vector<std::string>& args);

// A waitpid() status as a shell would report it: the exit code, or 128 + signal.
int exit_code_of(int status);
// "exit code N" or "killed by signal N".
std::string describe_status(int status);

}  // namespace limbo
