// Durability of what a run leaves on disk: a failed flush stops a checkpoint
// and keeps the old one, renames are followed by a flush of the directory,
// and appends that do not reach the disk are reported, not dropped.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <set>
#include <sstream>
#include <vector>

#include "common/error.h"
#include "common/files.h"
#include "optim/sgd.h"
#include "train/checkpoint.h"
#include "train/run_dir.h"
#include "test_util.h"

using namespace limbo;
using limbo::testing::TempDir;

namespace {

// fsync replacements: one that fails, one that records what it flushed.
int failing_fsync(int) {
  errno = EIO;
  return -1;
}
std::set<ino_t> g_dirs_flushed, g_files_flushed;
int recording_fsync(int fd) {
  struct stat st {};
  if (::fstat(fd, &st) == 0) (S_ISDIR(st.st_mode) ? g_dirs_flushed : g_files_flushed).insert(st.st_ino);
  return ::fsync(fd);
}
ino_t inode(const std::string& path) {
  struct stat st {};
  ::stat(path.c_str(), &st);
  return st.st_ino;
}

struct FsyncGuard {
  explicit FsyncGuard(FsyncFn f) { set_fsync_for_testing(f); }
  ~FsyncGuard() { set_fsync_for_testing(nullptr); }
};

// Files may grow to at most `bytes` while this lives (writes beyond fail
// with EFBIG instead of raising SIGXFSZ).
struct FileSizeLimit {
  explicit FileSizeLimit(rlim_t bytes) {
    ::getrlimit(RLIMIT_FSIZE, &old_);
    old_handler_ = ::signal(SIGXFSZ, SIG_IGN);
    rlimit r = old_;
    r.rlim_cur = bytes;
    ::setrlimit(RLIMIT_FSIZE, &r);
  }
  ~FileSizeLimit() {
    ::setrlimit(RLIMIT_FSIZE, &old_);
    ::signal(SIGXFSZ, old_handler_);
  }
  rlimit old_{};
  sighandler_t old_handler_;
};

}  // namespace

TEST(Durability, AFailedFlushStopsTheCheckpointAndKeepsTheOldOne) {
  TempDir d;
  const std::string path = d.file("checkpoint.pt");
  torch::nn::Linear model(4, 2);
  optim::Sgd sgd(optim::OptimizerOptions{});
  train::TrainState st;
  st.step = 7;
  train::save_checkpoint(path, *model, sgd, st);
  {
    FsyncGuard g(failing_fsync);
    st.step = 8;
    try {
      train::save_checkpoint(path, *model, sgd, st);
      FAIL() << "a checkpoint whose flush failed was accepted";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("flush"), std::string::npos) << e.what();
    }
  }
  EXPECT_EQ(train::load_checkpoint(path, *model, nullptr).step, 7);
  int files = 0;
  for (const auto& e : std::filesystem::directory_iterator(d.path())) files += 1, (void)e;
  EXPECT_EQ(files, 1) << "the temporary file was left behind";
}

TEST(Durability, AtomicWritesFlushTheFileAndThenItsDirectory) {
  TempDir d;
  FsyncGuard g(recording_fsync);
  g_dirs_flushed.clear();
  g_files_flushed.clear();
  write_file_atomic(d.file("summary.json"), "{}\n");
  EXPECT_EQ(g_dirs_flushed.count(inode(d.path())), 1u) << "the directory was not flushed";
  EXPECT_EQ(g_files_flushed.size(), 1u);
  g_dirs_flushed.clear();
  torch::nn::Linear model(4, 2);
  train::save_checkpoint(d.file("checkpoint.pt"), *model, optim::Sgd(optim::OptimizerOptions{}), {});
  EXPECT_EQ(g_dirs_flushed.count(inode(d.path())), 1u) << "the checkpoint's directory was not flushed";
  EXPECT_EQ(g_files_flushed.count(inode(d.file("checkpoint.pt"))), 1u);
}

TEST(Durability, AFailedFlushOfAnAtomicWriteKeepsTheOldFile) {
  TempDir d;
  write_file_atomic(d.file("a"), "old");
  FsyncGuard g(failing_fsync);
  EXPECT_THROW(write_file_atomic(d.file("a"), "new"), Error);
  EXPECT_EQ(read_file(d.file("a")), "old");
}

TEST(Durability, MetricsThatCannotBeWrittenAreReported) {
  TempDir d;
  train::RunDir run(d.path(), false);
  run.append_metrics({{"kind", "train"}, {"step", 1}});
  const std::string big(4096, 'x');
  {
    FileSizeLimit limit(1024);
    EXPECT_THROW(run.append_metrics({{"kind", "train"}, {"note", big}}), Error);
    EXPECT_THROW(append_line(d.file("learner.jsonl"), big), Error);
  }
  append_line(d.file("learner.jsonl"), "{}");  // fine again without the limit
  EXPECT_EQ(read_file(d.file("learner.jsonl")), "{}\n") << "a torn line was left behind";
  const std::string metrics = read_file(d.file("metrics.jsonl"));
  EXPECT_EQ(metrics, "{\"kind\":\"train\",\"step\":1}\n") << "a torn line was left behind";
}

// The id of the storage a run directory is on: one per directory, the
// same for every process that opens it, also when they race to make it.
TEST(RunDirStorage, OneIdPerDirectoryAgreedByRacingProcesses) {
  TempDir d;
  const std::string a = d.file("a"), b = d.file("b");
  std::vector<pid_t> kids;
  for (int i = 0; i < 6; ++i) {
    pid_t p = ::fork();
    if (p == 0) {
      train::RunDir run(a, true);
      append_line(d.file("ids"), std::to_string(run.storage_id()));
      ::_exit(0);
    }
    kids.push_back(p);
  }
  for (pid_t p : kids) ::waitpid(p, nullptr, 0);
  std::istringstream in(read_file(d.file("ids")));
  std::set<std::string> ids;
  int n = 0;
  for (std::string line; std::getline(in, line); ++n) ids.insert(line);
  EXPECT_EQ(n, 6);
  ASSERT_EQ(ids.size(), 1u) << read_file(d.file("ids"));
  EXPECT_EQ(std::to_string(train::RunDir(a, true).storage_id()), *ids.begin());
  const int64_t other = train::RunDir(b, true).storage_id();
  EXPECT_GT(other, 0);
  EXPECT_NE(std::to_string(other), *ids.begin());
  EXPECT_EQ(train::RunDir("", false).storage_id(), 0);
  struct stat st {};
  ::stat(b.c_str(), &st);
  write_file_atomic(b + "/.storage-" + std::to_string(static_cast<uint64_t>(st.st_ino)), "garbage\n");
  EXPECT_THROW(train::RunDir(b, true).storage_id(), InvalidInput);
}

// S4: a run directory copied with `cp -a` (or rsync) carried its storage
// id, so two hosts counted as one storage and one of them silently stopped
// getting records. A copy now gets an id of its own.
TEST(RunDirStorage, ACopiedRunDirectoryIsAnotherStorage) {
  TempDir d;
  const std::string a = d.file("a"), copy = d.file("copy");
  const int64_t id = train::RunDir(a, true).storage_id();
  ASSERT_EQ(std::system(("cp -a '" + a + "' '" + copy + "'").c_str()), 0);
  const int64_t copied = train::RunDir(copy, true).storage_id();
  EXPECT_GT(copied, 0);
  EXPECT_NE(copied, id);
  EXPECT_EQ(train::RunDir(copy, true).storage_id(), copied);  // and it keeps it
  EXPECT_EQ(train::RunDir(a, true).storage_id(), id);
}
