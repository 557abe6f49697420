#include "ps/worker.h"
#include "ps/heartbeats.h"

#include <torch/torch.h>

#include <unistd.h>

#include <algorithm>
#include <random>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <thread>

#include "common/error.h"
#include "common/timing.h"
#include "common/files.h"
#include "common/half.h"
#include "common/log.h"
#include "data/loader.h"
#include "ps/buffer_mean.h"
#include "ps/push_residual.h"
#include "ps/shard_state.h"
#include "train/checkpoint.h"

namespace limbo::ps {
namespace {

using json = nlohmann::json;


// Coefficient of variation (std / mean) of per-step times from their sum and sum of squares.
double cv_of(double sum, double squares, int64_t n) {
  if (n < 2 || sum <= 0) return 0;
  const double mean = sum / n, var = std::max(0.0, squares / n - mean * mean);
  return std::sqrt(var) / mean;
}

struct Link {
  int index = 0;
  std::string endpoint;
  std::unique_ptr<Socket> sock;
  int64_t offset = 0, numel = 0;
  uint64_t clock = 0;  // clock of the weights last pulled from this shard
  uint64_t seq = 0;
  std::vector<uint16_t> wire;  // this shard's gradient slice in 16 bits (comm.compression)
};

HalfKind half_kind(uint8_t encoding) { return (encoding & kBf16Values) ? HalfKind::Bf16 : HalfKind::Fp16; }

class Learner {
 public:
  Learner(train::Trainer& t, const train::TrainerConfig& cfg, const WorkerOptions& opt, const CurveKeys& keys)
      : t_(t), cfg_(cfg), opt_(opt), transport_(keys) {
    fp_ = model_fingerprint(cfg.model.name, t.params());
    for (size_t k = 0; k < opt.servers.size(); ++k) {
      auto l = std::make_unique<Link>();
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
    if (covered != t.params().numel())
      throw InvalidInput("the " + std::to_string(links_.size()) + " shard(s) given cover " + std::to_string(covered) +
                         " of the model's " + std::to_string(t.params().numel()) +
                         " floats (is a shard missing from --servers?)");
  }

  json run(const std::atomic<bool>& stop);

 private:
  Header header(MsgType type, Link& l) {
    Header h;
    h.type = type;
    h.sender = opt_.learner_id;
    h.shard = static_cast<uint32_t>(l.index);
    h.seq = ++l.seq;
    return h;
  }

  void send_hello(Link& l, uint64_t* seq) {
    Header h = header(MsgType::Hello, l);
    *seq = h.seq;
    json meta = {{"fingerprint", hex64(fp_.hash)}, {"model", fp_.description}, {"total", t_.params().numel()},
                 {"incarnation", incarnation_}};
    l.sock->send(nullptr, h, meta.dump(), nullptr, 0);
  }

  // Registers with a shard (blocking); throws InvalidInput when refused.
  void hello(Link& l) {
    uint64_t seq;
    send_hello(l, &seq);
    Message m = await(l, seq, MsgType::Welcome, [&] { send_hello(l, &seq); return seq; }, Waiting::Hello);
    if (m.meta.empty()) throw PeerFailure("shard " + std::to_string(l.index) + " sent an empty welcome");
    json w = json::parse(m.meta);
    l.offset = w["offset"];
    l.numel = w["numel"];
  }

  // How a learner waits for a reply: as a registered learner (heartbeats;
  // registers again when the shard no longer knows it), while registering
  // (hellos are repeated), or as an observer after its goodbye (the final
  // pull: observer heartbeats, which never register it again, so the shard
  // can see every learner gone).
  enum class Waiting { Learner, Hello, Observer };

  // Waits for the reply `seq` of type `want` from a shard, sending heartbeats
  // while waiting. When the shard no longer knows this learner (it restarted
  // or dropped us), registers again and calls `resend` for a new seq.
  template <typename Resend>
  Message await(Link& l, uint64_t seq, MsgType want, Resend resend, Waiting waiting = Waiting::Learner) {
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

  uint64_t send_pull(Link& l, uint8_t flags) {
    Header h = header(MsgType::Pull, l);
    // Training pulls may come in 16 bits; the final weights never do.
    h.flags = (flags & kFinal) ? flags : flags | opt_.pull_encoding;
    l.sock->send(nullptr, h, "", nullptr, 0);
    return h.seq;
  }

  // Receives the reply to pull `seq` (re-sent through `resend` when the
  // shard lost it), part by part, each part copied into the flat parameters
  // as it arrives while the next one is still in transit. Returns the first
  // part's message (its meta carries the lease).
  template <typename Resend>
  Message receive_weights(Link& l, uint64_t seq, Resend resend, Waiting waiting = Waiting::Learner) {
    float* flat = t_.params().data().data_ptr<float>() + l.offset;
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
        const uint16_t* src = reinterpret_cast<const uint16_t*>(m.payload.data);
        std::vector<uint16_t> aligned;
        if (reinterpret_cast<uintptr_t>(src) % alignof(uint16_t) != 0) {  // ZeroMQ may hand out any offset
          aligned.resize(static_cast<size_t>(n));
          std::memcpy(aligned.data(), m.payload.data, m.payload.size);
          src = aligned.data();
        }
        halves_to_floats(half_kind(m.header.flags), src, flat + got, static_cast<size_t>(n));
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
    if (l.index == 0) take_buffers(first.meta);
    return first;
  }

  // Sends this learner's gradient slice to a shard in parts, straight from
  // the gradient buffer (`keep` counts the sends in flight).
  template <typename Keep>
  uint64_t send_push(Link& l, const float* g, int64_t lease_id, const std::string& meta, Keep keep) {
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
      if (enc) residual_.encode(half_kind(enc), g, t_.params().numel(), l.offset + o, k, l.wire.data() + o);
      h.offset = static_cast<uint64_t>(o);
      h.flags = (o + k < l.numel ? kMoreParts : 0) | enc;
      const std::string& m = o == 0 ? meta : kNoMeta;
      const bool sent = enc ? l.sock->send(nullptr, h, m, l.wire.data() + o, static_cast<size_t>(k) * 2, keep())
                            : l.sock->send(nullptr, h, m, g + l.offset + o, static_cast<size_t>(k) * 4, keep());
      if (!sent) break;
    }
    return h.seq;
  }

  // The metadata of a push to shard 0: this learner's buffers, as its
  // forward left them (see buffer_mean.h). Empty for a model without any.
  std::string buffers_meta() {
    auto& flat = t_.params();
    if (flat.buffer_numel() == 0) return {};
    flat.buffers_to_flat();
    return json{{"buffers", floats_to_base64(flat.buffers().data_ptr<float>(), static_cast<size_t>(flat.buffer_numel()))},
                {"averaged", flat.averaged_numel()}}
        .dump();
  }

  // Shard 0's buffers (from a weights reply) become this learner's.
  void take_buffers(const std::string& meta_text) {
    auto& flat = t_.params();
    if (flat.buffer_numel() == 0 || meta_text.empty()) return;
    json meta = json::parse(meta_text, nullptr, /*allow_exceptions=*/false);
    auto b = meta.is_object() ? meta.find("buffers") : meta.end();
    if (!meta.is_object() || b == meta.end()) return;  // none yet: this learner's stand
    std::vector<float> v;
    if (!b->is_string() || !base64_to_floats(b->get<std::string>(), v) ||
        static_cast<int64_t>(v.size()) != flat.buffer_numel())
      throw PeerFailure("shard 0 sent buffers that do not fit this model (" + std::to_string(v.size()) +
                        " floats; it has " + std::to_string(flat.buffer_numel()) + ")");
    std::copy(v.begin(), v.end(), flat.buffers().data_ptr<float>());
    flat.flat_to_buffers();
  }

  // A shard refused this learner's last gradient as not finite (NaN or
  // inf: its update was skipped), or every shard took it. Too many in a
  // row: the learner's model has diverged.
  void note_finite(bool finite, int64_t steps) {
    if (finite) {
      nonfinite_in_a_row_ = 0;
      return;
    }
    nonfinite_ += 1;
    nonfinite_in_a_row_ += 1;
    const int64_t limit = cfg_.train.max_nonfinite_steps;
    if (limit > 0 && nonfinite_in_a_row_ >= limit)
      throw Diverged("learner " + std::to_string(opt_.learner_id) + ": " + std::to_string(nonfinite_in_a_row_) +
                     " gradients in a row (up to its step " + std::to_string(steps) +
                     ") were not finite and were refused by the shards; the model has diverged. Lower "
                     "optim.lr or check the data for NaN or inf (train.max_nonfinite_steps sets how many are "
                     "allowed)");
  }

  void bye() {
    heartbeats_.reset();  // no heartbeat may follow the goodbye
    for (auto& l : links_) l->sock->send(nullptr, header(MsgType::Bye, *l), "", nullptr, 0);
  }


  train::Trainer& t_;
  const train::TrainerConfig& cfg_;
  WorkerOptions opt_;
  Transport transport_;
  ModelFingerprint fp_;
  // This process, for the shards: a learner restarted with the same id is
  // told apart from a re-registration of this one (sequence numbers restart).
  const std::string incarnation_ = [] {
    std::random_device rd;
    return hex64((static_cast<uint64_t>(rd()) << 32) ^ rd() ^ static_cast<uint64_t>(::getpid()));
  }();
  std::vector<std::unique_ptr<Link>> links_;
  PushResidual residual_;  // error feedback of 16-bit pushes, over the whole gradient
  int64_t nonfinite_ = 0, nonfinite_in_a_row_ = 0;  // gradients refused as not finite
  inline static const std::string kNoMeta;
  std::unique_ptr<Heartbeats> heartbeats_;  // after transport_: stopped before it goes
};

json Learner::run(const std::atomic<bool>& stop) {
  heartbeats_ = std::make_unique<Heartbeats>(transport_, opt_.servers, opt_.learner_id, opt_.heartbeat_interval);
  auto& flat = t_.params();
  auto& model = t_.model();
  const auto& train_set = t_.data().train;
  data::Sampler sampler(train_set.size(), cfg_.loader.order, cfg_.loader.seed);
  const std::string tag = "learner " + std::to_string(opt_.learner_id);
  std::string metrics;
  if (!opt_.run_dir.empty()) {
    make_dirs(opt_.run_dir + "/learners");
    metrics = opt_.run_dir + "/learners/" + std::to_string(opt_.learner_id) + ".jsonl";
  }
  // Payloads go out from the gradient buffer without a copy: count sends in
  // flight and never write the buffer while one is.
  auto in_flight = std::make_shared<std::atomic<int>>(0);
  auto keep_grad = [&] {
    in_flight->fetch_add(1);
    return std::shared_ptr<void>(static_cast<void*>(in_flight.get()), [c = in_flight](void*) { c->fetch_sub(1); });
  };

  int64_t steps = 0, samples = 0, accepted = 0, dropped = 0, lost = 0, rejected = 0, tau_sum = 0, tau_n = 0;
  double loss_sum = 0;
  train::MetricsWindow window;
  auto start = Clock::now();
  bool finisher = false, done = false;

  // The first pull; later pulls go out together with the pushes.
  std::vector<uint64_t> pull_seq(links_.size());
  for (auto& l : links_) pull_seq[l->index] = send_pull(*l, l->index == 0 ? kWantLease : 0);
  std::vector<uint64_t> push_seq(links_.size(), 0);
  int64_t lease_id = -1;
  json lease;

  // Where a learner's time goes (the simulator is calibrated from these):
  // computing (batch, forward, backward) and waiting for the shards.
  double compute_seconds = 0, compute_squares = 0, wait_seconds = 0, wait_squares = 0;
  for (;;) {
    // Acknowledgements of the previous push, then the weights of this step.
    auto wait0 = Clock::now();
    bool acked = false, not_finite = false;  // the last push, on any shard
    for (auto& l : links_) {
      Link& L = *l;
      const uint8_t flags = L.index == 0 ? kWantLease : 0;
      if (push_seq[L.index]) {
        Message ack = await(L, push_seq[L.index], MsgType::PushAck, [&] {
          pull_seq[L.index] = send_pull(L, flags);  // the pull sent with the push was lost too
          return uint64_t{0};
        });
        json a = json::parse(ack.meta);
        std::string st = a.value("status", std::string());
        if (st == "accepted") residual_.commit(L.offset, L.numel);
        acked = true;
        not_finite = not_finite || a.value("code", std::string()) == "non_finite";
        if (L.index == 0) {
          if (st == "accepted") accepted += 1;
          else if (st == "dropped") dropped += 1;
          else if (st == "lost") lost += 1;
          else if (st == "rejected") {
            rejected += 1;
            if (rejected <= 3 || (rejected & (rejected - 1)) == 0)
              log_warn(tag + ": shard 0 rejected a gradient (" + std::to_string(rejected) + " so far): " +
                       a.value("reason", std::string("?")));
          }
          if (a.contains("tau")) {
            tau_sum += a["tau"].get<int64_t>();
            tau_n += 1;
          }
        }
        push_seq[L.index] = 0;
      }
      Message w = receive_weights(L, pull_seq[L.index], [&] { return pull_seq[L.index] = send_pull(L, flags); });
      if (L.index == 0) {
        json meta = w.meta.empty() ? json::object() : json::parse(w.meta);
        lease = meta.value("lease", json());
        std::string state = meta.value("lease_state", std::string());
        if (state == "done") {
          done = true;
          finisher = meta.value("finisher", false);
        }
      }
    }
    if (acked) note_finite(!not_finite, steps);
    const double step_wait = seconds_since(wait0);
    wait_seconds += step_wait;
    wait_squares += step_wait * step_wait;
    if (done || stop || (opt_.max_steps > 0 && steps >= opt_.max_steps)) break;
    if (lease.is_null()) {  // all batches are out; some may come back
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
      for (auto& l : links_) pull_seq[l->index] = send_pull(*l, l->index == 0 ? kWantLease : 0);
      continue;
    }
    lease_id = lease["id"];
    const int64_t epoch = lease["epoch"], position = lease["position"], count = lease["count"];
    const auto& order = sampler.epoch_order(epoch);
    if (position < 0 || count < 1 || position + count > static_cast<int64_t>(order.size()))
      throw PeerFailure("shard 0 handed out an invalid batch (epoch " + std::to_string(epoch) + ", position " +
                        std::to_string(position) + ", count " + std::to_string(count) + ")");
    auto compute0 = Clock::now();
    std::vector<int64_t> ids(order.begin() + position, order.begin() + position + count);
    auto batch = data::make_train_batch(train_set, t_.normalization(), ids, epoch, cfg_.loader.augment);

    while (in_flight->load() > 0) std::this_thread::yield();
    const double lv = t_.step().gradient(batch);
    const double step_compute = seconds_since(compute0);
    compute_seconds += step_compute;
    compute_squares += step_compute * step_compute;

    const float* g = flat.grad().data_ptr<float>();
    const std::string meta0 = buffers_meta();
    for (auto& l : links_)
      push_seq[l->index] = send_push(*l, g, lease_id, l->index == 0 ? meta0 : kNoMeta, keep_grad);
    steps += 1;
    samples += count;
    if (cfg_.train.pause_at_step > 0 && steps == cfg_.train.pause_at_step) {
      // Testing aid: stops between batches (the step's gradient sent, no
      // next batch asked for), still sending heartbeats from their thread.
      std::fprintf(stderr, "paused at step %lld\n", static_cast<long long>(steps));
      std::fflush(stderr);
      for (;;) std::this_thread::sleep_for(std::chrono::seconds(1));
    }
    for (auto& l : links_) pull_seq[l->index] = send_pull(*l, l->index == 0 ? kWantLease : 0);
    loss_sum += lv;
    window.add(lv, count);
    if (window.steps() >= opt_.log_every && !metrics.empty()) {
      train::StepRecord rec;
      rec.step = steps;
      rec.epoch = static_cast<double>(epoch);
      rec.samples = samples;
      rec.batch_size = count;
      rec.skipped_steps = nonfinite_;
      json line = train::step_record(rec, window, "learner");
      line["learner"] = opt_.learner_id;
      line["staleness_mean"] = tau_n ? static_cast<double>(tau_sum) / tau_n : 0.0;
      line["gradients_dropped"] = dropped;
      line["elapsed"] = seconds_since(start);
      append_line(metrics, line.dump());
      window.reset();
    }
  }
  // Outstanding pushes were acknowledged above; leave every shard.
  while (in_flight->load() > 0) std::this_thread::yield();
  bye();
  const double secs = seconds_since(start);
  json summary = {{"learner", opt_.learner_id}, {"steps", steps}, {"samples", samples},
                  {"samples_per_second", secs > 0 ? samples / secs : 0.0}, {"seconds", secs},
                  {"mean_loss", steps ? loss_sum / steps : 0.0}, {"gradients_accepted", accepted},
                  {"gradients_dropped", dropped}, {"gradients_lost", lost}, {"gradients_rejected", rejected},
                  {"skipped_steps", nonfinite_},
                  {"staleness_mean_seen", tau_n ? static_cast<double>(tau_sum) / tau_n : 0.0},
                  {"finisher", finisher},
                  {"compute_seconds_per_step", steps ? compute_seconds / steps : 0.0},
                  {"compute_cv", cv_of(compute_seconds, compute_squares, steps)},
                  {"wait_cv", cv_of(wait_seconds, wait_squares, steps)},
                  {"wait_seconds_per_step", steps ? wait_seconds / steps : 0.0}};
  log_info(tag + ": left after " + std::to_string(steps) + " steps (" + std::to_string(samples) + " samples, " +
           std::to_string(static_cast<int64_t>(secs > 0 ? samples / secs : 0)) + " samples/s)");
  if (!opt_.run_dir.empty())
    write_file_atomic(opt_.run_dir + "/learners/" + std::to_string(opt_.learner_id) + ".summary.json",
                      summary.dump(2) + "\n");
  if (finisher && !opt_.run_dir.empty()) {
    // Final weights: answered by each shard once no learner is registered.
    std::vector<uint64_t> seqs;
    for (auto& l : links_) seqs.push_back(send_pull(*l, kObserver | kFinal));
    uint64_t clock0 = 0;
    for (auto& l : links_) {
      Link& L = *l;
      Message w = receive_weights(L, seqs[L.index], [&] { return seqs[L.index] = send_pull(L, kObserver | kFinal); },
                                  Waiting::Observer);
      if (L.index == 0) clock0 = w.header.clock;
    }
    auto ev = t_.evaluate_test();
    train::TrainState st;
    st.step = static_cast<int64_t>(clock0);
    st.cursor = {cfg_.train.epochs, 0};
    st.config_toml = cfg_.config_toml;
    train::save_checkpoint(opt_.run_dir + "/checkpoint.pt", model, t_.sgd(), st);
    json fin = {{"test_accuracy", std::isnan(ev.accuracy) ? json() : json(ev.accuracy)}, {"test_loss", ev.loss}, {"test_samples", ev.samples},
                {"clock_shard0", clock0}, {"learner", opt_.learner_id}};
    write_file_atomic(opt_.run_dir + "/final.json", fin.dump(2) + "\n");
    log_info(tag + ": final test accuracy " + std::to_string(100 * ev.accuracy) + "%");
    summary["test_accuracy"] = std::isnan(ev.accuracy) ? json() : json(ev.accuracy);
    summary["test_loss"] = ev.loss;
  }
  return summary;
}

}  // namespace

json run_worker(train::Trainer& trainer, const train::TrainerConfig& cfg, const WorkerOptions& opt,
                const CurveKeys& keys, const std::atomic<bool>& stop) {
  if (opt.servers.empty()) throw InvalidInput("a worker needs --servers (the shards' endpoints, in shard order)");
  Learner l(trainer, cfg, opt, keys);
  return l.run(stop);
}

}  // namespace limbo::ps
