// `limbo`: the command line. The only place that reads argv and the
// environment; everything below receives explicit options.
#include <CLI/CLI.hpp>

#include <c10/util/Exception.h>

#include <cstdio>

#include "cli/commands.h"
#include "common/error.h"
#include "common/log.h"
#include "common/memory.h"

namespace {

int report(const char* kind, const std::string& msg, int code) {
  std::fprintf(stderr, "limbo: %s: %s\n", kind, msg.c_str());
  return code;
}

}  // namespace

int main(int argc, char** argv) {
  using namespace limbo;
  keep_freed_memory();
  CLI::App app{"Limbo: distributed training on resources that are not fixed"};
  app.require_subcommand(1);
  std::string level = "info";
  app.add_option("--log-level", level, "debug, info, warn or error")
      ->check(CLI::IsMember({"debug", "info", "warn", "error"}));

  cli::TrainArgs train_args;
  auto* train = app.add_subcommand("train", "train a model (single process)");
  train->add_option("--config", train_args.config_file, "TOML config file")->check(CLI::ExistingFile);
  train->add_option("--set", train_args.overrides, "override a key: section.key=value (repeatable)");
  train->add_option("--run-dir", train_args.run_dir,
                    "output folder (default runs/<model>-<dataset>-<time>)");
  train->add_flag("--resume", train_args.resume, "continue from the run directory's checkpoint");
  train->add_option("--dist-rdzv", train_args.dist_rdzv,
                    "data-parallel worker: HOST:PORT of the job's rendezvous store (set by launch)");
  train->add_option("--dist-rank", train_args.dist_rank, "data-parallel worker: this worker's rank");
  train->add_option("--dist-world", train_args.dist_world, "data-parallel worker: number of workers");
  train->add_flag("--elastic", train_args.elastic,
                  "join the elastic job at --dist-rdzv (rank and world come from its rounds)");

  cli::LaunchArgs launch_args;
  auto* launch = app.add_subcommand(
      "launch", "start N local data-parallel workers: limbo launch --nproc N -- <train args>");
  launch->add_option("--nproc", launch_args.nproc, "number of workers")->required();
  launch->add_option("--rdzv", launch_args.rdzv,
                     "HOST:PORT where the launcher hosts the rendezvous store (port 0 = any free)");
  launch->add_option("--min-workers", launch_args.min_workers,
                     "elastic: keep going while at least this many workers remain");
  launch->add_option("--max-workers", launch_args.max_workers,
                     "elastic: admit at most this many workers");
  launch->add_option("--rdzv-timeout", launch_args.rdzv_timeout,
                     "elastic: seconds below the minimum worker count before the job stops");
  launch->add_option("--elastic-schedule", launch_args.elastic_schedule,
                     "elastic: worker count by epoch, e.g. \"0:1,5:4,10:2\" (starts and stops "
                     "workers as training passes each epoch)");
  launch->add_option("train_args", launch_args.train_args, "arguments for `limbo train` (after --)");

  cli::CheckpointArgs ck_args;
  auto* eval = app.add_subcommand("eval", "evaluate a checkpoint on its test split");
  eval->add_option("--checkpoint", ck_args.checkpoint, "checkpoint.pt")->required();
  eval->add_option("--set", ck_args.overrides, "override a stored key, e.g. data.path=DIR");
  auto* exp = app.add_subcommand("export", "write a checkpoint's weights as safetensors");
  exp->add_option("--checkpoint", ck_args.checkpoint, "checkpoint.pt")->required();
  exp->add_option("--out", ck_args.out, "output .safetensors file")->required();
  exp->add_option("--set", ck_args.overrides, "override a stored key");

  bool schema_md = false;
  cli::TrainArgs cfg_args;
  auto* config = app.add_subcommand("config", "print the resolved config, or the schema");
  config->add_option("--config", cfg_args.config_file, "TOML config file")->check(CLI::ExistingFile);
  config->add_option("--set", cfg_args.overrides, "override a key: section.key=value");
  config->add_flag("--schema", schema_md, "print every key as a Markdown table");

  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e) == 0 ? kExitOk : kExitInvalidInput;
  }
  set_log_level(level == "debug"  ? LogLevel::Debug
                : level == "warn" ? LogLevel::Warn
                : level == "error" ? LogLevel::Error
                                   : LogLevel::Info);
  try {
    if (*train) return cli::run_train(train_args);
    if (*launch) return cli::run_launch(launch_args);
    if (*eval) return cli::run_eval(ck_args);
    if (*exp) return cli::run_export(ck_args);
    if (*config) return cli::run_config(cfg_args, schema_md);
  } catch (const InvalidInput& e) {
    return report("error", e.what(), kExitInvalidInput);
  } catch (const PeerFailure& e) {
    return report("peer failure", e.what(), kExitPeerFailure);
  } catch (const Timeout& e) {
    return report("timeout", e.what(), kExitTimeout);
  } catch (const c10::Error& e) {
    return report("internal error (libtorch)", e.what_without_backtrace(), kExitFailure);
  } catch (const std::exception& e) {
    return report("internal error", e.what(), kExitFailure);
  }
  return kExitFailure;
}
