#include "ps/shard_links.h"

#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <limits>
#include <random>

#include "common/error.h"
#include "common/half.h"
#include "common/log.h"
#include "common/timing.h"
#include "ps/shard_state.h"

namespace limbo::ps {
namespace {

using json = nlohmann::json;

HalfKind half_kind(uint8_t encoding) { return (encoding & kBf16Values) ? HalfKind::Bf16 : HalfKind::Fp16; }

const std::string no_meta;

}  // namespace

ShardLinks::ShardLinks(const WorkerOptions& opt, const CurveKeys& keys, const ModelFingerprint& fp, int64_t total)
    : opt_(opt), transport_(keys), fp_(fp), total_(total) {
  std::random_device rd;
  incarnation_ = hex64((static_cast<uint64_t>(rd()) << 32) ^ rd() ^ static_cast<uint64_t>(::getpid()));
  for (size_t k = 0; k < opt.servers.size(); ++k) {
    auto l = std::make_unique<ShardLink>();
    l->index = static_cast<int>(k);
    l->endpoint = opt.servers[k];
    l->sock = std::make_unique<Socket>(transport_, Socket::Kind::Dealer);
    l->sock->connect(l->endpoint);
    links_.push_back(std::move(l));
  }
  int64_t covered = 0;
  for (auto& l : links_) {
    hello(*l);
    if (l->offset != covered)
      throw InvalidInput("shard " + std::to_string(l->index) + " at " + l->endpoint + " serves floats from " +
                         std::to_string(l->offset) + ", expected " + std::to_string(covered) +
                         " (are the --servers given in shard order?)");
    covered += l->numel;
  }
  if (covered != total)
    throw InvalidInput("the " + std::to_string(links_.size()) + " shard(s) given cover " + std::to_string(covered) +
                       " of the model's " + std::to_string(total) + " floats (is a shard missing from --servers?)");
}

Header ShardLinks::header(MsgType type, ShardLink& l) {
  Header h;
  h.type = type;
  h.sender = opt_.learner_id;
  h.shard = static_cast<uint32_t>(l.index);
  h.seq = ++l.seq;
  return h;
}

void ShardLinks::send_hello(ShardLink& l, uint64_t* seq) {
  Header h = header(MsgType::Hello, l);
  *seq = h.seq;
  json meta = {{"fingerprint", hex64(fp_.hash)}, {"model", fp_.description}, {"total", total_},
               {"incarnation", incarnation_}};
  l.sock->send(nullptr, h, meta.dump(), nullptr, 0);
}

void ShardLinks::hello(ShardLink& l) {
  uint64_t seq;
  send_hello(l, &seq);
  Message m = await(l, seq, MsgType::Welcome, [&] { send_hello(l, &seq); return seq; }, Waiting::Hello);
  if (m.meta.empty()) throw PeerFailure("shard " + std::to_string(l.index) + " sent an empty welcome");
  json w = json::parse(m.meta);
  l.offset = w["offset"];
  l.numel = w["numel"];
}

Message ShardLinks::await(ShardLink& l, uint64_t seq, MsgType want, const Resend& resend, Waiting waiting) {
  const bool registering = waiting == Waiting::Hello;
  auto last_heard = Clock::now(), last_beat = Clock::now();
  std::vector<Frame> frames;
  for (;;) {
    if (l.sock->recv(frames, nullptr, 50)) {
      Decoded d = decode(frames, 1ull << 40);
      if (d.reject != Reject::None)
        throw PeerFailure("shard " + std::to_string(l.index) + " at " + l.endpoint + " sent a message this learner "
                          "cannot read (" + d.detail + ")");
      last_heard = Clock::now();
      const Header& h = d.msg.header;
      if (h.type == MsgType::Refuse) {
        json r = json::parse(d.msg.meta);
        throw InvalidInput("shard " + std::to_string(l.index) + " at " + l.endpoint + " refused this learner: " +
                           r.value("reason", std::string("?")));
      }
      if (h.type == MsgType::Error) {
        json e = json::parse(d.msg.meta);
        std::string code = e.value("code", std::string());
        if (code == "unknown_learner" && waiting == Waiting::Observer) {
          // The shard restarted and forgot this connection: a handshake
          // and a goodbye make it a known observer again.
          log_warn("shard " + std::to_string(l.index) + " does not know this observer (restarted?): greeting it again");
          hello(l);
          l.sock->send(nullptr, header(MsgType::Bye, l), "", nullptr, 0);
          seq = resend();
          continue;
        }
        if (code == "unknown_learner" && waiting == Waiting::Learner) {
          log_warn("shard " + std::to_string(l.index) + " does not know this learner (restarted?): registering again");
          hello(l);
          seq = resend();
          if (seq == 0) {  // nothing to resend: the request is lost (e.g. a push to a restarted shard)
            Message lost;
            lost.header.type = want;
            lost.meta = R"({"status":"lost"})";
            return lost;
          }
          continue;
        }
        if (h.seq == seq && want == MsgType::PushAck) {  // a refused gradient: counted, training goes on
          Message rejected;
          rejected.header.type = want;
          rejected.meta = json{{"status", "rejected"}, {"code", code}, {"reason", e.value("reason", code)}}.dump();
          return rejected;
        }
        if (h.seq == seq || code == "version")
          throw PeerFailure("shard " + std::to_string(l.index) + " at " + l.endpoint + " refused a " +
                            type_name(want) + " request: " + e.value("reason", code));
        continue;
      }
      if (h.seq == seq && h.type == want) {
        d.msg.payload.keep = frames[2].keep;
        return d.msg;
      }
      continue;  // a heartbeat answer or a reply to an abandoned request
    }
    if (Clock::now() - last_beat > opt_.heartbeat_interval) {
      if (registering) {
        uint64_t s2;
        send_hello(l, &s2);
        seq = s2;
      } else {
        Header beat = header(MsgType::Heartbeat, l);
        if (waiting == Waiting::Observer) beat.flags = kObserver;
        l.sock->send(nullptr, beat, "", nullptr, 0);
      }
      last_beat = Clock::now();
    }
    if (Clock::now() - last_heard > opt_.request_timeout)
      throw PeerFailure("shard " + std::to_string(l.index) + " at " + l.endpoint + " did not answer for " +
                        std::to_string(opt_.request_timeout.count() / 1000.0) + " s (ps.request_timeout)" +
                        (registering ? std::string(": is it running, and do both sides use the same --keys?")
                                     : std::string()));
  }
}

uint64_t ShardLinks::send_pull(ShardLink& l, uint8_t flags) {
  Header h = header(MsgType::Pull, l);
  // Training pulls may come in 16 bits; the final weights never do.
  h.flags = (flags & kFinal) ? flags : flags | opt_.pull_encoding;
  l.sock->send(nullptr, h, "", nullptr, 0);
  return h.seq;
}

Message ShardLinks::receive_weights(ShardLink& l, float* flat_all, uint64_t seq, const Resend& resend, Waiting waiting) {
  float* flat = flat_all + l.offset;
  int64_t got = 0;
  Message first;
  for (;;) {
    Message m = await(l, seq, MsgType::Weights, [&] {
      got = 0;
      return seq = resend();
    }, waiting);
    const int64_t n = static_cast<int64_t>(m.floats());
    const bool last = !(m.header.flags & kMoreParts);
    if (static_cast<int64_t>(m.header.offset) != got || (last ? got + n != l.numel : got + n >= l.numel) ||
        (got > 0 && m.header.clock != first.header.clock))
      throw PeerFailure("shard " + std::to_string(l.index) + " sent weights floats [" +
                        std::to_string(m.header.offset) + ", " + std::to_string(m.header.offset + n) + ") at clock " +
                        std::to_string(m.header.clock) + " after " + std::to_string(got) + " of " +
                        std::to_string(l.numel) + " floats" + (got > 0 ? " at clock " + std::to_string(first.header.clock) : std::string()));
    if (m.header.flags & kValueEncoding) {
      const Frame a = aligned_frame(m.payload, sizeof(uint16_t));
      halves_to_floats(half_kind(m.header.flags), reinterpret_cast<const uint16_t*>(a.data), flat + got,
                       static_cast<size_t>(n));
    } else {
      copy_floats(flat + got, m.payload.data, m.payload.size);
    }
    if (got == 0) {
      first = m;
      first.payload = Frame();
    }
    got += n;
    if (last) break;
  }
  l.clock = first.header.clock;
  return first;
}

uint64_t ShardLinks::send_push(ShardLink& l, const float* g, int64_t lease_id, const std::string& meta,
                               const std::function<std::shared_ptr<void>()>& keep, const Frame* buffers) {
  Header h = header(MsgType::Push, l);
  h.clock = l.clock;
  h.aux = l.index == 0 ? lease_id : -1;
  const int64_t part = part_size(opt_.part_floats, l.numel);
  const uint8_t enc = opt_.push_encoding;
  if (enc) l.wire.resize(static_cast<size_t>(l.numel));
  for (int64_t o = 0; o < l.numel; o += part) {
    const int64_t k = std::min(part, l.numel - o);
    // 16 bits on the wire; what rounding dropped waits in the residual and
    // goes out with the next gradient (error feedback). Part by part, so
    // the next part is encoded while ZeroMQ sends this one. The new
    // residual replaces the old only once the shard accepted the push: a
    // push that is lost, dropped or rejected leaves it as it was.
    if (enc) residual_.encode(half_kind(enc), g, total_, l.offset + o, k, l.wire.data() + o);
    h.offset = static_cast<uint64_t>(o);
    h.flags = (o + k < l.numel ? kMoreParts : 0) | enc;
    const std::string& m = o == 0 ? meta : no_meta;
    const Frame* with = o == 0 ? buffers : nullptr;
    const bool sent = enc ? l.sock->send(nullptr, h, m, l.wire.data() + o, static_cast<size_t>(k) * 2, keep(), with)
                          : l.sock->send(nullptr, h, m, g + l.offset + o, static_cast<size_t>(k) * 4, keep(), with);
    if (!sent) break;
  }
  return h.seq;
}

bool ShardLinks::pushable(const float* g) const {
  // One read pass either way: the 16-bit range check fails on NaN and Inf too.
  const uint8_t enc = opt_.push_encoding;
  return enc ? residual_.encodes_finite(half_kind(enc), g, total_) : all_finite(g, static_cast<size_t>(total_));
}

bool ShardLinks::prepare_push(float* g, bool loss_finite) const {
  if (loss_finite && pushable(g)) return true;
  std::fill(g, g + total_, std::numeric_limits<float>::quiet_NaN());
  return false;
}

void ShardLinks::bye() {
  for (auto& l : links_) l->sock->send(nullptr, header(MsgType::Bye, *l), "", nullptr, 0);
}

}  // namespace limbo::ps
