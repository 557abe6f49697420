#include "elastic/workers.h"

#include <unistd.h>

#include <cstdlib>
#include <sstream>

#include <nlohmann/json.hpp>

#include "common/error.h"
#include "common/files.h"
#include "common/log.h"
#include "common/memory.h"

namespace limbo::elastic {

// `name` as execve needs it: as given when it holds a '/', else the first
// executable of that name on PATH ("" when there is none).
std::string find_program_or_empty(const std::string& name) {
  if (name.find('/') != std::string::npos) return name;
  const char* path = std::getenv("PATH");
  std::stringstream dirs(path ? path : "/usr/bin:/bin");
  for (std::string d; std::getline(dirs, d, ':');) {
    const std::string p = (d.empty() ? "." : d) + "/" + name;
    if (::access(p.c_str(), X_OK) == 0) return p;
  }
  return "";
}

std::string find_program(const std::string& name) {
  std::string p = find_program_or_empty(name);
  if (p.empty()) throw InvalidInput("launch: cannot find the program '" + name + "' on PATH");
  return p;
}

#ifndef LIMBO_PYTHON_EXE
#define LIMBO_PYTHON_EXE ""
#endif

// The program to exec for `name`: a bare python3 (or python) is the
// interpreter the Python module is built for (its torch links Limbo's
// libtorch); said once.
std::string program_path(const std::string& name) {
  const std::string built = LIMBO_PYTHON_EXE;
  if ((name == "python3" || name == "python") && !built.empty() && ::access(built.c_str(), X_OK) == 0) {
    static bool said = false;
    if (!said && find_program_or_empty(name) != built)
      log_info("launch: " + name + " is " + built + ", the interpreter the limbo module is built for (give a path "
               "to run another)");
    said = true;
    return built;
  }
  return find_program(name);
}

// A user's program as a worker: what `limbo train` gets as flags goes into
// its environment (LaunchOptions::program).
pid_t spawn_program_worker(Supervisor& sup, const LaunchOptions& opt, int rank, int threads, const std::string& rdzv,
                           std::vector<std::string> env) {
  std::string run_dir;
  bool resume = false;
  for (size_t i = 0; i < opt.train_args.size(); ++i) {
    if (opt.train_args[i] == "--run-dir" && i + 1 < opt.train_args.size()) run_dir = opt.train_args[++i];
    else if (opt.train_args[i] == "--resume") resume = true;
  }
  env.push_back("LIMBO_RDZV=" + rdzv);
  if (opt.elastic) {
    env.push_back("LIMBO_ELASTIC=1");
  } else {
    env.push_back("LIMBO_RANK=" + std::to_string(rank));
    env.push_back("LIMBO_WORLD=" + std::to_string(opt.nproc));
  }
  if (!run_dir.empty()) env.push_back("LIMBO_RUN_DIR=" + run_dir);
  if (resume) env.push_back("LIMBO_RESUME=1");
  if (threads > 0) env.push_back("LIMBO_THREADS=" + std::to_string(threads));
  if (rank > 0) env.push_back("LIMBO_PROGRESS=0");
  // The heap settings `limbo train` makes for itself (common/memory.h):
  // freed activations stay in the heap instead of being unmapped each step.
  for (auto& v : keep_freed_memory_env()) env.push_back(std::move(v));
#ifndef LIMBO_PYTHON_DIR
#define LIMBO_PYTHON_DIR ""
#endif
  const std::string py = !opt.python_path.empty() ? opt.python_path : LIMBO_PYTHON_DIR;
  if (!py.empty()) {
    const char* old = std::getenv("PYTHONPATH");
    env.push_back("PYTHONPATH=" + py + (old && *old ? ":" + std::string(old) : ""));
  }
  const std::vector<std::string> args(opt.program.begin() + 1, opt.program.end());
  const pid_t pid = sup.start(program_path(opt.program[0]), args, "worker", rank, env);
  log_info("launch: worker rank " + std::to_string(rank) + " pid " + std::to_string(pid) + " (" + opt.program[0] + ")");
  return pid;
}

pid_t spawn_worker(Supervisor& sup, const LaunchOptions& opt, int rank, int threads, const std::string& rdzv,
                   const std::vector<std::string>& env) {
  if (!opt.program.empty()) return spawn_program_worker(sup, opt, rank, threads, rdzv, env);
  std::vector<std::string> args = {"train"};
  if (threads > 0) args.insert(args.end(), {"--set", "train.threads=" + std::to_string(threads)});
  if (rank > 0) args.insert(args.end(), {"--set", "train.progress=false"});
  args.insert(args.end(), opt.train_args.begin(), opt.train_args.end());
  if (opt.elastic) args.insert(args.end(), {"--dist-rdzv", rdzv, "--elastic"});
  else
    args.insert(args.end(), {"--dist-rdzv", rdzv, "--dist-rank", std::to_string(rank),
                             "--dist-world", std::to_string(opt.nproc)});
  const pid_t pid = sup.start(opt.self_exe, args, "worker", rank, env);
  log_info("launch: worker rank " + std::to_string(rank) + " pid " + std::to_string(pid));
  return pid;
}

// Adds the workers the launcher killed after training completed to the run's
// summary (written by the member that finished as writer).
void record_killed(const std::string& run_dir, const std::set<pid_t>& pids) {
  if (run_dir.empty()) return;
  const std::string path = run_dir + "/summary.json";
  try {
    auto s = nlohmann::json::parse(read_file(path));
    s["workers_killed_after_training"] = std::vector<pid_t>(pids.begin(), pids.end());
    write_file_atomic(path, s.dump(2) + "\n");
  } catch (const std::exception& e) {
    log_warn(std::string("launch: could not record the killed workers in the summary: ") + e.what());
  }
}


}  // namespace limbo::elastic
