#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <ctime>

#include "cli/commands.h"
#include "status/server.h"
#include "train/schema.h"
#include "comm/etcd.h"
#include "comm/hier_group.h"
#include "common/files.h"
#include "comm/auth.h"
#include "comm/collective.h"
#include "common/error.h"
#include "common/log.h"
#include "common/slurm.h"
#include "comm/kv_store.h"
#include "elastic/allreduce_update.h"
#include "elastic/elastic_membership.h"
#include "elastic/join.h"
#include "elastic/launcher.h"
#include "train/trainer.h"

#include <netdb.h>
#include <signal.h>
#include <unistd.h>

#include <atomic>

namespace limbo::cli {
namespace {

Config resolve(const TrainArgs& a) { return train::resolve_config(a.config_file, a.overrides); }

std::string default_run_dir(const Config& cfg) {
  return train::timestamped_run_dir(cfg.get_string("model.name") + "-" + cfg.get_string("data.dataset"));
}

using elastic::split_host_port;

}  // namespace

std::string job_token(const std::string& token_file) {
  if (!token_file.empty()) return comm::load_token_file(token_file);
  if (const char* t = std::getenv("LIMBO_JOB_TOKEN"); t && *t) return comm::check_token(t, "LIMBO_JOB_TOKEN");
  return "";
}

int run_train(const TrainArgs& a) {
  Config cfg = resolve(a);
  auto tc = train::trainer_config(cfg);
  tc.run_dir = a.run_dir.empty() ? default_run_dir(cfg) : a.run_dir;
  tc.train.resume = a.resume;
  const bool distributed = !a.dist_rdzv.empty() && !a.elastic;
  if (a.elastic && a.dist_rdzv.empty())
    throw InvalidInput("--elastic needs --dist-rdzv HOST:PORT (the job's rendezvous store)");
  if (distributed && comm::is_etcd_url(a.dist_rdzv))
    throw InvalidInput("--dist-rdzv " + a.dist_rdzv + ": an etcd rendezvous is for elastic jobs (add --elastic; "
                       "`limbo launch --rdzv etcd://...` needs --min-workers)");
  if (distributed) {
    if (a.dist_world < 1 || a.dist_rank < 0 || a.dist_rank >= a.dist_world)
      throw InvalidInput("--dist-rank " + std::to_string(a.dist_rank) + " is not in [0, " +
                         std::to_string(a.dist_world) + ")");
    tc.loader.world = a.dist_world;
    tc.loader.rank = a.dist_rank;
    if (a.dist_rank != 0) tc.run_dir.clear();  // member 0 writes the run directory
  }
  const comm::Compression compression = comm::parse_compression(cfg.get_string("comm.compression"));
  if (comm::is_16bit(compression) && !cfg.get_bool("elastic.direct_allreduce"))
    throw InvalidInput("comm.compression = " + cfg.get_string("comm.compression") +
                       " needs elastic.direct_allreduce = true (the 16-bit all-reduce runs on the direct Gloo path)");
  // The status page binds before the run directory is set up (a bad or
  // taken address writes nothing) and tails the run's metrics once it is.
  std::unique_ptr<status::Server> page;
  if (!a.status.empty()) {
    auto [host, port] = status::parse_address(a.status, "--status");
    page = std::make_unique<status::Server>(std::make_shared<status::Board>("train"), host, port);
  }
  train::Trainer trainer(tc);
  elastic::JoinOptions jo;
  jo.rdzv = a.dist_rdzv;
  jo.token = a.token;
  jo.direct_allreduce = cfg.get_bool("elastic.direct_allreduce");
  jo.shared_memory = cfg.get_bool("comm.shared_memory");
  jo.hierarchical = cfg.get_bool("comm.hierarchical");
  jo.collective_timeout = cfg.get_float("elastic.collective_timeout");
  jo.round_timeout = cfg.get_float("elastic.round_timeout");
  auto& reduce_options = jo.reduce;
  reduce_options.compression = compression;
  // DiLoCo's outer all-reduce runs after the inner steps, not inside a backward.
  reduce_options.overlap = cfg.get_bool("elastic.overlap") && !trainer.diloco();
  reduce_options.bucket_bytes = static_cast<int64_t>(cfg.get_float("elastic.bucket_mb") * (1 << 20));
  reduce_options.testing_die_in_bucket = cfg.get_int("train.testing_die_in_bucket");
  reduce_options.shard_state = cfg.get_bool("optim.shard_state");
  reduce_options.shard_weights = tc.shard_weights;
  if (tc.shard_weights) {
    if (!distributed && !a.elastic)
      throw InvalidInput("optim.shard_weights = true shards the weights across the workers of a data-parallel "
                         "job: run it under `limbo launch` (one process holds the whole model anyway)");
    if (trainer.diloco())
      throw InvalidInput("optim.shard_weights = true does not run with elastic.sync = \"diloco\" (each member's "
                         "inner steps train a whole model of its own)");
  }
  // DiLoCo's shares by pace are its outer steps' (train/outer_steps.h);
  // these are a synchronous step's ("auto": equal).
  if (cfg.get_string("elastic.shares") == "pace" && !trainer.diloco() && (distributed || a.elastic)) {
    // The loader keeps data.prefetch batches ahead (4 by default, one job
    // config for every member): while step s runs it may plan step
    // s + prefetch, so shares agreed at step p can hold from p + prefetch + 1
    // without it ever waiting; one step of margin. (A Python DataLoader may
    // read 15 ahead: the module keeps the default lag of 16.)
    data::PaceShares::Options po;
    po.lag = cfg.get_int("data.prefetch") + 2;
    reduce_options.paces = std::make_shared<data::PaceShares>(po);
    trainer.set_paces(reduce_options.paces);
  }
  if (reduce_options.shard_state && cfg.get_string("optim.algorithm") == "isgd")
    throw InvalidInput("optim.shard_state = true does not run with optim.algorithm = \"isgd\" (its extra "
                       "updates step the whole model on every worker); use sgd, adam or adamw");
  if (distributed)
    trainer.set_update_rule(
        elastic::join_static(jo, a.dist_rank, a.dist_world, trainer.rule_optimizer(), trainer.params()));
  if (a.elastic) {
    auto joined = elastic::join_elastic(jo, trainer.rule_optimizer(), trainer.params(), elastic::leave_on_signals());
    trainer.set_update_rule(joined.rule);
    trainer.set_membership(std::move(joined.membership));
  }
  if (page && !tc.run_dir.empty()) {
    page->watch(tc.run_dir + "/metrics.jsonl");
    page->write_url(tc.run_dir);
    log_info("status page: " + page->url());
  }
  auto summary = trainer.run();
  if (summary.contains("left")) {
    std::printf("left the job after step %lld\n",
                static_cast<long long>(summary["steps"].get<int64_t>()));
    return 0;
  }
  if (distributed && a.dist_rank != 0) return 0;
  std::printf("run directory: %s\n", tc.run_dir.c_str());
  std::printf("steps %lld, epochs %.2f, %.0f samples/s\n",
              static_cast<long long>(summary["steps"].get<int64_t>()),
              summary["epochs"].get<double>(), summary["samples_per_second"].get<double>());
  std::printf("%s\n", test_result(summary).c_str());
  return 0;
}

std::string test_result(const nlohmann::json& s) {
  char buf[96];
  const double loss = s.value("test_loss", nlohmann::json()).is_number() ? s["test_loss"].get<double>() : NAN;
  if (s.contains("test_perplexity") && s["test_perplexity"].is_number())
    std::snprintf(buf, sizeof buf, "test loss: %.4f, perplexity %.3f", loss, s["test_perplexity"].get<double>());
  else if (s.contains("test_accuracy") && s["test_accuracy"].is_number())
    std::snprintf(buf, sizeof buf, "test accuracy: %.2f%% (test loss %.4f)",
                  100.0 * s["test_accuracy"].get<double>(), loss);
  else
    std::snprintf(buf, sizeof buf, "test loss: %.4f", loss);
  return buf;
}

std::vector<std::string> apply_slurm(LaunchArgs& a) {
  const auto job = slurm_job();
  if (!job || a.mode != "sync") return {};
  auto given = [&](const char* f) { return std::find(a.given.begin(), a.given.end(), f) != a.given.end(); };
  std::vector<std::string> said;
  const int nodes = static_cast<int>(job->nodes.size());
  if (!given("--nproc")) {
    a.nproc = job->workers_per_node();
    said.push_back("--nproc " + std::to_string(a.nproc) + " (" +
                   (job->cpus_per_task > 0 ? "SLURM_CPUS_PER_TASK" : job->cpus_on_node > 0 ? "SLURM_CPUS_ON_NODE" : "1 by default") +
                   ")");
  }
  if (!given("--min-workers") && !given("--max-workers")) {
    // Elastic: a node preempted or lost leaves the others training, and
    // rejoins when Slurm gives it back.
    a.min_workers = a.nproc;
    a.max_workers = nodes * a.nproc;
    said.push_back("--min-workers " + std::to_string(a.min_workers) + " --max-workers " +
                   std::to_string(a.max_workers) + " (" + std::to_string(nodes) + " nodes x --nproc)");
  }
  if (!given("--start-workers") && a.max_workers > 0) {
    a.start_workers = std::min(a.max_workers, nodes * a.nproc);
    said.push_back("--start-workers " + std::to_string(a.start_workers) + " (every node's workers)");
  }
  if (!given("--rdzv")) {
    // The first node hosts the store. Where its name does not resolve, the
    // address `srun` ran from stands for it: the batch script runs on the
    // job's first node.
    std::string host = job->nodes[0], why = "the first node of SLURM_JOB_NODELIST";
    addrinfo hints{}, *res = nullptr;
    hints.ai_family = AF_INET;
    if (!job->launch_node_ip.empty() && ::getaddrinfo(host.c_str(), nullptr, &hints, &res) == 0) {
      ::freeaddrinfo(res);
    } else if (!job->launch_node_ip.empty()) {
      host = job->launch_node_ip;
      why = "SLURM_LAUNCH_NODE_IPADDR: the first node's name " + job->nodes[0] + " does not resolve";
    }
    a.rdzv = host + ":" + std::to_string(job->rendezvous_port());
    said.push_back("--rdzv " + a.rdzv + " (" + why + "; port 29400 + job id mod 1000)");
  }
  // Only with the derived port, the one two jobs can share by accident: a
  // launcher given --rdzv (a node given back joining the running job from a
  // job of its own, docs/slurm.md) means that store.
  if (!given("--job-name") && !given("--rdzv")) {
    a.job_name = "slurm-" + job->job_id;
    said.push_back("--job-name " + a.job_name + " (SLURM_JOB_ID: the store refuses another job's launchers)");
  }
  bool dir_in_args = false;
  for (size_t i = 0; i + 1 < a.train_args.size(); ++i) dir_in_args = dir_in_args || a.train_args[i] == "--run-dir";
  if (!given("--run-dir") && !dir_in_args) {
    a.run_dir = "runs/slurm-" + job->job_id;
    said.push_back("--run-dir " + a.run_dir + " (SLURM_JOB_ID)");
  }
  std::string dir = a.run_dir;
  for (size_t i = 0; i + 1 < a.train_args.size(); ++i)
    if (a.train_args[i] == "--run-dir") dir = a.train_args[i + 1];
  if (!a.resume && file_exists(dir + "/checkpoint.pt")) {
    // A requeued job (or one started again by hand) goes on from its
    // checkpoint.
    a.resume = true;
    said.push_back("--resume (" + dir + " holds a checkpoint; requeued " + std::to_string(job->restart_count) +
                   " time(s))");
  }
  return said;
}

int run_launch(const LaunchArgs& a) {
  elastic::LaunchOptions lo;
  lo.nproc = a.nproc;
  if (comm::is_etcd_url(a.rdzv)) {
    comm::EtcdOptions eo = comm::parse_etcd_url(a.rdzv, "--rdzv");
    eo.user = a.etcd_user;
    if (!a.etcd_password_file.empty()) {
      eo.password = read_file(a.etcd_password_file);
      while (!eo.password.empty() && (eo.password.back() == '\n' || eo.password.back() == '\r')) eo.password.pop_back();
    }
    eo.ca_file = a.etcd_cacert;
    eo.cert_file = a.etcd_cert;
    eo.key_file = a.etcd_key;
    comm::etcd_from_env(&eo);
    if (!eo.user.empty() && eo.password.empty())
      throw InvalidInput("--etcd-user " + eo.user + " needs --etcd-password-file FILE (or $LIMBO_ETCD_PASSWORD)");
    if (!eo.tls && (!eo.ca_file.empty() || !eo.cert_file.empty()))
      throw InvalidInput("--etcd-cacert/--etcd-cert are for TLS: write the address as etcds://...");
    comm::etcd_to_env(eo);  // workers take the credentials from their environment
    lo.etcd = eo;
  } else {
    std::tie(lo.rdzv_host, lo.rdzv_port) = split_host_port(a.rdzv, "--rdzv");
  }
  lo.train_args = a.train_args;
  if (!lo.train_args.empty() && !lo.train_args[0].empty() && lo.train_args[0][0] != '-') {
    // `limbo launch ... -- python3 train.py ARGS`: the user's program is the
    // workers; the launcher's own flags for them go into their environment.
    lo.program = lo.train_args;
    lo.train_args.clear();
  }
  // launch --resume: every worker continues from the run directory's
  // checkpoint (the same as `-- --resume`); in an elastic job the newest
  // state among the members wins (state sync).
  if (a.resume && std::find(lo.train_args.begin(), lo.train_args.end(), "--resume") == lo.train_args.end())
    lo.train_args.push_back("--resume");
  lo.elastic = a.min_workers > 0 || a.max_workers > 0;
  lo.rendezvous_timeout = std::chrono::milliseconds(static_cast<int64_t>(a.rdzv_timeout * 1000));
  lo.finish_timeout = std::chrono::milliseconds(static_cast<int64_t>(a.finish_timeout * 1000));
  lo.warning_grace = std::chrono::milliseconds(static_cast<int64_t>(a.warning_grace * 1000));
  lo.heartbeat_timeout = std::chrono::milliseconds(static_cast<int64_t>(a.heartbeat_timeout * 1000));
  lo.status = a.status;
  lo.token = a.token;
  lo.job_name = a.job_name;
  // Workers take the secret from their environment (not argv, which `ps` shows).
  if (!a.token.empty()) ::setenv("LIMBO_JOB_TOKEN", a.token.c_str(), 1);
  // One run directory for the whole job (members and the status page):
  // `launch --run-dir D`, or `-- --run-dir D`, or runs/launch-<time>.
  std::string given;
  for (size_t i = 0; i + 1 < lo.train_args.size(); ++i)
    if (lo.train_args[i] == "--run-dir") given = lo.train_args[i + 1];
  if (!a.run_dir.empty() && !given.empty() && given != a.run_dir)
    throw InvalidInput("launch --run-dir " + a.run_dir + " and the training arguments' --run-dir " + given +
                       " differ; give one");
  if (given.empty())
    lo.train_args.insert(lo.train_args.end(),
                         {"--run-dir", a.run_dir.empty() ? train::timestamped_run_dir("launch") : a.run_dir});
  if (!a.elastic_schedule.empty()) lo.schedule = elastic::parse_schedule(a.elastic_schedule);
  if (a.min_workers > 0) lo.min_workers = a.min_workers;
  if (a.max_workers > 0) lo.max_workers = a.max_workers;
  lo.start_workers = a.start_workers;
  if (lo.elastic && lo.start_workers > lo.max_workers)
    throw InvalidInput("--start-workers " + std::to_string(lo.start_workers) + " exceeds --max-workers " +
                       std::to_string(lo.max_workers));
  if (lo.elastic && lo.min_workers > lo.max_workers)
    throw InvalidInput("--min-workers " + std::to_string(lo.min_workers) + " exceeds --max-workers " +
                       std::to_string(lo.max_workers));
  char exe[4096];
  ssize_t n = ::readlink("/proc/self/exe", exe, sizeof exe - 1);
  if (n <= 0) throw Error("cannot find the limbo binary (/proc/self/exe)");
  lo.self_exe.assign(exe, static_cast<size_t>(n));
  if (a.dry_run) {
    std::printf("workers on this host: %d\n", lo.nproc);
    if (lo.elastic)
      std::printf("elastic: min %d, max %d, the first round waits for %d\n", lo.min_workers, lo.max_workers,
                  lo.start_workers > 0 ? lo.start_workers : std::max(lo.nproc, lo.min_workers));
    else
      std::printf("fixed membership\n");
    std::printf("rendezvous: %s\n", lo.etcd ? lo.etcd->url().c_str()
                                             : (lo.rdzv_host + ":" + std::to_string(lo.rdzv_port)).c_str());
    std::string cmd;
    for (const auto& t : lo.program.empty() ? lo.train_args : lo.program) cmd += " " + t;
    if (lo.program.empty()) {
      std::printf("training arguments:%s\n", cmd.c_str());
    } else {
      std::printf("program:%s\n", cmd.c_str());
      std::string flags;
      for (const auto& t : lo.train_args) flags += " " + t;
      std::printf("launcher's arguments (in the program's environment):%s\n", flags.c_str());
    }
    return 0;
  }
  return elastic::launch(lo);
}

int run_config(const TrainArgs& a, bool schema_markdown) {
  if (schema_markdown) {
    std::fputs(train::train_schema()->to_markdown().c_str(), stdout);
    return 0;
  }
  Config cfg = resolve(a);
  train::trainer_config(cfg);  // cross-key validation
  std::fputs(cfg.to_toml().c_str(), stdout);
  return 0;
}

}  // namespace limbo::cli
