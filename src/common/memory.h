// Process-wide heap settings for training.
//
// A training step frees and re-allocates the same large tensors (activations,
// weight gradients of a few hundred KB to MB) every iteration. With glibc's
// defaults such blocks are either mmap'ed and unmapped each time or trimmed
// back to the OS at the top of the heap, so every step pays page faults and
// page clearing for memory it just gave back (about 15% of an MLP step on the
// reference machine). keep_freed_memory() raises the mmap and trim
// thresholds so freed blocks stay in the heap and are reused.
#pragma once

#include <cstddef>
#include <string>
#include <vector>

namespace limbo {

// Call once at start-up, before large allocations. Blocks below
// `mmap_threshold` come from the heap; the heap is trimmed only when more than
// `trim_threshold` bytes are free at its top. Honours MALLOC_MMAP_THRESHOLD_ /
// MALLOC_TRIM_THRESHOLD_ when the user set them (then does nothing).
void keep_freed_memory(std::size_t mmap_threshold = 64u << 20, std::size_t trim_threshold = 512u << 20);

// The same settings for a program `limbo launch` starts (a user's Python
// loop): MALLOC_MMAP_THRESHOLD_ and MALLOC_TRIM_THRESHOLD_ as glibc reads
// them at the program's start, each only where this process's environment
// does not set it already.
std::vector<std::string> keep_freed_memory_env(std::size_t mmap_threshold = 64u << 20,
                                               std::size_t trim_threshold = 512u << 20);

}  // namespace limbo
