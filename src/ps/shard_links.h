// A learner's connections to the shards of a parameter server: one DEALER
// socket per shard, the handshake (protocol version, model fingerprint, a
// per-process incarnation id), waiting for a reply while sending heartbeats
// (registering again with a shard that restarted and forgot this learner),
// weights received part by part into the flat parameters, and gradient
// slices pushed part by part straight from the gradient buffer (16 bits on
// the wire with an error-feedback residual when asked). The training loop
// that uses them is ps/worker.cc.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "ps/model_layout.h"
#include "ps/push_residual.h"
#include "ps/transport.h"
#include "ps/worker.h"

namespace limbo::ps {

struct ShardLink {
  int index = 0;
  std::string endpoint;
  std::unique_ptr<Socket> sock;
  int64_t offset = 0, numel = 0;  // the shard's slice of the flat parameters
  uint64_t clock = 0;             // clock of the weights last pulled from this shard
  uint64_t seq = 0;
  std::vector<uint16_t> wire;  // this shard's gradient slice in 16 bits (comm.compression)
};

class ShardLinks {
 public:
  // How a learner waits for a reply: as a registered learner (heartbeats;
  // registers again when the shard no longer knows it), while registering
  // (hellos are repeated), or as an observer after its goodbye (the final
  // pull: observer heartbeats, which never register it again, so the shard
  // can see every learner gone).
  enum class Waiting { Learner, Hello, Observer };
  // Sends the request again and returns its new sequence number (0: there
  // is nothing to send again, the request is lost).
  using Resend = std::function<uint64_t()>;

  // Connects to every shard of `opt.servers` and registers (blocking).
  // Throws InvalidInput when a shard refuses this learner or the shards'
  // slices do not cover the model's `total` floats in order.
  ShardLinks(const WorkerOptions& opt, const CurveKeys& keys, const ModelFingerprint& fp, int64_t total);

  std::vector<std::unique_ptr<ShardLink>>& all() { return links_; }
  Transport& transport() { return transport_; }

  // Waits for the reply `seq` of type `want` from shard `l`, sending
  // heartbeats while waiting; re-registers and calls `resend` when the
  // shard no longer knows this learner. A gradient the shard refused comes
  // back as a PushAck whose meta says "rejected"; one lost with a restarted
  // shard as "lost". Throws PeerFailure after opt.request_timeout of silence.
  Message await(ShardLink& l, uint64_t seq, MsgType want, const Resend& resend, Waiting waiting = Waiting::Learner);
  // Asks for the shard's weights (flags: kWantLease, kObserver, kFinal).
  uint64_t send_pull(ShardLink& l, uint8_t flags);
  // Receives the reply to pull `seq` part by part into `flat` (the whole
  // flat parameter vector; each part is copied as it arrives while the next
  // is in transit). Returns the first part's message (its meta carries the
  // lease; shard 0's also its buffers, in Message::buffers).
  Message receive_weights(ShardLink& l, float* flat, uint64_t seq, const Resend& resend,
                          Waiting waiting = Waiting::Learner);
  // Sends the shard its slice of gradient `g` (the whole flat gradient) in
  // parts, without a copy: `keep` is held by each send in flight. `buffers`
  // (shard 0: the model's buffers) goes with the first part.
  uint64_t send_push(ShardLink& l, const float* g, int64_t lease_id, const std::string& meta,
                     const std::function<std::shared_ptr<void>()>& keep, const Frame* buffers = nullptr);
  // Whether gradient `g` (the whole flat gradient) reaches every shard
  // finite: every value finite, and under 16-bit pushes every value plus
  // its residual within the 16-bit range. One read pass, no allocation.
  bool pushable(const float* g) const;
  // Each shard checks only its own slice, so a gradient that is not
  // pushable (or whose loss is not finite) is made NaN everywhere before
  // it is sent: every shard refuses it alike and none applies the finite
  // rest of it. Returns whether `g` was left as it was.
  bool prepare_push(float* g, bool loss_finite) const;
  // The shard accepted the last push: its 16-bit rounding residual counts.
  void accepted(const ShardLink& l) { residual_.commit(l.offset, l.numel); }
  // Leaves every shard.
  void bye();

 private:
  Header header(MsgType type, ShardLink& l);
  void send_hello(ShardLink& l, uint64_t* seq);
  // Registers with a shard (blocking); throws InvalidInput when refused.
  void hello(ShardLink& l);

  WorkerOptions opt_;
  Transport transport_;
  ModelFingerprint fp_;
  int64_t total_ = 0;
  // This process, for the shards: a learner restarted with the same id is
  // told apart from a re-registration of this one (sequence numbers restart).
  std::string incarnation_;
  std::vector<std::unique_ptr<ShardLink>> links_;
  PushResidual residual_;  // error feedback of 16-bit pushes, over the whole gradient
};

}  // namespace limbo::ps
