// A 64-bit mixing function (splitmix64's finaliser): reproducible draws from
// (seed, epoch, sample id) for augmentation and token-window offsets.
#pragma once

#include <cstdint>

namespace limbo::data {

inline uint64_t splitmix(uint64_t x) {
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

}  // namespace limbo::data
