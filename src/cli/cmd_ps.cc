// `limbo ps-server`, `limbo worker`, `limbo keygen`, `limbo launch --mode async` and `limbo sim`.
#include <chrono>
#include <cmath>
#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <ctime>

#include "cli/commands.h"
#include "status/server.h"
#include "train/schema.h"
#include "comm/compression.h"
#include "common/error.h"
#include "common/log.h"
#include "ps/launch_async.h"
#include "ps/server.h"
#include "ps/transport.h"
#include "ps/worker.h"
#include "elastic/launcher.h"
#include "sim/async_sim.h"
#include "sim/elastic_sim.h"
#include "train/trainer.h"

namespace limbo::cli {
namespace {

std::atomic<bool> g_stop{false};
void on_stop(int) { g_stop = true; }

std::chrono::milliseconds millis(double seconds) {
  return std::chrono::milliseconds(static_cast<int64_t>(seconds * 1000.0 + 0.5));
}

void install_stop_handlers() {
  struct sigaction sa {};
  sa.sa_handler = on_stop;
  ::sigaction(SIGTERM, &sa, nullptr);
  ::sigaction(SIGINT, &sa, nullptr);
  ::sigaction(SIGUSR1, &sa, nullptr);  // Slurm's warning ahead of preemption or the time limit
}

ps::CurveKeys keys_of(const std::string& file) { return file.empty() ? ps::CurveKeys{} : ps::load_curve_keys(file); }

ps::AggregatorOptions aggregator_options(const Config& c) {
  ps::AggregatorOptions a;
  a.protocol = ps::parse_protocol(c.get_string("ps.protocol"));
  a.softsync_n = static_cast<int>(c.get_int("ps.softsync_n"));
  a.policy = ps::parse_staleness_policy(c.get_string("ps.staleness"));
  a.alpha0 = c.get_float("optim.lr");
  a.max_staleness = c.get_int("ps.max_staleness");
  a.bound_action = ps::parse_bound_action(c.get_string("ps.bound_action"));
  return a;
}

std::vector<std::string> split_commas(const std::string& s) {
  std::vector<std::string> out;
  size_t start = 0;
  while (start <= s.size()) {
    size_t end = s.find(',', start);
    if (end == std::string::npos) end = s.size();
    std::string item = s.substr(start, end - start);
    if (!item.empty()) out.push_back(item.find("://") == std::string::npos ? "tcp://" + item : item);
    start = end + 1;
  }
  return out;
}

void check_async_config(const Config& cfg) {
  const std::string algo = cfg.get_string("optim.algorithm");
  if (algo != "sgd" && algo != "adam" && algo != "adamw")
    throw InvalidInput("asynchronous training supports optim.algorithm = \"sgd\", \"adam\" or \"adamw\", not \"" +
                       algo + "\" (ISGD's extra updates need the whole group's loss on one batch)");
  if (cfg.get_string("optim.schedule") != "constant")
    throw InvalidInput("asynchronous training uses the staleness-dependent rate alpha(tau) from optim.lr; "
                       "set optim.schedule = \"constant\"");
  if (cfg.get_bool("optim.nesterov")) throw InvalidInput("the parameter server applies plain momentum; set optim.nesterov = false");
}

}  // namespace

// ps.part_mb in floats (0 = whole slices).
// none | fp16 | bf16 as the protocol's payload flag (0 = float32).
static uint8_t wire_encoding(const std::string& s) {
  switch (comm::parse_compression(s)) {
    case comm::Compression::Fp16: return ps::kFp16Values;
    case comm::Compression::Bf16: return ps::kBf16Values;
    case comm::Compression::Int8:
    case comm::Compression::Int4:
      throw InvalidInput("comm.compression = \"" + s + "\" is for the data-parallel all-reduce (DiLoCo's outer "
                         "step); the parameter server's pushes take none, fp16 or bf16");
    default: return 0;
  }
}

static int64_t part_floats(const Config& cfg) {
  return static_cast<int64_t>(std::llround(cfg.get_float("ps.part_mb") * (1 << 20) / 4));
}

int run_ps_server(const PsServerArgs& a) {
  Config cfg = train::resolve_config(a.config_file, a.overrides);
  check_async_config(cfg);
  auto tc = train::trainer_config(cfg);
  tc.run_dir.clear();
  tc.train.progress = false;
  train::Trainer trainer(tc);  // same seeded initialisation and dataset as the learners
  ps::ServerOptions so;
  so.shard = a.shard;
  so.shards = a.shards;
  so.bind = a.bind.find("://") == std::string::npos ? "tcp://" + a.bind : a.bind;
  so.dir = a.dir;
  so.resume = a.resume;
  so.agg = aggregator_options(cfg);
  so.optimizer = tc.optimizer;
  so.decay_at_base_rate = cfg.get_string("ps.weight_decay_rate") == "base";
  so.heartbeat_timeout = millis(cfg.get_float("ps.heartbeat_timeout"));
  so.checkpoint_every = cfg.get_int("ps.checkpoint_every");
  so.log_every = cfg.get_int("ps.log_every");
  so.max_payload_bytes = static_cast<uint64_t>(cfg.get_int("ps.max_message_mb")) << 20;
  so.part_floats = part_floats(cfg);
  so.dataset_size = trainer.data().train.size();
  so.batch = tc.loader.batch_size;
  so.epochs = tc.train.epochs;
  auto& flat = trainer.params();
  ps::Server server(so, ps::model_fingerprint(tc.model.name, flat), flat.data().data_ptr<float>(), flat.numel(),
                    keys_of(a.keys_file));
  install_stop_handlers();
  std::unique_ptr<status::Server> page;
  if (!a.status.empty()) {
    auto [host, port] = status::parse_address(a.status, "--status");
    page = std::make_unique<status::Server>(std::make_shared<status::Board>("ps-server"), host, port);
    page->watch(a.dir + "/metrics.jsonl");
    page->write_url(a.dir);
    log_info("status page: " + page->url());
  }
  server.run(g_stop);
  return kExitOk;
}

int run_worker_cmd(const WorkerArgs& a) {
  Config cfg = train::resolve_config(a.config_file, a.overrides);
  check_async_config(cfg);
  auto tc = train::trainer_config(cfg);
  tc.run_dir.clear();
  train::Trainer trainer(tc);
  ps::WorkerOptions wo;
  wo.servers = split_commas(a.servers);
  if (wo.servers.empty()) throw InvalidInput("--servers needs at least one HOST:PORT");
  wo.learner_id = a.learner_id >= 0 ? static_cast<uint32_t>(a.learner_id)
                                    : static_cast<uint32_t>((::getpid() * 2654435761u) ^ std::time(nullptr)) | 0x80000000u;
  wo.request_timeout = millis(cfg.get_float("ps.request_timeout"));
  wo.heartbeat_interval = millis(std::min(0.5, cfg.get_float("ps.heartbeat_timeout") / 4));
  wo.log_every = cfg.get_int("train.log_every");
  wo.run_dir = a.run_dir;
  wo.max_steps = tc.train.max_steps;
  wo.finish_only = a.finish_only;
  wo.part_floats = part_floats(cfg);
  wo.push_encoding = wire_encoding(cfg.get_string("comm.compression"));
  wo.pull_encoding = wire_encoding(cfg.get_string("ps.pull_compression"));
  install_stop_handlers();
  auto summary = ps::run_worker(trainer, tc, wo, keys_of(a.keys_file), g_stop);
  std::printf("learner %u: %lld steps, %.0f samples/s\n", wo.learner_id,
              static_cast<long long>(summary["steps"].get<int64_t>()), summary["samples_per_second"].get<double>());
  if (summary.contains("test_loss")) std::printf("%s\n", test_result(summary).c_str());
  return kExitOk;
}

int run_keygen(const std::string& out) {
  if (out.empty()) throw InvalidInput("keygen needs --out FILE");
  auto k = ps::generate_curve_keys();
  ps::save_curve_keys(out, k);
  std::printf("wrote a CURVE key pair to %s (give the same file to every shard and learner of the job)\n", out.c_str());
  return kExitOk;
}

int run_sim(const SimArgs& a) {
  Config cfg = train::resolve_config(a.config_file, a.overrides);
  const bool elastic = cfg.get_string("sim.mode") == "elastic";
  if (elastic && cfg.get_string("optim.algorithm") == "isgd")
    throw InvalidInput("the elastic simulation supports optim.algorithm = \"sgd\", \"adam\" or \"adamw\", not \"isgd\"");
  if (!elastic) check_async_config(cfg);
  auto tc = train::trainer_config(cfg);
  tc.run_dir.clear();
  tc.train.progress = false;
  train::Trainer trainer(tc);
  const std::string run_dir = a.run_dir.empty() ? train::timestamped_run_dir("sim") : a.run_dir;
  if (elastic) {
    sim::ElasticSimOptions eo;
    eo.schedule = elastic::parse_schedule(cfg.get_string("sim.elastic_schedule"));
    eo.run_dir = run_dir;
    eo.log_every = cfg.get_int("train.log_every");
    auto s = sim::run_elastic_sim(trainer, tc, eo);
    std::printf("run directory: %s\n", run_dir.c_str());
    std::printf("elastic simulation (%s policy): %lld steps, %lld membership changes, %s; "
                "simulation overhead %.1f%% beyond gradient computation\n",
                s["batch_policy"].get<std::string>().c_str(), static_cast<long long>(s["steps"].get<int64_t>()),
                static_cast<long long>(s["membership_changes"].get<int64_t>()), test_result(s).c_str(),
                100 * s["overhead_fraction"].get<double>());
    return kExitOk;
  }
  sim::AsyncSimOptions so;
  so.learners = static_cast<int>(cfg.get_int("sim.learners"));
  so.agg = aggregator_options(cfg);
  so.update = {so.agg.alpha0, tc.optimizer, cfg.get_string("ps.weight_decay_rate") == "base"};
  so.compute.kind = sim::parse_compute_kind(cfg.get_string("sim.compute"));
  so.compute.mean = cfg.get_float("sim.compute_mean");
  so.compute.cv = cfg.get_float("sim.compute_cv");
  so.compute.straggler_fraction = cfg.get_float("sim.straggler_fraction");
  so.compute.straggler_factor = cfg.get_float("sim.straggler_factor");
  so.net_delay = cfg.get_float("sim.net_delay");
  so.cores = static_cast<int>(cfg.get_int("sim.cores"));
  so.seed = static_cast<uint64_t>(cfg.get_int("train.seed"));
  so.log_every = cfg.get_int("ps.log_every");
  so.run_dir = run_dir;
  auto s = sim::run_async_sim(trainer, tc, so);
  std::printf("run directory: %s\n", so.run_dir.c_str());
  std::printf("%d virtual learners, %s: %lld updates, staleness mean %.2f (p99 %lld, max %lld), "
              "%s\n", so.learners, s["protocol"].get<std::string>().c_str(),
              static_cast<long long>(s["updates"].get<int64_t>()), s["staleness_mean"].get<double>(),
              static_cast<long long>(s["staleness_p99"].get<int64_t>()),
              static_cast<long long>(s["staleness_max"].get<int64_t>()), test_result(s).c_str());
  std::printf("%.1f virtual s in %.1f s wall; simulation overhead %.1f%% beyond gradient computation\n",
              s["virtual_seconds"].get<double>(), s["wall_seconds"].get<double>(),
              100 * s["overhead_fraction"].get<double>());
  return kExitOk;
}

int run_launch_async(const LaunchArgs& a) {
  if (!a.token_file.empty())
    throw InvalidInput("--token-file guards the rendezvous store of a data-parallel job; a parameter-server job "
                       "is secured with CURVE keys: --keys FILE from `limbo keygen`");
  ps::AsyncLaunchOptions o;
  o.servers = a.servers;
  o.workers = a.workers;
  o.protocol = a.protocol;
  o.softsync_n = a.softsync_n;
  o.train_args = a.train_args;
  o.keys_file = a.keys_file;
  o.run_dir = a.run_dir;
  o.resume = a.resume;
  if (a.resume && a.run_dir.empty()) throw InvalidInput("launch --mode async --resume needs the job's --run-dir");
  if (o.run_dir.empty()) o.run_dir = train::timestamped_run_dir("async");
  o.status = a.status;
  if (a.protocol != "hardsync" && a.protocol != "softsync")
    throw InvalidInput("--protocol must be hardsync or softsync, got '" + a.protocol + "'");
  // Validate the arguments once here, before any process starts.
  std::string config_file;
  std::vector<std::string> overrides;
  for (size_t i = 0; i < a.train_args.size(); ++i) {
    if (a.train_args[i] == "--config" && i + 1 < a.train_args.size()) config_file = a.train_args[++i];
    else if (a.train_args[i] == "--set" && i + 1 < a.train_args.size()) overrides.push_back(a.train_args[++i]);
    else throw InvalidInput("launch --mode async passes only --config FILE and --set KEY=VALUE to its processes; got '" +
                            a.train_args[i] + "'");
  }
  overrides.push_back("ps.protocol=" + a.protocol);
  if (a.softsync_n > 0) overrides.push_back("ps.softsync_n=" + std::to_string(a.softsync_n));
  Config cfg = train::resolve_config(config_file, overrides);
  check_async_config(cfg);
  train::trainer_config(cfg);
  if (!a.keys_file.empty()) ps::load_curve_keys(a.keys_file);
  char exe[4096];
  ssize_t n = ::readlink("/proc/self/exe", exe, sizeof exe - 1);
  if (n <= 0) throw Error("cannot find the limbo binary (/proc/self/exe)");
  o.self_exe.assign(exe, static_cast<size_t>(n));
  return ps::launch_async(o);
}

}  // namespace limbo::cli
