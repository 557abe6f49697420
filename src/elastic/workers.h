// How `limbo launch` starts its workers: `limbo train` with the job's flags,
// or a user's program (LaunchOptions::program) with the job in its
// environment; and the summary's note of workers killed after training.
#pragma once

#include <sys/types.h>

#include <set>
#include <string>
#include <vector>

#include "common/process.h"
#include "elastic/launcher.h"

namespace limbo::elastic {

// The program to exec for `name`: a bare python3 (or python) is the
// interpreter the Python module is built for; a name without '/' is looked
// up on PATH. Throws InvalidInput when there is none.
std::string program_path(const std::string& name);

// Starts worker `rank` (its first rank) of the job at `rdzv`, with
// `threads` intra-op threads (0: as the arguments say) and `env` added.
pid_t spawn_worker(Supervisor& sup, const LaunchOptions& opt, int rank, int threads, const std::string& rdzv,
                   const std::vector<std::string>& env);

// Adds the workers the launcher killed after training completed to the run's
// summary (written by the member that finished as writer).
void record_killed(const std::string& run_dir, const std::set<pid_t>& pids);

}  // namespace limbo::elastic
