// The models and data sets a user brings, written once per build tree by
// tests/python/make_fixtures.py with PyTorch for Python (as a user would
// write them), and the --set arguments of a job on them. Shared by the
// tests that train users' modules with the real `limbo` binary; without
// python3-torch they skip with a message.
#pragma once

#include <gtest/gtest.h>
#include <fcntl.h>
#include <sys/file.h>
#include <unistd.h>

#include <nlohmann/json.hpp>

#include <filesystem>
#include <string>
#include <vector>

#include "common/files.h"
#include "test_util.h"

namespace {

using json = nlohmann::json;
using limbo::file_exists;
using limbo::testing::run_limbo;
using limbo::testing::slurp;
using limbo::testing::TempDir;

const char* kPython = "/usr/bin/python3";

// Fixtures shared by every test (ctest runs each test in its own process):
// written once into the build tree under a file lock, rewritten when
// make_fixtures.py changes.
class Fixtures {
 public:
  static const Fixtures& get() {
    static Fixtures f;
    return f;
  }
  bool ok() const { return ok_; }
  const std::string& why() const { return why_; }
  std::string operator()(const std::string& name) const { return dir_ + "/" + name; }

 private:
  Fixtures() {
    if (!file_exists("/usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz")) {
      why_ = "dataset-fashion-mnist is not installed";
      return;
    }
    if (!file_exists(kPython)) {
      why_ = "/usr/bin/python3 is not installed";
      return;
    }
    const std::string script = std::string(LIMBO_SOURCE_DIR) + "/tests/python/make_fixtures.py";
    std::filesystem::create_directories(dir_);
    int lock = ::open((dir_ + ".lock").c_str(), O_CREAT | O_RDWR | O_CLOEXEC, 0644);
    if (lock >= 0) ::flock(lock, LOCK_EX);
    const std::string stamp = dir_ + "/done";
    std::error_code ec;
    ok_ = file_exists(stamp) &&
          std::filesystem::last_write_time(stamp, ec) >= std::filesystem::last_write_time(script, ec);
    if (!ok_) {
      const std::string log = dir_ + "/fixtures.log";
      pid_t pid = limbo::testing::spawn_process({kPython, script, dir_}, log);
      auto r = limbo::testing::wait_child(pid, log);
      ok_ = r.exit_code == 0;
      if (ok_) limbo::testing::write_bytes(stamp, "", false);
      else why_ = "make_fixtures.py failed (python3-torch and python3-numpy needed): " + r.output;
    }
    if (lock >= 0) ::close(lock);  // releases the lock
  }
  std::string dir_ = LIMBO_FIXTURE_DIR;
  bool ok_ = false;
  std::string why_;
};

#define NEED_FIXTURES()                                        \
  const Fixtures& fx = Fixtures::get();                        \
  if (!fx.ok()) GTEST_SKIP() << fx.why();

std::vector<std::string> cat(std::vector<std::string> a, const std::vector<std::string>& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

// --set arguments for a user's model on a user's dataset.
std::vector<std::string> user_job(const Fixtures& fx, const std::string& model, const std::string& data,
                                  std::vector<std::string> extra = {}) {
  std::vector<std::string> a = {"--set", "model.name=torchscript", "--set", "model.path=" + fx(model),
                                "--set", "data.dataset=tensors", "--set", "data.path=" + fx(data),
                                "--set", "train.progress=false", "--set", "data.batch_size=32",
                                "--set", "optim.lr=0.05"};
  for (const auto& e : extra) a.insert(a.end(), {"--set", e});
  return a;
}

json summary(const std::string& run) { return json::parse(slurp(run + "/summary.json")); }
// The final-<pid>.txt fingerprints (step, weights, buffers) of a
// data-parallel run with train.sample_log, one per member.
inline std::vector<std::string> final_fingerprints(const std::string& run) {
  std::vector<std::string> out;
  for (const auto& e : std::filesystem::directory_iterator(run))
    if (e.path().filename().string().rfind("final-", 0) == 0) out.push_back(slurp(e.path()));
  return out;
}

// Every one of `members` ended with the same weights and buffers.
inline void expect_members_agree(const std::string& run, size_t members) {
  auto finals = final_fingerprints(run);
  ASSERT_EQ(finals.size(), members) << run;
  for (const auto& f : finals) EXPECT_EQ(f, finals[0]);
}

}  // namespace
