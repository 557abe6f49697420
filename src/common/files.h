// Small filesystem helpers shared by every layer.
#pragma once

#include <string>

namespace limbo {

// Writes `data` to `path` atomically: a temp file in the same directory,
// fsync, rename over the target, fsync of the directory. Readers see the old
// or the new file, never a partial one, also after a crash. Throws limbo::Error naming the path on failure.
void write_file_atomic(const std::string& path, const std::string& data);
// A name beside `path` for its next version, written and renamed into
// place: unique across the hosts that share a directory (the host's name,
// the pid and random bits; two hosts with the same pid must never write
// one file).
std::string temp_name(const std::string& path);

// Flushes a written file to disk (fsync); throws limbo::Error naming the path
// when the file cannot be opened or the flush fails (a full or failing disk).
void fsync_file(const std::string& path);

// Renames `from` over `to`, then flushes the directory that holds `to`, so
// the new name survives a crash. Throws limbo::Error naming both paths.
void rename_durably(const std::string& from, const std::string& to);

// Appends one line (a '\n' is added) to a file opened in append mode, and
// checks that all of it was written; otherwise cuts the partial line off
// again and throws limbo::Error naming the path. One writer per file.
void append_line(const std::string& path, const std::string& line);

// Testing aid: replaces fsync(2) for the calls above (nullptr restores it),
// so tests can make a flush fail and see which descriptors were flushed.
using FsyncFn = int (*)(int fd);
void set_fsync_for_testing(FsyncFn fn);

// Reads a whole file; throws InvalidInput naming the path if it is missing.
std::string read_file(const std::string& path);

// Creates a directory and its parents; throws limbo::Error on failure.
void make_dirs(const std::string& path);

bool file_exists(const std::string& path);

}  // namespace limbo
