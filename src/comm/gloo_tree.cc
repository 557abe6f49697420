#include "comm/gloo_tree.h"

#include <gloo/context.h>
#include <gloo/transport/unbound_buffer.h>
#include <gloo/types.h>

#include <utility>

#include "common/error.h"

namespace limbo::comm {
namespace {
constexpr uint8_t kTreeSlotPrefix = 0x4c;  // not one of Gloo's own (gloo/types.h)
}  // namespace

void tree_allreduce(gloo::Context& ctx, uint8_t* data, size_t count, size_t elsize, GlooReduceFn fn, uint32_t tag,
                    std::chrono::milliseconds timeout, std::vector<uint8_t>& scratch) {
  const int r = ctx.rank, p = ctx.size;
  scratch.resize((count + 1) / 2 * elsize);
  auto buf = ctx.createUnboundBuffer(data, count * elsize);
  auto tmp = ctx.createUnboundBuffer(scratch.data(), scratch.size());
  auto wait = [&](gloo::transport::UnboundBuffer& b, bool recv) {
    if (!(recv ? b.waitRecv(timeout) : b.waitSend(timeout)))
      throw PeerFailure("a tree all-reduce was aborted (a member stopped answering)");
  };
  // Reduce-scatter: keep one half of the range, send the other to the
  // partner, add the partner's copy of the kept half (a + b = b + a).
  std::vector<std::pair<size_t, size_t>> parents;
  size_t lo = 0, hi = count;
  uint8_t step = 0;
  for (int d = 1; d < p; d <<= 1, ++step) {
    const int peer = r ^ d;
    const size_t mid = lo + (hi - lo) / 2;
    const bool upper = (r & d) != 0;
    const size_t keep_lo = upper ? mid : lo, keep_hi = upper ? hi : mid;
    const size_t give_lo = upper ? lo : mid, give_hi = upper ? mid : hi;
    const auto slot = gloo::Slot::build(kTreeSlotPrefix, tag) + step;
    if (give_hi > give_lo) buf->send(peer, slot, give_lo * elsize, (give_hi - give_lo) * elsize);
    if (keep_hi > keep_lo) {
      tmp->recv(peer, slot, 0, (keep_hi - keep_lo) * elsize);
      wait(*tmp, true);
      fn(data + keep_lo * elsize, data + keep_lo * elsize, scratch.data(), keep_hi - keep_lo);
    }
    if (give_hi > give_lo) wait(*buf, false);
    parents.emplace_back(lo, hi);
    lo = keep_lo;
    hi = keep_hi;
  }
  // All-gather, the steps in reverse: swap the owned range for the
  // partner's (its sibling in the parent range).
  for (int d = p >> 1; d >= 1; d >>= 1) {
    --step;
    const int peer = r ^ d;
    const auto [plo, phi] = parents[step];
    const bool upper = lo != plo;
    const size_t sib_lo = upper ? plo : hi, sib_hi = upper ? lo : phi;
    const auto slot = gloo::Slot::build(kTreeSlotPrefix, tag) + static_cast<uint8_t>(32 + step);
    if (hi > lo) buf->send(peer, slot, lo * elsize, (hi - lo) * elsize);
    if (sib_hi > sib_lo) buf->recv(peer, slot, sib_lo * elsize, (sib_hi - sib_lo) * elsize);
    if (sib_hi > sib_lo) wait(*buf, true);
    if (hi > lo) wait(*buf, false);
    lo = plo;
    hi = phi;
  }
}

}  // namespace limbo::comm
