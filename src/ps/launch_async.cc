#include "ps/launch_async.h"

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <map>
#include <filesystem>
#include <thread>

#include "common/error.h"
#include "common/files.h"
#include "common/log.h"
#include "common/process.h"
#include "ps/staleness.h"
#include "status/server.h"

namespace limbo::ps {
namespace {

using json = nlohmann::json;
using Clock = std::chrono::steady_clock;

json read_json(const std::string& path) {
  if (!file_exists(path)) return json();
  try {
    return json::parse(read_file(path));
  } catch (const std::exception&) {
    return json();
  }
}

struct Shard {
  int index;
  std::string dir, endpoint;
  pid_t pid = -1;
  int restarts = 0;
};

constexpr std::chrono::seconds kShardGrace{10};  // a shard checkpoints when it gets SIGTERM

class AsyncJob {
 public:
  explicit AsyncJob(const AsyncLaunchOptions& o) : opt_(o) {}

  int run() {
    if (opt_.servers < 1 || opt_.workers < 1) throw InvalidInput("--servers and --workers must be >= 1");
    if (opt_.run_dir.empty()) throw InvalidInput("launch --mode async needs --run-dir");
    make_dirs(opt_.run_dir);
    common_ = opt_.train_args;
    common_.insert(common_.end(), {"--set", "ps.protocol=" + opt_.protocol});
    if (opt_.softsync_n > 0) common_.insert(common_.end(), {"--set", "ps.softsync_n=" + std::to_string(opt_.softsync_n)});
    if (!opt_.keys_file.empty()) common_.insert(common_.end(), {"--keys", opt_.keys_file});
    worker_threads_ = threads_per_worker(opt_.train_args, opt_.cores, opt_.workers);

    for (int k = 0; k < opt_.servers; ++k) {
      Shard s;
      s.index = k;
      s.dir = opt_.run_dir + "/shard-" + std::to_string(k);
      make_dirs(s.dir);
      shards_.push_back(s);
    }
    if (opt_.resume && !file_exists(shards_[0].dir + "/checkpoint.bin"))
      throw InvalidInput("--resume: no shard checkpoint in '" + shards_[0].dir + "'");
    if (!opt_.status.empty()) {
      auto [host, port] = status::parse_address(opt_.status, "--status");
      page_ = std::make_unique<status::Server>(std::make_shared<status::Board>("async"), host, port);
      for (const auto& s : shards_) page_->watch(s.dir + "/metrics.jsonl");
      page_->watch_dir(opt_.run_dir + "/learners", ".jsonl");
      page_->write_url(opt_.run_dir);
      log_info("launch: status page at " + page_->url());
    }
    for (auto& s : shards_) start_shard(s, opt_.resume);
    std::vector<std::string> endpoints;
    for (auto& s : shards_) endpoints.push_back(wait_endpoint(s));
    std::string servers;
    for (const auto& e : endpoints) servers += (servers.empty() ? "" : ",") + e;
    log_info("launch: " + std::to_string(opt_.servers) + " shard(s) at " + servers + "; starting " +
             std::to_string(opt_.workers) + " learner(s)");
    auto t0 = Clock::now();
    const auto t_start = std::filesystem::file_time_type::clock::now();
    for (int i = 0; i < opt_.workers; ++i) {
      std::vector<std::string> a = {"worker", "--servers", servers, "--learner-id", std::to_string(i),
                                    "--run-dir", opt_.run_dir};
      if (worker_threads_ > 0) a.insert(a.end(), {"--set", "train.threads=" + std::to_string(worker_threads_)});
      if (i > 0) a.insert(a.end(), {"--set", "train.progress=false"});
      a.insert(a.end(), common_.begin(), common_.end());
      sup_.start(opt_.self_exe, a, "learner", i);
    }
    if (page_) page_->board().member_event(opt_.workers, "start", std::to_string(opt_.workers) + " learners");
    int finished_ok = 0, failed = 0, first_failure = 0;
    while (sup_.count("learner") > 0) {
      if (sup_.take_signal()) {
        // Learners take SIGTERM as "finish the step and leave".
        log_warn("launch: signal received, asking the learners to leave");
        sup_.begin_stop(SIGTERM, opt_.stop_grace, "learner");
      }
      auto ex = sup_.poll();
      if (!ex) {
        std::this_thread::sleep_for(std::chrono::milliseconds(20));
        continue;
      }
      const int status = ex->status;
      if (ex->role == "learner") {
        if (page_)
          page_->board().member_event(static_cast<int>(sup_.count("learner")), ex->code() == 0 ? "leave" : "crash",
                                      "learner " + std::to_string(ex->index) + ": " + describe_status(status));
        if (ex->code() == 0) {
          finished_ok += 1;
        } else {
          failed += 1;
          if (!first_failure) first_failure = ex->code();
          log_warn("launch: learner " + std::to_string(ex->index) + " failed (" + describe_status(status) +
                   "); the others go on");
        }
        continue;
      }
      for (auto& s : shards_) {
        if (s.pid != ex->pid) continue;
        s.pid = -1;
        if (s.restarts >= opt_.max_server_restarts) {
          log_warn("launch: shard " + std::to_string(s.index) + " failed (" + describe_status(status) + ") and was restarted " +
                   std::to_string(s.restarts) + " times already; stopping the job");
          stop_all();
          return exit_code_of(status) ? exit_code_of(status) : kExitFailure;
        }
        s.restarts += 1;
        log_warn("launch: shard " + std::to_string(s.index) + " failed (" + describe_status(status) +
                 "); restarting it from its checkpoint on " + s.endpoint);
        start_shard(s, true);
        wait_endpoint(s);
      }
    }
    // The finisher (the first learner told the data is done) takes the
    // final weights and writes final.json and checkpoint.pt. When it died
    // before that, another process takes them from the shards, which still
    // hold them.
    if (finished_ok > 0 && !final_written(t_start) && !sup_.first_signal()) {
      log_warn("launch: no learner wrote the final weights (the finisher died while the job ended, or the "
               "learners stopped before the data was done); a new process takes them from the shards");
      std::vector<std::string> a = {"worker", "--servers", servers, "--learner-id", std::to_string(opt_.workers),
                                    "--run-dir", opt_.run_dir, "--finish-only", "--set", "train.progress=false"};
      a.insert(a.end(), common_.begin(), common_.end());
      sup_.start(opt_.self_exe, a, "finisher", opt_.workers);
      while (sup_.count("finisher") > 0) {
        if (auto ex = sup_.poll()) {
          if (ex->role == "finisher" && ex->code() != 0)
            log_warn("launch: the process taking the final weights failed (" + describe_status(ex->status) + ")");
          continue;
        }
        std::this_thread::sleep_for(std::chrono::milliseconds(20));
      }
    }
    const double wall = std::chrono::duration<double>(Clock::now() - t0).count();
    stop_shards();
    write_summary(wall, finished_ok, failed);
    if (sup_.first_signal() == SIGUSR1) {
      log_warn("launch: exit code " + std::to_string(kExitPreempted) +
               ": stopped by SIGUSR1 (ahead of preemption or the time limit); requeue the job, or run it again "
               "with --resume");
      return kExitPreempted;
    }
    if (const int sig = sup_.first_signal()) {
      log_warn("launch: exit code " + std::to_string(128 + sig) + ": stopped by signal " + std::to_string(sig) +
               " (resume with --resume)");
      return 128 + sig;
    }
    if (finished_ok == 0) {
      log_warn("launch: exit code " + std::to_string(first_failure ? first_failure : kExitFailure) +
               ": every learner failed");
      return first_failure ? first_failure : kExitFailure;
    }
    if (!final_written(t_start)) {
      log_warn("launch: exit code " + std::to_string(kExitFailure) + ": training completed, but " + opt_.run_dir +
               " has no final weights (final.json, checkpoint.pt); the shards' checkpoints hold them (--resume)");
      return kExitFailure;
    }
    return kExitOk;
  }

 private:
  // final.json and checkpoint.pt written since `since` (not an earlier run's).
  bool final_written(std::filesystem::file_time_type since) const {
    std::error_code ec;
    for (const char* f : {"/final.json", "/checkpoint.pt"}) {
      const auto t = std::filesystem::last_write_time(opt_.run_dir + f, ec);
      if (ec || t + std::chrono::seconds(1) < since) return false;
    }
    return true;
  }

  void start_shard(Shard& s, bool resume) {
    ::unlink((s.dir + "/endpoint").c_str());
    std::vector<std::string> a = {"ps-server", "--shard", std::to_string(s.index), "--shards",
                                  std::to_string(opt_.servers), "--dir", s.dir,
                                  "--bind", s.endpoint.empty() ? "tcp://127.0.0.1:*" : s.endpoint,
                                  "--set", "train.threads=1"};
    if (resume) a.push_back("--resume");
    a.insert(a.end(), common_.begin(), common_.end());
    s.pid = sup_.start(opt_.self_exe, a, "shard", s.index);
  }

  std::string wait_endpoint(Shard& s) {
    auto t0 = Clock::now();
    const std::string path = s.dir + "/endpoint";
    while (!file_exists(path)) {
      if (auto ex = sup_.poll(s.pid)) {
        const int status = ex->status;
        s.pid = -1;
        stop_all();
        throw InvalidInput("shard " + std::to_string(s.index) + " exited before serving (" + describe_status(status) +
                           "); see its messages above");
      }
      if (Clock::now() - t0 > opt_.start_timeout) {
        stop_all();
        throw Timeout("shard " + std::to_string(s.index) + " did not publish its endpoint within " +
                      std::to_string(opt_.start_timeout.count() / 1000.0) + " s");
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    std::string e = read_file(path);
    while (!e.empty() && (e.back() == '\n' || e.back() == ' ')) e.pop_back();
    s.endpoint = e;
    return e;
  }

  // SIGTERM: each shard writes its checkpoint and summary, then exits.
  void stop_shards() {
    sup_.stop(SIGTERM, kShardGrace, "shard");
    for (auto& s : shards_) s.pid = -1;
  }

  void stop_all() {
    sup_.stop(SIGKILL, std::chrono::milliseconds(0), "learner");
    stop_shards();
  }

  void write_summary(double wall, int ok, int failed) {
    json s = {{"mode", "async"}, {"servers", opt_.servers}, {"workers", opt_.workers}, {"protocol", opt_.protocol},
              {"learners_finished", ok}, {"learners_failed", failed}, {"wall_seconds", wall}};
    StalenessHist hist;
    int64_t rejected = 0;
    json shards = json::array();
    for (const auto& sh : shards_) {
      json j = read_json(sh.dir + "/summary.json");
      if (j.is_null()) continue;
      if (sh.index == 0) {
        s["updates"] = j["updates"];
        s["gradients_dropped"] = j["gradients_dropped"];
        s["gradients_accepted"] = j["gradients_accepted"];
        s["softsync_n"] = j["softsync_n"];
        s["staleness_policy"] = j["staleness_policy"];
      }
      rejected += j.value("gradients_rejected", int64_t{0});
      add_hist_json(hist, j["staleness_hist"]);
      shards.push_back({{"shard", sh.index}, {"updates", j["updates"]}, {"staleness_mean", j["staleness_mean"]},
                        {"staleness_max", j["staleness_max"]}, {"busy_fraction", j["busy_fraction"]},
                        {"gradients_dropped", j["gradients_dropped"]}, {"gradients_rejected", j["gradients_rejected"]},
                        {"restarts", sh.restarts}});
    }
    const StalenessStats st = staleness_stats(hist);
    s["staleness_mean"] = st.mean;
    s["staleness_p99"] = st.p99;
    s["staleness_max"] = st.max;
    s["staleness_hist"] = hist_to_json(hist);
    s["gradients_rejected"] = rejected;
    s["shards"] = shards;
    json learners = json::array();
    double total_rate = 0;
    for (int i = 0; i < opt_.workers; ++i) {
      json j = read_json(opt_.run_dir + "/learners/" + std::to_string(i) + ".summary.json");
      if (j.is_null()) continue;
      total_rate += j.value("samples_per_second", 0.0);
      learners.push_back({{"learner", i}, {"steps", j["steps"]}, {"samples_per_second", j["samples_per_second"]},
                          {"compute_seconds_per_step", j.value("compute_seconds_per_step", 0.0)},
                          {"compute_cv", j.value("compute_cv", 0.0)}, {"wait_cv", j.value("wait_cv", 0.0)},
                          {"wait_seconds_per_step", j.value("wait_seconds_per_step", 0.0)}});
    }
    s["learners"] = learners;
    s["samples_per_second"] = total_rate;
    json fin = read_json(opt_.run_dir + "/final.json");
    if (!fin.is_null()) {
      for (const char* k : {"test_accuracy", "test_loss", "test_perplexity"})
        if (fin.contains(k)) s[k] = fin[k];
    }
    write_file_atomic(opt_.run_dir + "/summary.json", s.dump(2) + "\n");
    char buf[256];
    std::snprintf(buf, sizeof buf, "launch: done in %.1f s; test accuracy %s; staleness mean %.2f, p99 %ld, max %ld",
                  wall, fin.is_object() && fin.value("test_accuracy", json()).is_number() ? std::to_string(100 * fin["test_accuracy"].get<double>()).c_str() : "n/a",
                  st.mean, static_cast<long>(st.p99), static_cast<long>(st.max));
    log_info(buf);
  }

  AsyncLaunchOptions opt_;
  std::vector<std::string> common_;
  int worker_threads_ = 0;
  std::vector<Shard> shards_;
  std::unique_ptr<status::Server> page_;
  Supervisor sup_;  // declared last: destroyed first, killing what still runs
};

}  // namespace

int launch_async(const AsyncLaunchOptions& opt) { return AsyncJob(opt).run(); }

}  // namespace limbo::ps
