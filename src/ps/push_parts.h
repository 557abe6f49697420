// Assembles pushes that arrive in parts (see protocol.h), per learner, for a
// shard. No sockets, no tensors: the shard server feeds it every push part it
// receives and acts on the outcome.
//
// The parts of a push are kept without copying (their frames own the bytes)
// until the last one arrives; the assembler checks that they continue each
// other, stay within the shard's slice, end exactly at its end, and number at
// most kMaxParts. A new first part from a learner replaces its unfinished
// push (the learner abandoned it). A push whose seq the caller reports as
// already handled is a duplicate; its remaining parts are ignored. After a
// rejected part the rest of that push is ignored as well.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "ps/protocol.h"

namespace limbo::ps {

// A push (once complete: a whole gradient slice) as its parts.
struct PartedPush {
  Header head;               // of the first part: sender, seq, clock, lease
  std::vector<Frame> frames;  // own the parts' bytes
  std::vector<GradPart> parts;
  int64_t received = 0;       // floats so far
  bool ignore_rest = false;   // answered already: drop the remaining parts
  std::string meta;           // of the first part (shard 0: how many of its buffers are averaged)
  Frame buffers;              // of the first part (flag kBuffers; shard 0: the learner's buffers)
};

class PushAssembler {
 public:
  explicit PushAssembler(int64_t slice_floats) : slice_(slice_floats) {}

  struct Result {
    enum class Outcome { Added, Duplicate, Rejected, Ignored } outcome = Outcome::Ignored;
    bool first = false;     // Added: the push's first part
    bool complete = false;  // Added: its last part; take() it now
    bool ended = false;     // Rejected: the learner's push under way ended with this part
    GradPart part;          // Added: where the part's floats are
    Reject reject = Reject::None;
    std::string why;        // Rejected
  };
  // One push part of a registered learner. `handled_seq` is the learner's
  // last push seq already handled (0 = none).
  Result add(const Message& m, uint64_t handled_seq);
  // The complete push of `learner` (after add() returned complete).
  PartedPush take(uint32_t learner);
  // Forgets the learner's unfinished push (it left or was dropped).
  void drop(uint32_t learner) { pushes_.erase(learner); }
  size_t unfinished() const { return pushes_.size(); }

 private:
  int64_t slice_;
  std::map<uint32_t, PartedPush> pushes_;
};

}  // namespace limbo::ps
