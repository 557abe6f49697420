// `limbo`: the command line. The only place that reads argv and the
// environment; everything below receives explicit options.
#include <signal.h>

#include <CLI/CLI.hpp>

#include <c10/util/Exception.h>

#include <cstdio>

#include "cli/commands.h"
#include "common/error.h"
#include "common/log.h"
#include "common/memory.h"
#include "elastic/join.h"
#include "train/membership.h"

namespace {

int report(const char* kind, const std::string& msg, int code) {
  std::fprintf(stderr, "limbo: %s: %s\n", kind, msg.c_str());
  return code;
}

}  // namespace

int main(int argc, char** argv) {
  using namespace limbo;
  keep_freed_memory();
  // A peer that dies mid-transfer must surface as an error on the socket
  // (EPIPE -> PeerFailure, the group re-forms), not kill this process.
  ::signal(SIGPIPE, SIG_IGN);
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
  train->add_option("--status", train_args.status,
                    "serve a live status page on ADDR:PORT (port 0 = any free; see docs/status.md)");
  train->add_flag("--elastic", train_args.elastic,
                  "join the elastic job at --dist-rdzv (rank and world come from its rounds)");
  train->add_option("--token-file", train_args.token_file,
                    "file holding the job secret of the rendezvous store (default: $LIMBO_JOB_TOKEN)");

  cli::LaunchArgs launch_args;
  auto* launch = app.add_subcommand(
      "launch", "start N local data-parallel workers: limbo launch --nproc N -- <train args>");
  launch->add_option("--nproc", launch_args.nproc, "sync: number of workers");
  launch->add_option("--rdzv", launch_args.rdzv,
                     "HOST:PORT where the launcher hosts the rendezvous store (port 0 = any free), or "
                     "etcd://HOST:PORT[,HOST:PORT...]/JOB to meet through etcd (etcds:// for TLS; elastic only; "
                     "docs/elastic.md)");
  launch->add_option("--etcd-user", launch_args.etcd_user, "etcd: user name (with --etcd-password-file)");
  launch->add_option("--etcd-password-file", launch_args.etcd_password_file,
                     "etcd: file holding the user's password (default: $LIMBO_ETCD_PASSWORD)")
      ->check(CLI::ExistingFile);
  launch->add_option("--etcd-cacert", launch_args.etcd_cacert, "etcds: CA certificate to trust")
      ->check(CLI::ExistingFile);
  launch->add_option("--etcd-cert", launch_args.etcd_cert, "etcds: this client's certificate")
      ->check(CLI::ExistingFile);
  launch->add_option("--etcd-key", launch_args.etcd_key, "etcds: this client's private key")
      ->check(CLI::ExistingFile);
  launch->add_option("--min-workers", launch_args.min_workers,
                     "elastic: keep going while at least this many workers remain");
  launch->add_option("--max-workers", launch_args.max_workers,
                     "elastic: admit at most this many workers");
  launch->add_option("--start-workers", launch_args.start_workers,
                     "elastic: the launcher that hosts the rendezvous starts training once this many workers, "
                     "of all hosts, have joined (default: its own --nproc, or --min-workers if more)")
      ->check(CLI::PositiveNumber);
  launch->add_option("--rdzv-timeout", launch_args.rdzv_timeout,
                     "elastic: seconds below the minimum worker count before the job stops");
  launch->add_option("--finish-timeout", launch_args.finish_timeout,
                     "elastic: seconds the ending (final evaluation, checkpoint, summary) may take after training "
                     "completed; then the workers still running are killed and the job fails (default 600)")
      ->check(CLI::Range(0.1, 1e7));
  launch->add_option("--warning-grace", launch_args.warning_grace,
                     "elastic: seconds the ending may go on after Slurm's warning (SIGUSR1) when training completes "
                     "as it comes; then the workers still running are killed and the job exits 75 (requeue). Keep "
                     "it below the warning's lead time (default 45, for --signal=B:USR1@60)")
      ->check(CLI::Range(0.1, 1e7));
  launch->add_option("--heartbeat-timeout", launch_args.heartbeat_timeout,
                     "elastic: seconds without a worker's heartbeat (sent every timeout/4 from a thread "
                     "of its own) before it counts as gone and the others re-form (default 0.4)")
      ->check(CLI::Range(0.05, 3600.0));
  launch->add_option("--elastic-schedule", launch_args.elastic_schedule,
                     "elastic: worker count by epoch, e.g. \"0:1,5:4,10:2\" (starts and stops "
                     "workers as training passes each epoch)");
  launch->add_option("--mode", launch_args.mode, "sync (data-parallel all-reduce) or async (parameter server)")
      ->check(CLI::IsMember({"sync", "async"}));
  launch->add_option("--servers", launch_args.servers, "async: parameter-server shards");
  launch->add_option("--workers", launch_args.workers, "async: learners");
  launch->add_option("--protocol", launch_args.protocol, "async: hardsync or softsync")
      ->check(CLI::IsMember({"hardsync", "softsync"}));
  launch->add_option("--softsync-n", launch_args.softsync_n, "async: n of n-softsync (default: ps.softsync_n)");
  launch->add_option("--run-dir", launch_args.run_dir,
                     "the job's run directory (default runs/launch-<time>, async: runs/async-<time>)");
  launch->add_option("--token-file", launch_args.token_file,
                     "file holding the job secret that guards the rendezvous store; the same file on every "
                     "launcher of the job (default: $LIMBO_JOB_TOKEN; none: no check)");
  launch->add_option("--job-name", launch_args.job_name,
                     "a name for the job: a launcher refuses a rendezvous store that holds another name (under "
                     "Slurm: slurm-<job id>)");
  launch->add_option("--keys", launch_args.keys_file, "async: CURVE key file from `limbo keygen`");
  launch->add_flag("--resume", launch_args.resume,
                   "continue an interrupted job from the checkpoint in --run-dir (data-parallel: its workers start "
                   "with --resume; async: from its shards' checkpoints)");
  launch->add_option("--status", launch_args.status,
                     "ADDR:PORT of the job's live status page (default 127.0.0.1:0, a free port; "
                     "the URL is printed and written to the run directory as status.url)");
  launch->add_flag("--dry-run", launch_args.dry_run,
                   "print the settings the job would run with (under Slurm: what came from the job) and stop");
  launch->add_option("train_args", launch_args.train_args,
                    "after --: arguments for `limbo train`, or a program to run as the workers (python3 train.py ...)");

  cli::PsServerArgs ps_args;
  auto* ps_server = app.add_subcommand("ps-server", "run one parameter-server shard");
  ps_server->add_option("--config", ps_args.config_file, "TOML config file")->check(CLI::ExistingFile);
  ps_server->add_option("--set", ps_args.overrides, "override a key: section.key=value (repeatable)");
  ps_server->add_option("--shard", ps_args.shard, "this shard's index");
  ps_server->add_option("--shards", ps_args.shards, "number of shards");
  ps_server->add_option("--bind", ps_args.bind, "endpoint to serve on, e.g. tcp://0.0.0.0:5555 (port * = any)");
  ps_server->add_option("--dir", ps_args.dir, "directory for the checkpoint, metrics and endpoint")->required();
  ps_server->add_flag("--resume", ps_args.resume, "start from the directory's checkpoint when there is one");
  ps_server->add_option("--keys", ps_args.keys_file, "CURVE key file: admit only peers holding it")
      ->check(CLI::ExistingFile);
  ps_server->add_option("--status", ps_args.status, "serve a live status page on ADDR:PORT (port 0 = any free)");

  std::string status_target;
  bool status_watch = false;
  double status_interval = 2.0;
  auto* status = app.add_subcommand("status", "print a compact view of a running job: limbo status ADDR:PORT | RUN_DIR");
  status->add_option("target", status_target, "the job's status address, or its run directory (reads status.url)")
      ->required();
  status->add_flag("--watch", status_watch, "refresh until interrupted");
  status->add_option("--interval", status_interval, "seconds between refreshes with --watch")->check(CLI::Range(0.1, 3600.0));

  cli::WorkerArgs worker_args;
  auto* worker = app.add_subcommand("worker", "run one asynchronous learner against parameter-server shards");
  worker->add_option("--config", worker_args.config_file, "TOML config file")->check(CLI::ExistingFile);
  worker->add_option("--set", worker_args.overrides, "override a key: section.key=value (repeatable)");
  worker->add_option("--servers", worker_args.servers, "shard endpoints in shard order: HOST:PORT,HOST:PORT")
      ->required();
  worker->add_option("--learner-id", worker_args.learner_id, "unique learner id (default: random)");
  worker->add_option("--run-dir", worker_args.run_dir, "job directory for learner metrics and final results");
  worker->add_flag("--finish-only", worker_args.finish_only,
                   "train nothing: take the final weights once no learner is left, and write final.json and "
                   "checkpoint.pt to --run-dir (what the finisher does)");
  worker->add_option("--keys", worker_args.keys_file, "CURVE key file of the job")->check(CLI::ExistingFile);

  cli::SimArgs sim_args;
  auto* sim = app.add_subcommand("sim", "simulate asynchronous training with many virtual learners in one process");
  sim->add_option("--config", sim_args.config_file, "TOML config file")->check(CLI::ExistingFile);
  sim->add_option("--set", sim_args.overrides, "override a key, e.g. sim.learners=30, ps.softsync_n=4");
  sim->add_option("--run-dir", sim_args.run_dir, "output folder (default runs/sim-<time>)");

  std::vector<std::string> plot_runs;
  std::string plot_out;
  auto* plot = app.add_subcommand("plot", "draw loss / accuracy / lr / batch / staleness curves of run directories (PNG)");
  plot->add_option("runs", plot_runs, "run directories")->required();
  plot->add_option("--out", plot_out, "PNG to write (default RUN_DIR/curves.png)");

  std::string keygen_out;
  auto* keygen = app.add_subcommand("keygen", "write a CURVE key pair for an encrypted parameter-server job");
  keygen->add_option("--out", keygen_out, "key file to write")->required();

  cli::CheckpointArgs ck_args;
  auto* eval = app.add_subcommand("eval", "evaluate a checkpoint on its test split");
  eval->add_option("--checkpoint", ck_args.checkpoint, "checkpoint.pt")->required();
  eval->add_option("--set", ck_args.overrides, "override a stored key, e.g. data.path=DIR");
  auto* exp = app.add_subcommand(
      "export", "write a checkpoint's model as TorchScript (torch.jit.load) or its weights as safetensors");
  exp->add_option("--checkpoint", ck_args.checkpoint, "checkpoint.pt")->required();
  exp->add_option("--out", ck_args.out, "output file (.pt: TorchScript, .safetensors: weights)")->required();
  exp->add_option("--format", ck_args.format,
                  "torchscript | safetensors (default: from the --out extension; .pt/.pth = torchscript)")
      ->check(CLI::IsMember({"auto", "torchscript", "safetensors"}));
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
    if (*train && !train_args.dist_rdzv.empty()) train_args.token = cli::job_token(train_args.token_file);
    if (*train) return cli::run_train(train_args);
    if (*launch) {
      for (const char* f : {"--nproc", "--rdzv", "--min-workers", "--max-workers", "--start-workers", "--run-dir",
                            "--job-name"})
        if (launch->count(f) > 0) launch_args.given.emplace_back(f);
      launch_args.token = cli::job_token(launch_args.token_file);
      if (launch_args.dry_run && launch_args.mode != "sync")
        throw InvalidInput("--dry-run is for data-parallel jobs (--mode sync)");
      for (const auto& line : cli::apply_slurm(launch_args)) {
        if (launch_args.dry_run) std::printf("from Slurm: %s\n", line.c_str());
        else log_info("launch: from Slurm: " + line);
      }
    }
    if (*launch) return launch_args.mode == "async" ? cli::run_launch_async(launch_args) : cli::run_launch(launch_args);
    if (*ps_server) return cli::run_ps_server(ps_args);
    if (*status) return cli::run_status(status_target, status_watch, status_interval);
    if (*worker) return cli::run_worker_cmd(worker_args);
    if (*keygen) return cli::run_keygen(keygen_out);
    if (*sim) return cli::run_sim(sim_args);
    if (*plot) return cli::run_plot(plot_runs, plot_out);
    if (*eval) return cli::run_eval(ck_args);
    if (*exp) return cli::run_export(ck_args);
    if (*config) return cli::run_config(cfg_args, schema_md);
  } catch (const InvalidInput& e) {
    return report("error", e.what(), kExitInvalidInput);
  } catch (const PeerFailure& e) {
    return report("peer failure", e.what(), kExitPeerFailure);
  } catch (const Timeout& e) {
    return report("timeout", e.what(), kExitTimeout);
  } catch (const train::Interrupted& e) {
    log_info(e.what());
    return elastic::exit_code_for(elastic::leave_signal());
  } catch (const train::StateLost& e) {
    return report("state lost", e.what(), kExitFailure);
  } catch (const c10::Error& e) {
    return report("internal error (libtorch)", e.what_without_backtrace(), kExitFailure);
  } catch (const std::exception& e) {
    return report("internal error", e.what(), kExitFailure);
  }
  return kExitFailure;
}
