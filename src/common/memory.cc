#include "common/memory.h"

#include <malloc.h>

#include <cstdlib>

namespace limbo {

void keep_freed_memory(std::size_t mmap_threshold, std::size_t trim_threshold) {
  if (!std::getenv("MALLOC_MMAP_THRESHOLD_"))
    mallopt(M_MMAP_THRESHOLD, static_cast<int>(mmap_threshold));
  if (!std::getenv("MALLOC_TRIM_THRESHOLD_"))
    mallopt(M_TRIM_THRESHOLD, static_cast<int>(trim_threshold));
}

std::vector<std::string> keep_freed_memory_env(std::size_t mmap_threshold, std::size_t trim_threshold) {
  std::vector<std::string> env;
  if (!std::getenv("MALLOC_MMAP_THRESHOLD_"))
    env.push_back("MALLOC_MMAP_THRESHOLD_=" + std::to_string(mmap_threshold));
  if (!std::getenv("MALLOC_TRIM_THRESHOLD_"))
    env.push_back("MALLOC_TRIM_THRESHOLD_=" + std::to_string(trim_threshold));
  return env;
}

}  // namespace limbo
