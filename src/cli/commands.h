// `limbo` subcommands. Each returns a process exit code and throws
// limbo::Error subclasses for main() to report.
#pragma once

#include <nlohmann/json.hpp>

#include <cstdint>
#include <string>
#include <vector>

namespace limbo::cli {

struct TrainArgs {
  std::string config_file;
  std::vector<std::string> overrides;  // "section.key=value"
  std::string run_dir;                 // empty = runs/<model>-<dataset>-<time>
  bool resume = false;
  // Set by `limbo launch` for data-parallel workers (or by hand to join).
  std::string dist_rdzv;  // HOST:PORT of the job's rendezvous store
  int dist_rank = 0;
  int dist_world = 1;
  bool elastic = false;  // join the job's elastic membership instead of a fixed rank
  std::string status;    // ADDR:PORT of a status page (empty: none)
  std::string token_file;  // the rendezvous store's job secret (--token-file)
  std::string token;       // ... its contents, or $LIMBO_JOB_TOKEN
};

// The job secret from --token-file, else $LIMBO_JOB_TOKEN, else "" (none).
std::string job_token(const std::string& token_file);
int run_train(const TrainArgs& a);

struct LaunchArgs {
  int nproc = 1;
  std::string rdzv = "127.0.0.1:0";  // HOST:PORT to host the store on; port 0 = any
  std::vector<std::string> train_args;
  int min_workers = 0;  // elastic mode when min or max is given
  int max_workers = 0;
  int start_workers = 0;  // elastic: the first round waits for this many (0 = --nproc)
  double rdzv_timeout = 120;  // seconds below the minimum before the job stops
  double finish_timeout = 600;  // seconds the ending may take after training completed
  double warning_grace = 45;    // seconds the ending may take after Slurm's warning
  double heartbeat_timeout = 0.4;  // seconds without a worker's heartbeat before it counts as gone
  std::string elastic_schedule;  // "epoch:workers,..."
  // --mode async: a parameter-server job.
  std::string mode = "sync";
  int servers = 1, workers = 1;
  std::string protocol = "softsync";
  int softsync_n = 0;  // 0 = the config's ps.softsync_n
  std::string run_dir;
  std::string keys_file;
  bool resume = false;  // async: continue from the shards' checkpoints
  std::string status = "127.0.0.1:0";  // ADDR:PORT of the job's status page (port 0 = any free)
  std::string token_file;
  std::string token;
  std::string job_name;  // --job-name (under Slurm: slurm-<job id>)
  // --rdzv etcd://...: etcd's user/password and TLS files.
  std::string etcd_user, etcd_password_file, etcd_cacert, etcd_cert, etcd_key;
  bool dry_run = false;            // print what would run (with what came from Slurm) and stop
  std::vector<std::string> given;  // the flags given on the command line ("--nproc", ...)
};
// Under Slurm (`srun limbo launch`): the defaults a flag not given takes
// from the job (docs/slurm.md). Returns one line per value it set.
std::vector<std::string> apply_slurm(LaunchArgs& a);
int run_launch(const LaunchArgs& a);
int run_launch_async(const LaunchArgs& a);

struct PsServerArgs {
  std::string config_file;
  std::vector<std::string> overrides;
  int shard = 0, shards = 1;
  std::string bind = "tcp://127.0.0.1:*";
  std::string dir;
  bool resume = false;
  std::string keys_file;
  std::string status;  // ADDR:PORT of a status page (empty: none)
};
int run_ps_server(const PsServerArgs& a);

// `limbo status ADDR:PORT | RUN_DIR [--watch]`: a compact view of a live job.
int run_status(const std::string& target, bool watch, double interval);

struct WorkerArgs {
  std::string config_file;
  std::vector<std::string> overrides;
  std::string servers;  // comma-separated endpoints in shard order
  int64_t learner_id = -1;
  std::string run_dir;
  std::string keys_file;
  bool finish_only = false;
};
int run_worker_cmd(const WorkerArgs& a);
int run_keygen(const std::string& out);

struct SimArgs {
  std::string config_file;
  std::vector<std::string> overrides;
  std::string run_dir;
};
int run_sim(const SimArgs& a);

// Runs scripts/limbo_plot.py (matplotlib) with /usr/bin/python3.
int run_plot(const std::vector<std::string>& runs, const std::string& out);

struct CheckpointArgs {
  std::string checkpoint;
  std::vector<std::string> overrides;  // e.g. data.path for another machine
  std::string out;                     // export: output path
  std::string format = "auto";         // export: torchscript | safetensors | auto (by extension)
};
int run_eval(const CheckpointArgs& a);
// "test accuracy: 88.52% (test loss 0.3331)", or "test loss: 0.0123" for
// models without accuracy (regression, a module loss without predict).
std::string test_result(const nlohmann::json& summary);
int run_export(const CheckpointArgs& a);

// Prints the resolved config (or the schema as Markdown).
int run_config(const TrainArgs& a, bool schema_markdown);

}  // namespace limbo::cli
