#include "ps/push_parts.h"

#include <cstring>
#include <memory>
#include <vector>

#include "common/half.h"

namespace limbo::ps {

PushAssembler::Result PushAssembler::add(const Message& m, uint64_t handled_seq) {
  const Header& h = m.header;
  const bool first = h.offset == 0, last = !(h.flags & kMoreParts);
  Result r;
  auto it = pushes_.find(h.sender);
  if (first) {
    if (handled_seq != 0 && h.seq <= handled_seq) {
      // Seen before: answered as a duplicate, never applied twice. Its later
      // parts are ignored (rejected, if another push is under way meanwhile).
      if (it == pushes_.end() && !last) pushes_[h.sender] = PartedPush{h, {}, {}, 0, true, {}, {}};
      r.outcome = Result::Outcome::Duplicate;
      return r;
    }
    it = pushes_.insert_or_assign(h.sender, PartedPush{h, {}, {}, 0, false, m.meta, m.buffers}).first;
  } else if (it == pushes_.end() || it->second.head.seq != h.seq) {
    r.outcome = Result::Outcome::Rejected;
    r.reject = Reject::Protocol;
    r.why = "push part at float " + std::to_string(h.offset) + " of a push (seq " + std::to_string(h.seq) +
            ") whose first part never came";
    return r;
  }
  PartedPush& p = it->second;
  if (p.ignore_rest) {
    if (last) pushes_.erase(it);
    return r;  // Ignored
  }
  const int64_t n = static_cast<int64_t>(m.floats());
  if (static_cast<int64_t>(h.offset) != p.received) {
    r.reject = Reject::Protocol;
    r.why = "push part at float " + std::to_string(h.offset) + ", expected " + std::to_string(p.received);
  } else if (last ? p.received + n != slice_ : (n == 0 || p.received + n >= slice_)) {
    r.reject = Reject::Shape;
    r.why = "gradient of " + std::string(last ? "" : "more than ") + std::to_string(p.received + n) +
            " floats for a shard of " + std::to_string(slice_);
  } else if (!last && static_cast<int64_t>(p.parts.size()) + 1 >= kMaxParts) {
    r.reject = Reject::Shape;
    r.why = "push in more than " + std::to_string(kMaxParts) + " parts";
  }
  if (r.reject != Reject::None) {
    r.outcome = Result::Outcome::Rejected;
    r.ended = true;
    if (last) pushes_.erase(it);
    else p.ignore_rest = true;
    return r;
  }
  const Frame f = aligned_frame(m.payload, value_bytes(h.flags));
  GradPart part{p.received, reinterpret_cast<const float*>(f.data), n};
  if (h.flags & kValueEncoding) {
    // 16-bit values (comm.compression): kept as they came; the shard widens
    // them a chunk at a time inside its update (no widened copy of the part).
    part.data = nullptr;
    part.halves = reinterpret_cast<const uint16_t*>(f.data);
    part.bf16 = (h.flags & kBf16Values) != 0;
  }
  r.outcome = Result::Outcome::Added;
  r.first = first;
  r.complete = last;
  r.part = part;
  p.frames.push_back(f);
  p.parts.push_back(r.part);
  p.received += n;
  return r;
}

PartedPush PushAssembler::take(uint32_t learner) {
  auto it = pushes_.find(learner);
  PartedPush p = std::move(it->second);
  pushes_.erase(it);
  return p;
}

}  // namespace limbo::ps
