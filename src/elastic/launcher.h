// `limbo launch`: starts N local workers of one data-parallel job, like
// torchrun. The launcher hosts the rendezvous store (comm/store.h), so a
// worker's crash cannot take it down, and starts each worker as
// `limbo train <args> --dist-rdzv HOST:PORT --dist-rank i --dist-world N`,
// splitting the machine's cores among them (train.threads) unless the
// arguments set threads themselves. It forwards SIGINT/SIGTERM to the workers,
// and when one worker fails it stops the others and exits with that worker's
// status.
//
// Static mode (default): a fixed set of workers. Elastic mode (min/max
// workers given): workers run with --elastic; the launcher runs the
// membership coordinator, tells it at once when one of its children exits,
// keeps going while at least min_workers remain, and succeeds when the
// remaining workers finish training. If every worker dies without finishing,
// it starts nproc new workers with --resume from the run directory's last
// checkpoint (at most max_restarts times).
#pragma once

#include <chrono>
#include <optional>
#include <string>
#include <vector>

#include "comm/etcd.h"

namespace limbo::elastic {

struct LaunchOptions {
  int nproc = 1;
  std::string rdzv_host = "127.0.0.1";
  int rdzv_port = 0;  // 0 = pick a free port
  std::vector<std::string> train_args;
  std::string self_exe;  // path of the limbo binary to run for workers
  // A program to run as the workers instead of `limbo train` (e.g.
  // {"python3", "train.py", ...}: a Python loop with the `limbo` module).
  // It learns the job from its environment: LIMBO_RDZV, LIMBO_ELASTIC=1 or
  // LIMBO_RANK and LIMBO_WORLD, LIMBO_RUN_DIR, LIMBO_RESUME=1, LIMBO_THREADS,
  // LIMBO_PROGRESS=0 (all but the first), LIMBO_JOB_TOKEN, LIMBO_BEAT_SLOT;
  // PYTHONPATH starts with the build's Python module. train_args then hold
  // only what the launcher itself adds (--run-dir, --resume).
  std::vector<std::string> program;
  // Put first on a program's PYTHONPATH; empty: the build's Python module
  // (<build>/python).
  std::string python_path;
  int cores = 0;         // cores to split among workers; 0 = those this process may use (usable_cores())
  std::chrono::milliseconds store_timeout{300000};
  std::chrono::milliseconds kill_grace{5000};
  bool elastic = false;
  int min_workers = 1;
  int max_workers = 1 << 20;
  int start_workers = 0;  // the first round waits for this many (0 = nproc)
  // A worker silent this long counts as gone; workers beat every quarter of it.
  std::chrono::milliseconds heartbeat_timeout{400};
  std::chrono::milliseconds rendezvous_timeout{120000};
  // Elastic: how long the ending (the final evaluation, checkpoint and
  // summary after training completed) may take before the workers still
  // running are killed and the job fails (a final checkpoint stuck on a
  // hung mount must not hold the job for ever).
  std::chrono::milliseconds finish_timeout{600000};
  // Elastic: how long the ending may go on after Slurm's warning (SIGUSR1)
  // came in or just before it; then the workers still running are killed
  // and the launcher exits 75 (requeue). Below the warning's lead time
  // (`#SBATCH --signal=B:USR1@60`), so that the launcher ends before Slurm
  // kills it.
  std::chrono::milliseconds warning_grace{45000};
  // Scheduled elasticity (implies elastic): (epoch, worker count), ascending.
  // The launcher starts workers or SIGTERMs its newest ones as the job's
  // progress (published by rank 0) passes each epoch.
  std::vector<std::pair<double, int>> schedule;
  // Elastic: restarts from the last checkpoint when every worker is gone.
  int max_restarts = 3;
  // ADDR:PORT of the job's status page (empty: none); the URL is logged and
  // written to the run directory as status.url.
  std::string status;
  // The job secret guarding the rendezvous store (comm/auth.h); empty =
  // none. Workers get it through LIMBO_JOB_TOKEN in their environment.
  std::string token;
  // The job's name (--job-name; under Slurm "slurm-<job id>"): a launcher
  // refuses a rendezvous store that holds another job's name (two jobs
  // whose derived ports collide, a token shared between jobs). Empty: none.
  std::string job_name;
  // The job's rendezvous in etcd instead of a store hosted by the launcher
  // at rdzv_host:rdzv_port (elastic only): no launcher hosts anything, any
  // can coordinate (elastic/election.h), and workers talk to etcd.
  std::optional<comm::EtcdOptions> etcd;
};

// Parses "0:1,5:4,10:2" (epoch:workers, ascending epochs, counts >= 1).
std::vector<std::pair<double, int>> parse_schedule(const std::string& text);

// Runs the job; returns the process exit code. Throws InvalidInput on bad
// options (e.g. nproc < 1, a rendezvous port that cannot be bound).
int launch(const LaunchOptions& opt);

}  // namespace limbo::elastic
