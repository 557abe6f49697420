#include "common/files.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <sstream>

#include "common/error.h"

namespace limbo {
namespace {

FsyncFn g_fsync = nullptr;

int do_fsync(int fd) { return g_fsync ? g_fsync(fd) : ::fsync(fd); }

std::string parent_dir(const std::string& path) {
  auto p = std::filesystem::path(path).parent_path();
  return p.empty() ? "." : p.string();
}

}  // namespace

void set_fsync_for_testing(FsyncFn fn) { g_fsync = fn; }

void fsync_file(const std::string& path) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) throw Error("cannot open '" + path + "' to flush it: " + std::strerror(errno));
  if (do_fsync(fd) != 0) {
    int e = errno;
    ::close(fd);
    throw Error("cannot flush '" + path + "' to disk: " + std::strerror(e));
  }
  ::close(fd);
}

void rename_durably(const std::string& from, const std::string& to) {
  if (::rename(from.c_str(), to.c_str()) != 0)
    throw Error("cannot rename '" + from + "' to '" + to + "': " + std::strerror(errno));
  const std::string dir = parent_dir(to);
  int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) throw Error("cannot open directory '" + dir + "' to flush it: " + std::strerror(errno));
  if (do_fsync(fd) != 0) {
    int e = errno;
    ::close(fd);
    throw Error("cannot flush directory '" + dir + "' after renaming '" + to + "': " + std::strerror(e));
  }
  ::close(fd);
}

void append_line(const std::string& path, const std::string& line) {
  int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
  if (fd < 0) throw Error("cannot open '" + path + "' to append: " + std::strerror(errno));
  const std::string data = line + "\n";
  struct stat st {};
  const off_t before = ::fstat(fd, &st) == 0 ? st.st_size : -1;
  size_t done = 0;
  while (done < data.size()) {
    ssize_t n = ::write(fd, data.data() + done, data.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      int e = n < 0 ? errno : EIO;
      if (before >= 0 && ::ftruncate(fd, before) != 0) {}  // no torn line left behind
      ::close(fd);
      throw Error("cannot append to '" + path + "': " + std::strerror(e));
    }
    done += static_cast<size_t>(n);
  }
  if (::close(fd) != 0) throw Error("cannot append to '" + path + "': " + std::strerror(errno));
}

std::string temp_name(const std::string& path) {
  char host[64] = {0};
  ::gethostname(host, sizeof host - 1);
  static std::atomic<uint64_t> counter{0};
  std::random_device rd;
  char tail[64];
  std::snprintf(tail, sizeof tail, ".%d.%08x%04x", static_cast<int>(::getpid()), rd(),
                static_cast<unsigned>(counter.fetch_add(1) & 0xffff));
  std::string h = host;
  for (char& c : h)
    if (c == '/' || c == ' ') c = '_';
  return path + ".tmp." + h + tail;
}

void write_file_atomic(const std::string& path, const std::string& data) {
  std::string tmp = temp_name(path);
  int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  if (fd < 0)
    throw Error("cannot create '" + tmp + "': " + std::strerror(errno));
  size_t done = 0;
  while (done < data.size()) {
    ssize_t n = ::write(fd, data.data() + done, data.size() - done);
    if (n < 0) {
      if (errno == EINTR) continue;
      int e = errno;
      ::close(fd);
      ::unlink(tmp.c_str());
      throw Error("cannot write '" + tmp + "': " + std::strerror(e));
    }
    done += static_cast<size_t>(n);
  }
  if (do_fsync(fd) != 0 || ::close(fd) != 0) {
    int e = errno;
    ::unlink(tmp.c_str());
    throw Error("cannot flush '" + tmp + "' to disk: " + std::strerror(e));
  }
  try {
    rename_durably(tmp, path);
  } catch (...) {
    ::unlink(tmp.c_str());
    throw;
  }
}

std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw InvalidInput("cannot open '" + path + "': " + std::strerror(errno));
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

void make_dirs(const std::string& path) {
  std::error_code ec;
  std::filesystem::create_directories(path, ec);
  if (ec) throw Error("cannot create directory '" + path + "': " + ec.message());
}

bool file_exists(const std::string& path) {
  std::error_code ec;
  return std::filesystem::exists(path, ec);
}

}  // namespace limbo
