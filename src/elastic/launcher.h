// `limbo launch`: starts N local workers of one data-parallel job, like
// torchrun. The launcher hosts the rendezvous store (a c10d TCPStore), so a
// worker's crash cannot take it down, and starts each worker as
// `limbo train <args> --dist-rdzv HOST:PORT --dist-rank i --dist-world N`,
// splitting the machine's cores among them (train.threads) unless the
// arguments set threads themselves. It forwards SIGINT/SIGTERM to the workers,
// and when one worker fails it stops the others and exits with that worker's
// status.
//
// Current scope: a fixed set of workers (static membership). Elastic
// membership (join, leave, crash recovery) builds on this launcher.
#pragma once

#include <chrono>
#include <string>
#include <vector>

namespace limbo::elastic {

struct LaunchOptions {
  int nproc = 1;
  std::string rdzv_host = "127.0.0.1";
  int rdzv_port = 0;  // 0 = pick a free port
  std::vector<std::string> train_args;
  std::string self_exe;  // path of the limbo binary to run for workers
  int cores = 0;         // cores to split among workers; 0 = all
  std::chrono::milliseconds store_timeout{300000};
  std::chrono::milliseconds kill_grace{5000};
};

// Runs the job; returns the process exit code. Throws InvalidInput on bad
// options (e.g. nproc < 1, a rendezvous port that cannot be bound).
int launch(const LaunchOptions& opt);

}  // namespace limbo::elastic
