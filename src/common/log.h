// Minimal leveled logging to stderr with a wall-clock timestamp and a tag
// (e.g. "rank 2"). Thread-safe; no global state beyond the verbosity level.
#pragma once

#include <string>

namespace limbo {

enum class LogLevel { Debug = 0, Info = 1, Warn = 2, Error = 3 };

void set_log_level(LogLevel level);
void log(LogLevel level, const std::string& message);
inline void log_info(const std::string& m) { log(LogLevel::Info, m); }
inline void log_warn(const std::string& m) { log(LogLevel::Warn, m); }
inline void log_debug(const std::string& m) { log(LogLevel::Debug, m); }

}  // namespace limbo
