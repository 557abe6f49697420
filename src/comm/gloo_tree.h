// The all-reduce of a power-of-two Gloo group as a tree over ranks.
//
// Recursive halving, then doubling, with partners at distance 1 first: in
// step s each member keeps one half of its range, sends the other half to
// the member whose rank differs in bit s, and adds that member's copy of
// the kept half (a + b = b + a); then the steps in reverse swap owned
// ranges. Every element is summed as ((x0 + x1) + (x2 + x3)) + ...,
// whatever its position (Gloo's ring orders the additions by position), the
// order a hierarchical group gives when each host holds consecutive ranks
// (comm/hier_group.h). Each member sends (p-1)/p of the tensor twice, as in
// the ring.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <vector>

namespace gloo {
class Context;
}

namespace limbo::comm {

// out = a + b over n elements (out may be a), as Gloo's reduce functions.
using GlooReduceFn = void (*)(void*, const void*, const void*, size_t);

// In place over `count` elements of `elsize` bytes at `data`, among the
// context's members (a power of two); `tag` distinct per call, `scratch`
// grown to half the tensor. Throws PeerFailure when a wait was aborted, and
// Gloo's exceptions on a closed connection or a timeout.
void tree_allreduce(gloo::Context& ctx, uint8_t* data, size_t count, size_t elsize, GlooReduceFn fn, uint32_t tag,
                    std::chrono::milliseconds timeout, std::vector<uint8_t>& scratch);

}  // namespace limbo::comm
