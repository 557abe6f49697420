#include "ps/server.h"

#include "common/half.h"

#include "ps/buffer_mean.h"
#include "ps/push_parts.h"
#include "ps/shard_checkpoint.h"
#include "ps/shard_state.h"
#include "ps/staleness.h"

#include <torch/torch.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <deque>
#include <set>
#include <array>
#include <atomic>
#include <chrono>
#include <cstring>
#include <fstream>
#include <map>
#include <optional>

#include "common/error.h"
#include "common/timing.h"
#include "common/files.h"
#include "common/log.h"

namespace limbo::ps {
namespace {

using json = nlohmann::json;



}  // namespace

struct Server::Impl {
  ServerOptions opt;
  ModelFingerprint fp;
  CurveKeys keys;
  Range range;
  int64_t total = 0;
  std::unique_ptr<ShardState> state;
  Aggregator agg;
  std::unique_ptr<LeaseBook> leases;
  std::unique_ptr<Transport> transport;
  std::unique_ptr<Socket> sock;
  std::string endpoint;
  bool finisher_given = false;
  BufferMean buffers;  // shard 0: the model's buffers (see buffer_mean.h)
  int64_t buffers_refused = 0;

  struct Held {
    std::string identity;
    uint32_t learner;
    uint64_t seq;
    uint8_t flags;
  };
  std::vector<Held> held;  // at most one per connection (a newer pull replaces it)
  size_t held_peak = 0;
  // Connections that completed a handshake: only they may read the weights
  // as observers (the finisher's final pull), also without CURVE. Bounded.
  std::set<std::string> welcomed;
  std::deque<std::string> welcomed_order;
  static constexpr size_t kMaxRemembered = 4096;
  std::map<uint32_t, Clock::time_point> last_seen;
  std::map<uint32_t, uint64_t> last_push_seq;
  std::map<uint32_t, std::string> incarnation;  // per learner id: its process (hello "incarnation")
  std::map<uint32_t, int64_t> grads_per_learner;

  // Pushes arriving in parts (protocol.h). At most one push at a time is
  // streamed: a push that would make an update on its own is applied part by
  // part as it arrives, and the result kept if no other update overtook it
  // by its last part (else the update is made again from the kept parts).
  std::unique_ptr<PushAssembler> pushes;
  std::optional<uint32_t> streamed;
  StreamedStep step;

  int64_t accepted = 0, dropped = 0, updates = 0, checkpoints = 0, learners_dropped = 0;
  // Payload bytes of push parts taken in and of weights parts sent (16-bit
  // values count 2 bytes: comm.compression, ps.pull_compression).
  int64_t push_payload_bytes = 0, weights_payload_bytes = 0;
  // Updates made part by part while their push arrived (kept at its last part).
  int64_t updates_streamed = 0;
  std::array<int64_t, kRejectKinds> rejected{};
  StalenessHist hist_total, hist_window;
  int64_t window_updates = 0;
  Clock::time_point start = Clock::now(), window_start = Clock::now();
  double busy = 0, window_busy = 0;
  uint64_t last_ckpt_clock = 0;
  std::string metrics_path;

  Impl(ServerOptions o, ModelFingerprint f, CurveKeys k) : opt(std::move(o)), fp(std::move(f)), keys(std::move(k)), agg(opt.agg) {}

  // ---- replies -------------------------------------------------------------
  Header reply_header(MsgType t, uint64_t seq) {
    Header h;
    h.type = t;
    h.sender = static_cast<uint32_t>(opt.shard);
    h.shard = static_cast<uint32_t>(opt.shard);
    h.clock = agg.clock();
    h.seq = seq;
    return h;
  }
  void send_json(const std::string& id, MsgType t, uint64_t seq, const json& meta) {
    sock->send(&id, reply_header(t, seq), meta.dump(), nullptr, 0);
  }
  void send_error(const std::string& id, uint64_t seq, const std::string& code, const std::string& reason) {
    send_json(id, MsgType::Error, seq, {{"code", code}, {"reason", reason}});
  }

  void reject(Reject r, const std::string& detail, const std::string* id, uint64_t seq) {
    rejected[static_cast<int>(r)] += 1;
    int64_t n = rejected[static_cast<int>(r)];
    if (n <= 3 || (n & (n - 1)) == 0)  // log the first few, then at powers of two
      log_warn("shard " + std::to_string(opt.shard) + ": rejected a message (" + reject_name(r) + ", " +
               std::to_string(n) + " so far): " + detail);
    if (id) send_error(*id, seq, reject_name(r), detail);
  }

  // ---- weights ---------------------------------------------------------------
  void answer_pull(const std::string& id, uint32_t learner, uint64_t seq, uint8_t flags) {
    json meta = json::object();
    if ((flags & kWantLease) && leases) {
      Lease l;
      auto r = leases->next(learner, l);
      if (r == LeaseBook::Next::Granted) {
        meta["lease"] = {{"id", l.id}, {"epoch", l.epoch}, {"position", l.position}, {"count", l.count}};
      } else if (r == LeaseBook::Next::Wait) {
        meta["lease_state"] = "wait";
      } else {
        meta["lease_state"] = "done";
        meta["finisher"] = !finisher_given;
        finisher_given = true;
      }
    }
    // Shard 0's buffers go with the first part, as float32 in a frame of their own.
    const Frame buffer_frame = opt.shard == 0 ? buffers.frame() : Frame();
    if (buffer_frame.size > 0) meta["averaged"] = buffers.averaged();
    if (!(flags & kObserver)) agg.on_pull(learner);
    auto w = state->weights();  // keeps this version alive until ZeroMQ has sent it
    const int64_t n = w->numel();
    const int64_t part = part_size(opt.part_floats, n);
    const float* data = w->data_ptr<float>();
    const uint8_t encoding = flags & kValueEncoding;  // ps.pull_compression of the learner
    if (encoding == kValueEncoding) return send_error(id, seq, "payload_size", "pull asks for both fp16 and bf16");
    for (int64_t o = 0; o < n; o += part) {
      const int64_t k = std::min(part, n - o);
      Header h = reply_header(MsgType::Weights, seq);
      h.offset = static_cast<uint64_t>(o);
      h.flags = (o + k < n ? kMoreParts : 0) | encoding;
      const std::string m = o == 0 && !meta.empty() ? meta.dump() : std::string();
      weights_payload_bytes += k * (encoding ? 2 : 4);
      const Frame* with = o == 0 && buffer_frame.size > 0 ? &buffer_frame : nullptr;
      if (!encoding) {
        sock->send(&id, h, m, data + o, static_cast<size_t>(k) * 4, w, with);
        continue;
      }
      // Rounded to 16 bits for the wire; the shard keeps float32 weights.
      auto halves = std::shared_ptr<uint16_t>(new uint16_t[static_cast<size_t>(k)], std::default_delete<uint16_t[]>());
      floats_to_halves(encoding == kBf16Values ? HalfKind::Bf16 : HalfKind::Fp16, data + o, halves.get(),
                       static_cast<size_t>(k));
      sock->send(&id, h, m, halves.get(), static_cast<size_t>(k) * 2, halves, with);
    }
  }

  bool pull_may_go(const Held& h) const {
    if (h.flags & kFinal) return agg.learners() == 0;
    if (h.flags & kObserver) return true;
    return agg.may_pull(h.learner);
  }

  void service_held() {
    for (size_t i = 0; i < held.size();) {
      if (pull_may_go(held[i])) {
        Held h = held[i];
        held.erase(held.begin() + static_cast<long>(i));
        answer_pull(h.identity, h.learner, h.seq, h.flags);
      } else {
        ++i;
      }
    }
  }

  void apply_update() {
    auto taus = agg.commit();
    state->apply(static_cast<int64_t>(taus.size()));
    finish_update(taus);
  }

  void finish_update(const std::vector<int64_t>& taus) {
    buffers.commit();
    updates += 1;
    window_updates += 1;
    for (int64_t t : taus) {
      hist_total[t] += 1;
      hist_window[t] += 1;
    }
    if (opt.checkpoint_every > 0 && agg.clock() - last_ckpt_clock >= static_cast<uint64_t>(opt.checkpoint_every))
      checkpoint();
    if (window_updates >= opt.log_every) log_window();
  }

  void maybe_update() {
    while (agg.ready()) apply_update();
  }

  // ---- learners ----------------------------------------------------------------
  void remove_learner(uint32_t id, const std::string& why) {
    if (!agg.remove_learner(id)) return;
    last_seen.erase(id);
    pushes->drop(id);
    stop_streaming(id);
    // Its held pulls go with it (a learner that comes back pulls again).
    held.erase(std::remove_if(held.begin(), held.end(),
                              [&](const Held& h) { return h.learner == id && !(h.flags & kObserver); }),
               held.end());
    int released = leases ? leases->release(id) : 0;
    log_info("shard " + std::to_string(opt.shard) + ": learner " + std::to_string(id) + " " + why +
             " (lambda = " + std::to_string(agg.learners()) + ", c = " + std::to_string(agg.c()) +
             (released ? ", " + std::to_string(released) + " lease(s) re-queued" : std::string()) + ")");
    maybe_update();
    service_held();
  }

  // Learners that are no longer registered keep their sequence numbers (a
  // dropped but living learner re-sends after registering again); beyond
  // kMaxRemembered ids the departed ones are forgotten.
  void forget_departed() {
    if (last_push_seq.size() <= kMaxRemembered && incarnation.size() <= kMaxRemembered &&
        grads_per_learner.size() <= kMaxRemembered)
      return;
    auto prune = [&](auto& m) {
      for (auto it = m.begin(); it != m.end();) it = agg.registered(it->first) ? std::next(it) : m.erase(it);
    };
    prune(last_push_seq);
    prune(incarnation);
    prune(grads_per_learner);
  }

  void sweep() {
    std::vector<uint32_t> gone;
    for (const auto& [id, t] : last_seen)
      if (Clock::now() - t > opt.heartbeat_timeout) gone.push_back(id);
    for (uint32_t id : gone) {
      learners_dropped += 1;
      remove_learner(id, "dropped after " + std::to_string(opt.heartbeat_timeout.count() / 1000.0) +
                             " s without a message");
    }
  }

  // ---- messages ----------------------------------------------------------------
  void handle(const std::string& id, const std::vector<Frame>& frames) {
    Decoded d = decode(frames, opt.max_payload_bytes);
    if (d.reject != Reject::None) {
      // Only answer peers whose header we could read; garbage gets no reply.
      const bool header_ok = d.reject != Reject::FrameCount && d.reject != Reject::HeaderSize &&
                             d.reject != Reject::Magic && d.reject != Reject::Type;
      reject(d.reject, d.detail, header_ok ? &id : nullptr, d.msg.header.seq);
      return;
    }
    const Header& h = d.msg.header;
    const uint32_t learner = h.sender;
    const bool known = agg.registered(learner);
    if (known) last_seen[learner] = Clock::now();
    switch (h.type) {
      case MsgType::Hello: return on_hello(id, d.msg);
      case MsgType::Pull:
        if (!known && !((h.flags & kObserver) && welcomed.count(id)))
          return reject(Reject::UnknownLearner, "pull from unregistered learner " + std::to_string(learner), &id, h.seq);
        {
          Held hp{id, learner, h.seq, h.flags};
          held.erase(std::remove_if(held.begin(), held.end(), [&](const Held& o) { return o.identity == id; }),
                     held.end());
          if (pull_may_go(hp)) answer_pull(id, learner, h.seq, h.flags);
          else held.push_back(hp);
          held_peak = std::max(held_peak, held.size());
        }
        return;
      case MsgType::Push: return on_push_part(id, d.msg, known);
      case MsgType::Heartbeat:
        // An observer (a finisher after its goodbye) may check that the
        // shard is alive; it is answered but not registered.
        if (!known && !((h.flags & kObserver) && welcomed.count(id)))
          return reject(Reject::UnknownLearner, "heartbeat from unregistered learner " + std::to_string(learner), &id, h.seq);
        return send_json(id, MsgType::Heartbeat, h.seq, json::object());
      case MsgType::Bye:
        remove_learner(learner, "left");
        last_push_seq.erase(learner);  // the process is gone for good
        incarnation.erase(learner);
        return;
      default:
        return reject(Reject::Protocol, std::string("a shard does not accept '") + type_name(h.type) + "' messages", &id, h.seq);
    }
  }

  void on_hello(const std::string& id, const Message& m) {
    json meta = json::parse(m.meta.empty() ? "{}" : m.meta);
    std::string theirs = meta.value("fingerprint", std::string());
    std::string ours = hex64(fp.hash);
    int64_t their_total = meta.value("total", int64_t{-1});
    if (theirs != ours || their_total != total) {
      std::string reason = "model mismatch: shard " + std::to_string(opt.shard) + " serves " + fp.description +
                           " (" + std::to_string(total) + " floats, fingerprint " + ours + "); the learner has " +
                           meta.value("model", std::string("?")) + " (" + std::to_string(their_total) +
                           " floats, fingerprint " + theirs + ")";
      rejected[static_cast<int>(Reject::Protocol)] += 1;
      log_warn("shard " + std::to_string(opt.shard) + ": refused learner " + std::to_string(m.header.sender) + ": " + reason);
      return send_json(id, MsgType::Refuse, m.header.seq, {{"reason", reason}});
    }
    const uint32_t learner = m.header.sender;
    const std::string inc = meta.value("incarnation", std::string());
    auto known_inc = incarnation.find(learner);
    if (!inc.empty() && known_inc != incarnation.end() && known_inc->second != inc) {
      // A new process with an old id (restarted by hand or by a launcher):
      // what its predecessor left (registration, leases, a push in parts,
      // held pulls, sequence numbers) is gone with it.
      remove_learner(learner, "restarted (a new process with the same id)");
      last_push_seq.erase(learner);
      held.erase(std::remove_if(held.begin(), held.end(), [&](const Held& h) { return h.learner == learner; }),
                 held.end());
    }
    if (!inc.empty()) incarnation[learner] = inc;
    if (welcomed.insert(id).second) {
      welcomed_order.push_back(id);
      if (welcomed_order.size() > kMaxRemembered) {
        welcomed.erase(welcomed_order.front());
        welcomed_order.pop_front();
      }
    }
    forget_departed();
    if (agg.add_learner(learner))
      log_info("shard " + std::to_string(opt.shard) + ": learner " + std::to_string(learner) + " joined (lambda = " +
               std::to_string(agg.learners()) + ", c = " + std::to_string(agg.c()) + ")");
    last_seen[learner] = Clock::now();
    send_json(id, MsgType::Welcome, m.header.seq,
              {{"shard", opt.shard}, {"shards", opt.shards}, {"offset", range.offset}, {"numel", range.numel},
               {"clock", agg.clock()}, {"learners", agg.learners()},
               {"protocol", protocol_name(opt.agg.protocol)}, {"softsync_n", opt.agg.softsync_n}});
  }

  // One part of a push: checked and kept by the assembler, applied to the
  // next version when its push is the one streamed; the last part completes it.
  void on_push_part(const std::string& id, const Message& m, bool known) {
    const Header& h = m.header;
    if (!known) {
      // Only the first part is answered: the learner registers again and re-sends.
      return reject(Reject::UnknownLearner, "push from unregistered learner " + std::to_string(h.sender),
                    h.offset == 0 ? &id : nullptr, h.seq);
    }
    auto seen = last_push_seq.find(h.sender);
    auto r = pushes->add(m, seen == last_push_seq.end() ? 0 : seen->second);
    if (r.outcome == PushAssembler::Result::Outcome::Added) push_payload_bytes += static_cast<int64_t>(m.payload.size);
    using Outcome = PushAssembler::Result::Outcome;
    if (r.outcome == Outcome::Duplicate) return send_json(id, MsgType::PushAck, h.seq, {{"status", "duplicate"}});
    if (r.outcome == Outcome::Ignored) return;
    if (r.ended || r.first) stop_streaming(h.sender);  // a new push abandons the one under way
    if (r.outcome == Outcome::Rejected) return reject(r.reject, r.why, &id, h.seq);
    if (r.first && !r.complete) maybe_stream(h);
    if (streamed == h.sender) {
      if (state->current(step)) state->step_part(step, r.part);
      else stop_streaming(h.sender);  // overtaken by another update: made again from the parts at the end
    }
    if (!r.complete) return;
    PartedPush push = pushes->take(h.sender);
    on_push(id, push);
  }

  // The buffers sent with an accepted gradient (shard 0), counted in the
  // update it belongs to; the gradient itself stands either way.
  void take_buffers(const PartedPush& push) {
    if (opt.shard != 0 || push.buffers.size == 0) return;
    const Frame b = aligned_frame(push.buffers, alignof(float));
    const size_t n = b.size / sizeof(float);
    json meta = json::parse(push.meta.empty() ? "{}" : push.meta, nullptr, /*allow_exceptions=*/false);
    const int64_t averaged = meta.is_object() ? meta.value("averaged", static_cast<int64_t>(n)) : -1;
    if (buffers.add(reinterpret_cast<const float*>(b.data), n, averaged)) return;
    if (++buffers_refused <= 3)
      log_warn("shard 0: buffers sent by learner " + std::to_string(push.head.sender) +
               " do not fit (another model, or damaged); the gradient is kept, its buffers are not");
  }

  void stop_streaming(uint32_t learner) {
    if (streamed != learner) return;
    state->abandon(step);
    streamed.reset();
  }

  // Streams a push that would, as things stand, make an update alone.
  void maybe_stream(const Header& h) {
    if (streamed || !state->streams()) return;
    Aggregator trial = agg;
    auto o = trial.offer(h.sender, h.clock);
    if (o.outcome != Aggregator::Offer::Accepted || trial.pending() != 1 || !trial.ready()) return;
    step = state->begin_step(o.alpha);
    streamed = h.sender;
  }

  void on_push(const std::string& id, const PartedPush& push) {
    const Header& h = push.head;
    const bool was_streamed = streamed == h.sender;
    if (was_streamed) streamed.reset();  // `step` is finished or abandoned below
    // A NaN/Inf gradient is never applied; its batch counts as used (a
    // diverged model would otherwise get the same batch back forever).
    auto non_finite = [&] {
      if (leases && h.aux >= 0) leases->complete(h.aux);
      last_push_seq[h.sender] = h.seq;
      reject(Reject::NonFinite, "gradient from learner " + std::to_string(h.sender) + " has NaN or Inf", &id, h.seq);
    };
    auto offer = agg.offer(h.sender, h.clock);
    if (offer.outcome == Aggregator::Offer::Rejected) {
      if (was_streamed) state->abandon(step);
      return reject(Reject::Protocol, offer.why, &id, h.seq);
    }
    last_push_seq[h.sender] = h.seq;
    if (leases && h.aux >= 0) leases->complete(h.aux);
    json ack = {{"tau", offer.tau}};
    if (offer.outcome == Aggregator::Offer::Dropped) {
      if (was_streamed) state->abandon(step);
      dropped += 1;
      ack["status"] = "dropped";
    } else {
      // One gradient that makes the update alone is applied straight from the
      // message buffers (the finite check rides along that pass); a streamed
      // step already holds that update unless another update came first.
      const bool single = agg.pending() == 1 && agg.ready();
      bool ok;
      // The same rate (both from the aggregator, in double) is the same update.
      if (was_streamed && single && state->current(step) && step.alpha == offer.alpha) {
        ok = state->finish_step(step);
        updates_streamed += ok;
      } else {
        if (was_streamed) state->abandon(step);
        ok = single ? state->step_single(push.parts, offer.alpha) : state->accumulate(push.parts, offer.alpha);
      }
      if (!ok) {
        agg.retract(h.sender, h.clock);
        return non_finite();
      }
      take_buffers(push);
      if (single) finish_update(agg.commit());
      accepted += 1;
      grads_per_learner[h.sender] += 1;
      ack["status"] = "accepted";
    }
    send_json(id, MsgType::PushAck, h.seq, ack);
    maybe_update();
    service_held();
  }

  // ---- statistics, checkpoints -----------------------------------------------------
  int64_t rejected_total() const {
    int64_t n = 0;
    for (auto r : rejected) n += r;
    return n;
  }

  void log_window() {
    double secs = seconds_since(window_start);
    json line = {{"kind", "ps_updates"}, {"shard", opt.shard}, {"clock", agg.clock()}, {"updates", window_updates},
                 {"updates_per_second", secs > 0 ? window_updates / secs : 0.0},
                 {"busy_fraction", secs > 0 ? (busy - window_busy) / secs : 0.0},
                 {"learners", agg.learners()}, {"c", agg.c()}, {"staleness_hist", hist_to_json(hist_window)},
                 {"accepted", accepted}, {"dropped", dropped}, {"rejected", rejected_total()},
                 {"elapsed", seconds_since(start)}};
    if (leases) line["epoch"] = leases->epoch_progress();
    append_line(metrics_path, line.dump());
    hist_window.clear();
    window_updates = 0;
    window_start = Clock::now();
    window_busy = busy;
  }

  json summary() const {
    const StalenessStats st = staleness_stats(hist_total);
    json rej = json::object();
    for (int i = 1; i < kRejectKinds; ++i)
      if (rejected[i]) rej[reject_name(static_cast<Reject>(i))] = rejected[i];
    json per = json::object();
    for (const auto& [l, c] : grads_per_learner) per[std::to_string(l)] = c;
    double wall = seconds_since(start);
    json s = {{"shard", opt.shard}, {"shards", opt.shards}, {"offset", range.offset}, {"numel", range.numel},
              {"protocol", protocol_name(opt.agg.protocol)}, {"softsync_n", opt.agg.softsync_n},
              {"staleness_policy", policy_name(opt.agg.policy)}, {"clock", agg.clock()}, {"updates", updates},
              {"gradients_accepted", accepted}, {"gradients_dropped", dropped},
              {"gradients_rejected", rejected_total()}, {"rejected_by_reason", rej},
              {"staleness_mean", st.mean}, {"staleness_p99", st.p99},
              {"staleness_max", st.max}, {"staleness_hist", hist_to_json(hist_total)},
              {"updates_per_second", wall > 0 ? updates / wall : 0.0}, {"busy_fraction", wall > 0 ? busy / wall : 0.0},
              {"wall_seconds", wall}, {"gradients_per_learner", per}, {"learners_dropped", learners_dropped},
              {"checkpoints", checkpoints}, {"held_pulls_peak", held_peak},
              {"push_payload_bytes", push_payload_bytes}, {"weights_payload_bytes", weights_payload_bytes},
              {"updates_streamed", updates_streamed}};
    if (transport && keys.enabled()) {
      s["curve_peers_accepted"] = transport->zap_accepted();
      s["curve_peers_refused"] = transport->zap_refused();
    }
    if (leases) s["epoch"] = leases->epoch_progress();
    return s;
  }

  void checkpoint() {
    json meta = {{"shard", opt.shard}, {"shards", opt.shards}, {"offset", range.offset}, {"numel", range.numel},
                 {"total", total}, {"fingerprint", hex64(fp.hash)}, {"clock", agg.clock()}, {"updates", updates},
                 {"accepted", accepted}, {"dropped", dropped}, {"hist", hist_to_json(hist_total)}};
    if (leases) meta["leases"] = leases_to_json(leases->snapshot());
    buffers.write(meta);
    write_shard_checkpoint(opt.dir + "/checkpoint.bin", meta, state->weights()->data_ptr<float>(),
                           state->optimizer(), range.numel);
    write_file_atomic(opt.dir + "/summary.json", summary().dump(2) + "\n");
    last_ckpt_clock = agg.clock();
    checkpoints += 1;
  }

  bool restore() {
    const std::string path = opt.dir + "/checkpoint.bin";
    if (!file_exists(path)) return false;
    ShardCheckpoint c = read_shard_checkpoint(path, range.numel);
    const json& meta = c.meta;
    if (meta["shard"] != opt.shard || meta["shards"] != opt.shards || meta["numel"] != range.numel ||
        meta["fingerprint"] != hex64(fp.hash))
      throw InvalidInput("shard checkpoint '" + path + "': written for shard " + meta["shard"].dump() + " of " +
                         meta["shards"].dump() + " of model " + meta["fingerprint"].dump() + ", this is shard " +
                         std::to_string(opt.shard) + " of " + std::to_string(opt.shards) + " of model " +
                         hex64(fp.hash));
    const auto names = state->optimizer().state_names();
    if (!c.state.empty() && c.state_names != names)
      throw InvalidInput("shard checkpoint '" + path + "' holds the state of another optimizer (" +
                         nlohmann::json(c.state_names).dump() + "; this shard's optimizer '" +
                         state->optimizer().algorithm() + "' keeps " + nlohmann::json(names).dump() + ")");
    state->restore(c.weights.data(), c.state, c.steps);
    agg.set_clock(meta["clock"].get<uint64_t>());
    last_ckpt_clock = agg.clock();
    updates = meta["updates"];
    accepted = meta["accepted"];
    dropped = meta["dropped"];
    hist_total.clear();
    add_hist_json(hist_total, meta["hist"]);
    if (leases && meta.contains("leases")) leases->restore(leases_from_json(meta["leases"]));
    buffers.restore(meta);
    return true;
  }
};

Server::Server(ServerOptions opt, ModelFingerprint fp, const float* initial, int64_t total, CurveKeys keys)
    : impl_(std::make_unique<Impl>(std::move(opt), std::move(fp), std::move(keys))) {
  Impl& s = *impl_;
  if (s.opt.dir.empty()) throw InvalidInput("ps-server needs a directory for its checkpoint and metrics");
  if (s.opt.shard < 0 || s.opt.shard >= s.opt.shards)
    throw InvalidInput("--shard " + std::to_string(s.opt.shard) + " is not in [0, " + std::to_string(s.opt.shards) + ")");
  s.total = total;
  s.range = partition(total, s.opt.shards)[s.opt.shard];
  s.pushes = std::make_unique<PushAssembler>(s.range.numel);
  s.state = std::make_unique<ShardState>(s.range.numel, initial + s.range.offset,
                                         UpdateOptions{s.opt.agg.alpha0, s.opt.optimizer, s.opt.decay_at_base_rate});
  if (s.opt.shard == 0 && s.opt.dataset_size > 0)
    s.leases = std::make_unique<LeaseBook>(s.opt.dataset_size, s.opt.batch, s.opt.epochs);
  make_dirs(s.opt.dir);
  s.metrics_path = s.opt.dir + "/metrics.jsonl";
  if (s.opt.resume && s.restore())
    log_info("shard " + std::to_string(s.opt.shard) + ": resumed from its checkpoint at clock " +
             std::to_string(s.agg.clock()));
  s.transport = std::make_unique<Transport>(s.keys);
  // ZeroMQ drops a peer that sends a larger frame: a payload (ps.max_message_mb),
  // the meta, or a model's buffers (kMaxBufferFloats, whatever ps.max_message_mb says).
  const uint64_t largest_frame = std::max<uint64_t>(s.opt.max_payload_bytes, kMaxBufferFloats * sizeof(float));
  s.sock = std::make_unique<Socket>(*s.transport, Socket::Kind::Router, largest_frame + kMaxMetaBytes + 4096);
  s.endpoint = s.sock->bind(s.opt.bind);
  write_file_atomic(s.opt.dir + "/endpoint", s.endpoint + "\n");
}

Server::~Server() = default;

std::string Server::endpoint() const { return impl_->endpoint; }

void Server::run(const std::atomic<bool>& stop) {
  Impl& s = *impl_;
  log_info("shard " + std::to_string(s.opt.shard) + "/" + std::to_string(s.opt.shards) + " serving floats [" +
           std::to_string(s.range.offset) + ", " + std::to_string(s.range.offset + s.range.numel) + ") on " +
           s.endpoint + " (" + protocol_name(s.opt.agg.protocol) +
           (s.opt.agg.protocol == Protocol::Softsync ? " n=" + std::to_string(s.opt.agg.softsync_n) : std::string()) +
           ", " + policy_name(s.opt.agg.policy) + " learning rate" + (s.keys.enabled() ? ", CURVE" : "") + ")");
  std::vector<Frame> frames;
  std::string id;
  auto last_sweep = Clock::now();
  while (!stop) {
    bool got = false;
    try {
      got = s.sock->recv(frames, &id, 50);
    } catch (const Error& e) {
      log_warn(std::string("shard receive failed: ") + e.what());
    }
    if (got) {
      auto t0 = Clock::now();
      try {
        s.handle(id, frames);
      } catch (const std::exception& e) {
        // A well-formed frame with bad meta content ends up here: count it, keep serving.
        s.reject(Reject::Protocol, e.what(), nullptr, 0);
      }
      frames.clear();
      s.busy += seconds_since(t0);
    }
    if (seconds_since(last_sweep) > 0.1) {
      s.sweep();
      last_sweep = Clock::now();
    }
  }
  s.checkpoint();
  log_info("shard " + std::to_string(s.opt.shard) + ": stopped at clock " + std::to_string(s.agg.clock()) + " after " +
           std::to_string(s.updates) + " updates");
}

}  // namespace limbo::ps
