// `limbo launch --mode async`: a whole parameter-server job on this host.
//
// Starts S shards (`limbo ps-server`, one thread each) on free loopback ports
// and waits for each to publish its endpoint, then L learners (`limbo
// worker`) pointed at them, splitting the remaining cores among learners
// unless the arguments set train.threads. A learner that dies is reported
// and the others go on. A shard that dies is restarted on the same port from
// its checkpoint (`--resume`, at most max_server_restarts times); learners
// reconnect by themselves. When every learner has exited the shards are
// stopped (SIGTERM: final checkpoint and summary) and the run directory's
// summary.json merges the shards' staleness statistics, the learners'
// throughput and the final test accuracy. An interrupted job (SIGINT/SIGTERM:
// learners leave, shards checkpoint) continues with `resume`: the shards
// restore weights, clocks and shard 0's data cursor and leases.
#pragma once

#include <chrono>
#include <string>
#include <vector>

namespace limbo::ps {

struct AsyncLaunchOptions {
  int servers = 1, workers = 1;
  std::string protocol = "softsync";
  int softsync_n = 0;  // 0 = leave the config's value
  std::string run_dir;
  std::vector<std::string> train_args;  // --config / --set for every process
  std::string self_exe;
  std::string keys_file;  // CURVE keys for every process; empty = none
  int cores = 0;          // 0 = all
  int max_server_restarts = 3;
  std::chrono::milliseconds start_timeout{60000};  // for a shard to publish its endpoint
  std::chrono::milliseconds stop_grace{30000};
  std::string status;  // ADDR:PORT of the job's status page (empty: none)     // SIGINT/SIGTERM: learners leave, or are killed after this
  bool resume = false;        // shards start from their checkpoints (an interrupted job)
};

int launch_async(const AsyncLaunchOptions& opt);

}  // namespace limbo::ps
