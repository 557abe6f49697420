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

}  // namespace limbo
