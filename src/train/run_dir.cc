#include "train/run_dir.h"

#include "common/error.h"
#include "common/files.h"

#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <fstream>

#include <cstdio>
#include <random>

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
  if (mirror_) mirror_(record);
  if (!enabled()) return;
  append_line(metrics_, record.dump());
}

int64_t RunDir::storage_id() const {
  if (path_.empty()) return 0;
  // Named by the directory's inode: a copy of the directory (cp -a, rsync)
  // carries the file but not the inode, so it gets an id of its own, while
  // hosts sharing the directory over a network file system see one inode.
  struct stat dir {};
  if (::stat(path_.c_str(), &dir) != 0)
    throw Error("cannot read the run directory '" + path_ + "': " + std::strerror(errno));
  const std::string file = path_ + "/.storage-" + std::to_string(static_cast<uint64_t>(dir.st_ino));
  if (!file_exists(file)) {
    std::random_device rd;
    const int64_t id = ((static_cast<int64_t>(rd()) << 32 | rd()) & ((int64_t{1} << 52) - 1)) | 1;
    const std::string tmp = file + "." + std::to_string(::getpid()) + "." + std::to_string(id);
    write_file_atomic(tmp, std::to_string(id) + "\n");
    const bool linked = ::link(tmp.c_str(), file.c_str()) == 0;
    const int err = errno;
    std::remove(tmp.c_str());
    if (!linked && err != EEXIST)
      throw Error("cannot create '" + file + "': " + std::strerror(err));
  }
  const std::string text = read_file(file);
  try {
    const int64_t id = std::stoll(text);
    if (id > 0) return id;
  } catch (const std::exception&) {
  }
  throw InvalidInput("'" + file + "' does not hold a storage id ('" + text +
                     "'); remove it and Limbo makes a new one");
}

std::string RunDir::read_metrics() const {
  return path_.empty() || !file_exists(metrics_) ? std::string() : read_file(metrics_);
}

int64_t RunDir::record_count() const {
  const std::string text = read_metrics();
  return static_cast<int64_t>(std::count(text.begin(), text.end(), '\n'));
}

void RunDir::replace_records(const std::string& records) {
  if (!enabled() || records.empty()) return;
  write_file_atomic(metrics_, records.back() == '\n' ? records : records + "\n");
}

void RunDir::write_summary(const nlohmann::json& summary) const {
  if (enabled()) write_file_atomic(path_ + "/summary.json", summary.dump(2) + "\n");
}

void log_committed_batch(const std::string& run_dir, int64_t step, const data::BatchPlan& plan,
                         const std::vector<int64_t>& epoch_order, int world) {
  const std::string pid = std::to_string(::getpid());
  std::string line = std::to_string(step) + " " + std::to_string(plan.begin.epoch);
  for (int64_t i = 0; i < plan.global_size; ++i) line += " " + std::to_string(epoch_order[plan.begin.position + i]);
  std::ofstream(run_dir + "/samples-" + pid + ".txt", std::ios::app) << line << "\n";
  std::string mine = std::to_string(step) + " " + std::to_string(plan.begin.epoch) + " " + std::to_string(world);
  if (!plan.padded)
    for (int64_t id : plan.ids) mine += " " + std::to_string(id);
  std::ofstream(run_dir + "/slices-" + pid + ".txt", std::ios::app) << mine << "\n";
}

namespace {
void log_ids(const std::string& path, int64_t step, int64_t epoch, const std::vector<int64_t>& ids) {
  std::string line = std::to_string(step) + " " + std::to_string(epoch);
  for (int64_t id : ids) line += " " + std::to_string(id);
  std::ofstream(path, std::ios::app) << line << "\n";
}
}  // namespace

void log_committed_ids(const std::string& run_dir, int64_t step, int64_t epoch, const std::vector<int64_t>& ids) {
  log_ids(run_dir + "/samples-" + std::to_string(::getpid()) + ".txt", step, epoch, ids);
}

void log_trained_ids(const std::string& run_dir, int64_t step, int64_t epoch, const std::vector<int64_t>& ids) {
  log_ids(run_dir + "/trained-" + std::to_string(::getpid()) + ".txt", step, epoch, ids);
}

}  // namespace limbo::train
