// The run directory: what a training run leaves for people and tools.
//
//   config.toml      the resolved configuration (every key)
//   metrics.jsonl    one JSON object per logged step or evaluation
//   summary.json     written at the end (atomically)
//   checkpoint.pt    the latest checkpoint (see checkpoint.h)
// metrics.jsonl is appended to on --resume, so a resumed run's history is
// continuous. Lines are written whole as they come (a failed append throws
// and leaves no partial line).
#pragma once

#include <nlohmann/json.hpp>

#include <fstream>
#include <functional>
#include <string>

namespace limbo::train {

class RunDir {
 public:
  // Creates the directory. An empty path disables all output.
  RunDir(std::string path, bool append_metrics);
  bool enabled() const { return !path_.empty() && writer_; }
  // In elastic jobs only the current rank 0 writes; others keep quiet.
  void set_writer(bool w) { writer_ = w; }
  const std::string& path() const { return path_; }
  std::string checkpoint_path() const { return path_ + "/checkpoint.pt"; }

  void write_config(const std::string& toml) const;
  void append_metrics(const nlohmann::json& record);
  // Also hands each record the writer appends to `mirror` (an elastic job
  // publishes them in its rendezvous, for every launcher's status page).
  void set_mirror(std::function<void(const nlohmann::json&)> mirror) { mirror_ = std::move(mirror); }
  void write_summary(const nlohmann::json& summary) const;

 private:
  std::string path_;
  std::string metrics_;
  bool writer_ = true;
  std::function<void(const nlohmann::json&)> mirror_;
};

}  // namespace limbo::train
