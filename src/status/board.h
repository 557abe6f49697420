// What a job's status page shows: the live state of one job, fed from its
// metrics.jsonl records (the same lines `limbo plot` reads) and, for elastic
// jobs, from the launcher's membership decisions. Thread-safe: the status
// server's threads read it while the tailer and the launcher write it.
//
// snapshot() is /status.json (schema in docs/status.md); prometheus() is
// /metrics in Prometheus's text exposition format (version 0.0.4).
#pragma once

#include <nlohmann/json.hpp>

#include <chrono>
#include <cstdint>
#include <deque>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

namespace limbo::status {

class Board {
 public:
  // `job`: "train", "elastic", "sync", "async" or "ps-server".
  explicit Board(std::string job);

  // One metrics record (kinds: train, eval, membership, isgd_epoch,
  // ps_updates, learner, outer); other kinds are ignored.
  void add_record(const nlohmann::json& r);
  // The launcher's view of membership: the member count after an event
  // ("start", "join", "leave", "crash", "hang", "change"), with its detail.
  // Once called, membership records in the metrics are ignored.
  void member_event(int members, const std::string& kind, const std::string& detail);

  nlohmann::json snapshot() const;
  std::string prometheus() const;

  static constexpr size_t kMaxPoints = 600;  // per series; older points are thinned out
  static constexpr size_t kMaxEvents = 200;

 private:
  double now() const;
  void push_point();  // appends the current values to the series (lock held)

  const std::string job_;
  const std::chrono::steady_clock::time_point start_;
  mutable std::mutex mu_;
  bool launcher_members_ = false;
  int members_ = 0;
  int64_t step_ = 0, samples_total_ = 0, skipped_steps_ = 0;
  double epoch_ = 0;
  std::optional<double> samples_per_second_, loss_, lr_, lr_multiplier_, test_accuracy_, test_loss_, test_perplexity_,
      grad_norm_;
  // Shares of the batch by pace (elastic.shares = "pace"): each member's
  // share of the global batch and its pace (samples/s of its own forward
  // and backward), by rank, from the newest train record that has them.
  nlohmann::json shares_, paces_;
  std::optional<int64_t> batch_size_;
  std::map<std::string, int64_t> changes_;  // membership changes by kind
  nlohmann::json series_;                   // {"t": [...], "members": [...], ...}
  nlohmann::json accuracy_;                 // {"t": [...], "test_accuracy": [...]}
  std::deque<nlohmann::json> events_;
  // DiLoCo (outer records)
  bool diloco_ = false;
  int64_t outer_steps_ = 0, payload_total_ = 0, owed_ = 0;
  std::optional<double> pseudo_norm_, compute_share_;
  // ISGD
  bool isgd_ = false;
  int64_t isgd_triggers_ = 0, isgd_extra_ = 0;
  // Parameter server
  bool ps_ = false;
  std::map<int64_t, int64_t> staleness_;  // tau -> gradients
  struct Shard {
    double updates_per_second = 0, busy_fraction = 0;
    int64_t clock = 0, accepted = 0, dropped = 0, rejected = 0, learners = 0;
  };
  std::map<int64_t, Shard> shards_;
  struct Learner {
    int64_t steps = 0, samples = 0;
    double samples_per_second = 0, loss = 0, staleness_mean = 0;
  };
  std::map<int64_t, Learner> learners_;
};

// Reads the records appended to a metrics.jsonl file since the last call
// (complete lines only; a file that does not exist yet reads as empty; a
// malformed line is skipped).
class Tail {
 public:
  explicit Tail(std::string path) : path_(std::move(path)) {}
  std::vector<nlohmann::json> read();
  const std::string& path() const { return path_; }

 private:
  std::string path_;
  int64_t offset_ = 0;
};

}  // namespace limbo::status
