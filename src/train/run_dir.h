// The run directory: what a training run leaves for people and tools.
//
//   config.toml      the resolved configuration (every key)
//   metrics.jsonl    one JSON object per logged step or evaluation
//   summary.json     written at the end (atomically)
//   checkpoint.pt    the latest checkpoint (see checkpoint.h)
//   status.url       the job's status pages, one URL per line (newest last)
//   .storage-<inode> an id naming the storage this directory is on (below)
// metrics.jsonl is appended to on --resume, so a resumed run's history is
// continuous. Lines are written whole as they come (a failed append throws
// and leaves no partial line).
#pragma once

#include <nlohmann/json.hpp>

#include <vector>

#include "data/sampler.h"

#include <fstream>
#include <functional>
#include <string>

namespace limbo::train {

// Testing aid (train.sample_log): every member appends the global batch of
// each step it commits to RUN_DIR/samples-PID.txt ("step epoch id id ...";
// a step may commit on several members, readers de-duplicate by step) and
// its own slice to slices-PID.txt ("step epoch world id id ...").
void log_committed_batch(const std::string& run_dir, int64_t step, const data::BatchPlan& plan,
                         const std::vector<int64_t>& epoch_order, int world);
// The same for DiLoCo's outer step: the sample ids it committed (in plan
// order) to samples-PID.txt as "step epoch id id ...".
void log_committed_ids(const std::string& run_dir, int64_t step, int64_t epoch, const std::vector<int64_t>& ids);
// And the ids this member's inner steps trained for that outer step (those
// run ahead and kept included) to trained-PID.txt, in the same form.
void log_trained_ids(const std::string& run_dir, int64_t step, int64_t epoch, const std::vector<int64_t>& ids);

class RunDir {
 public:
  // Creates the directory. An empty path disables all output.
  RunDir(std::string path, bool append_metrics);
  bool enabled() const { return !path_.empty() && writer_; }
  // In elastic jobs one member per storage writes (elastic_membership.h);
  // others keep quiet.
  void set_writer(bool w) { writer_ = w; }
  // One id for every process that opens this directory: processes on one
  // machine, or on hosts that share the file system it is on, read the
  // same id; a directory on another host's own disk gets another. Made
  // once (atomically: the first process to link it in wins). 0 when the
  // run directory is disabled. A positive integer below 2^52.
  int64_t storage_id() const;
  const std::string& path() const { return path_; }
  std::string checkpoint_path() const { return path_ + "/checkpoint.pt"; }

  void write_config(const std::string& toml) const;
  // The metrics written so far ("" when none or disabled); `records`
  // (whole lines; "" changes nothing) replaces them, atomically.
  std::string read_metrics() const;
  int64_t record_count() const;  // lines of metrics.jsonl (0 when none)
  void replace_records(const std::string& records);
  void append_metrics(const nlohmann::json& record);
  // Also hands each record appended to `mirror`, writer or not (an elastic
  // job's rank 0 publishes them in its rendezvous, for every launcher's
  // status page). Empty: none.
  void set_mirror(std::function<void(const nlohmann::json&)> mirror) { mirror_ = std::move(mirror); }
  void write_summary(const nlohmann::json& summary) const;

 private:
  std::string path_;
  std::string metrics_;
  bool writer_ = true;
  std::function<void(const nlohmann::json&)> mirror_;
};

}  // namespace limbo::train
