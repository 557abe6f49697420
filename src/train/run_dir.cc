#include "train/run_dir.h"

#include "common/error.h"
#include "common/files.h"

namespace limbo::train {

RunDir::RunDir(std::string path, bool append_metrics) : path_(std::move(path)) {
  if (path_.empty()) return;
  make_dirs(path_);
  metrics_ = path_ + "/metrics.jsonl";
  std::ofstream f(metrics_, append_metrics ? std::ios::app : std::ios::trunc);
  if (!f) throw Error("cannot open '" + metrics_ + "' for writing");
}

void RunDir::write_config(const std::string& toml) const {
  if (enabled()) write_file_atomic(path_ + "/config.toml", toml);
}

void RunDir::append_metrics(const nlohmann::json& record) {
  if (writer_ && mirror_) mirror_(record);
  if (!enabled()) return;
  append_line(metrics_, record.dump());
}

void RunDir::write_summary(const nlohmann::json& summary) const {
  if (enabled()) write_file_atomic(path_ + "/summary.json", summary.dump(2) + "\n");
}

}  // namespace limbo::train
