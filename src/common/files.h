// Small filesystem helpers shared by every layer.
#pragma once

#include <string>

namespace limbo {

// Writes `data` to `path` atomically: a temp file in the same directory,
// fsync, then rename over the target. Readers see the old or the new file,
// never a partial one. Throws limbo::Error naming the path on failure.
void write_file_atomic(const std::string& path, const std::string& data);

// Reads a whole file; throws InvalidInput naming the path if it is missing.
std::string read_file(const std::string& path);

// Creates a directory and its parents; throws limbo::Error on failure.
void make_dirs(const std::string& path);

bool file_exists(const std::string& path);

}  // namespace limbo
