// `limbo` subcommands. Each returns a process exit code and throws
// limbo::Error subclasses for main() to report.
#pragma once

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
};
int run_train(const TrainArgs& a);

struct LaunchArgs {
  int nproc = 1;
  std::string rdzv = "127.0.0.1:0";  // HOST:PORT to host the store on; port 0 = any
  std::vector<std::string> train_args;
  int min_workers = 0;  // elastic mode when min or max is given
  int max_workers = 0;
  double rdzv_timeout = 120;  // seconds below the minimum before the job stops
  std::string elastic_schedule;  // "epoch:workers,..."
};
int run_launch(const LaunchArgs& a);

struct CheckpointArgs {
  std::string checkpoint;
  std::vector<std::string> overrides;  // e.g. data.path for another machine
  std::string out;                     // export: output .safetensors path
};
int run_eval(const CheckpointArgs& a);
int run_export(const CheckpointArgs& a);

// Prints the resolved config (or the schema as Markdown).
int run_config(const TrainArgs& a, bool schema_markdown);

}  // namespace limbo::cli
