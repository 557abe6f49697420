// Parameter-server round trip: a learner's push (gradient) + pull (weights)
// against a real shard on loopback (ps::Server on its own thread, softsync
// n = 1, so every push is also an update), done as a learner does it: the
// push goes out in parts of ps.part_mb, the weights come back in parts and
// are copied into the learner's flat parameters. Baselines, raw ZeroMQ
// moving the same bytes without copies (a DEALER sends N floats, a ROUTER
// echoes N floats back): as one message each way ("raw 1 msg"), and in
// the same parts as Limbo ("raw parts"), each end with its own ZeroMQ I/O
// thread as Limbo's learner and shard (two processes) have; and in parts with
// one I/O thread shared by both ends ("parts, 1 thr"), which two processes
// cannot do but which is the fastest raw figure on a 2-core machine. All are
// interleaved rep by rep so machine noise hits them alike. GB/s counts the bytes moved both ways:
// 2 * 4 * N per round trip in float32. Each size is also run with bf16
// pushes (comm.compression = bf16: 2 bytes a value, encoded with error
// feedback as a learner does), and with bf16 pulls as well
// (ps.pull_compression = bf16), against raw ZeroMQ moving the same bytes.
//
// The shard runs the default job's update: server momentum 0.9 (optim.momentum)
// and weight decay 0 (optim.weight_decay); --momentum / --weight-decay change them.
//
//   build/bench/limbo_bench_ps_roundtrip [--reps 20] [--sizes-m 1,10] [--part-mb 1]
//                                        [--momentum 0.9] [--weight-decay 0]
//                                        [--modes f32,bf16,bf16-both] [--phases 1] [--curve 1]
// --phases 1 also splits each round trip in two: until the first part of the
// answer (raw) or the push's acknowledgement (Limbo), and the rest; prints the
// spread over the reps and the CPU time of a round trip on all threads.
// --curve 1 encrypts every socket (raw ZeroMQ's too) with CURVE, as
// `limbo launch --keys` does: a wire slower than loopback's memory copies.
// LIMBO_BENCH_ONLY=limbo (or raw-parts) runs that contender alone, for a profiler.
#include "bench_args.h"

#include <zmq.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <sstream>
#include <string>
#include <thread>
#include <ctime>
#include <vector>

#include "common/files.h"
#include "common/half.h"
#include "common/log.h"
#include "common/memory.h"
#include "ps/protocol.h"
#include "ps/server.h"
#include "ps/shard_links.h"
#include "ps/shard_state.h"
#include "ps/transport.h"

namespace {

using Clock = std::chrono::steady_clock;
using json = nlohmann::json;
double since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }
// CPU time of every thread of this process, in seconds. Only one contender
// runs at a time (the others' threads wait in a poll), so its difference
// over a round trip is that round trip's CPU time on all cores.
double process_cpu() {
  timespec ts;
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) + 1e-9 * static_cast<double>(ts.tv_nsec);
}

// ---- raw ZeroMQ echo ---------------------------------------------------------------
// A DEALER sends `up` bytes in messages of at most `part_up` bytes, a ROUTER
// answers with `down` bytes in messages of at most `part_down`, without copies.
struct RawEcho {
  // One context, so one ZeroMQ I/O thread, per end, as a learner and a shard
  // (two processes) have; `shared` puts both ends on one I/O thread instead,
  // which no two processes can do, but which is faster on 2 cores: that one
  // thread makes both ends' socket copies, one after the other, in its cache.
  void* ctx = zmq_ctx_new();
  void* client_ctx;
  size_t up, down, part_up, part_down;
  void* router = nullptr;
  void* dealer = nullptr;
  std::vector<unsigned char> server_buf, client_buf;
  size_t received = 0;
  std::atomic<bool> stop{false};
  std::thread thread;

  RawEcho(size_t up_bytes, size_t down_bytes, size_t part_up_bytes, size_t part_down_bytes,
          const limbo::ps::CurveKeys& keys, bool shared = false)
      : client_ctx(shared ? ctx : zmq_ctx_new()), up(up_bytes), down(down_bytes), part_up(part_up_bytes),
        part_down(part_down_bytes), server_buf(down_bytes, 1), client_buf(up_bytes, 2) {
    router = zmq_socket(ctx, ZMQ_ROUTER);
    int zero = 0, one = 1;
    zmq_setsockopt(router, ZMQ_LINGER, &zero, sizeof zero);
    if (keys.enabled()) {  // encrypted as Limbo's sockets are under --keys (one key pair for both ends)
      zmq_setsockopt(router, ZMQ_CURVE_SERVER, &one, sizeof one);
      zmq_setsockopt(router, ZMQ_CURVE_SECRETKEY, keys.secret_key.c_str(), 40);
    }
    zmq_bind(router, "tcp://127.0.0.1:*");
    char ep[256];
    size_t len = sizeof ep;
    zmq_getsockopt(router, ZMQ_LAST_ENDPOINT, ep, &len);
    dealer = zmq_socket(client_ctx, ZMQ_DEALER);
    zmq_setsockopt(dealer, ZMQ_LINGER, &zero, sizeof zero);
    if (keys.enabled()) {
      zmq_setsockopt(dealer, ZMQ_CURVE_SERVERKEY, keys.public_key.c_str(), 40);
      zmq_setsockopt(dealer, ZMQ_CURVE_PUBLICKEY, keys.public_key.c_str(), 40);
      zmq_setsockopt(dealer, ZMQ_CURVE_SECRETKEY, keys.secret_key.c_str(), 40);
    }
    zmq_connect(dealer, ep);
    thread = std::thread([this] {
      int timeout = 100;
      zmq_setsockopt(router, ZMQ_RCVTIMEO, &timeout, sizeof timeout);
      while (!stop) {
        zmq_msg_t id, body;
        zmq_msg_init(&id);
        if (zmq_msg_recv(&id, router, 0) < 0) {
          zmq_msg_close(&id);
          continue;
        }
        zmq_msg_init(&body);
        zmq_msg_recv(&body, router, 0);
        received += zmq_msg_size(&body);
        zmq_msg_close(&body);
        if (received < up) {
          zmq_msg_close(&id);
          continue;
        }
        received = 0;
        for (size_t o = 0; o < down; o += part_down) {
          const size_t k = std::min(part_down, down - o);
          zmq_msg_t to;
          zmq_msg_init(&to);
          zmq_msg_copy(&to, &id);
          zmq_msg_send(&to, router, ZMQ_SNDMORE);
          zmq_msg_t out;
          zmq_msg_init_data(&out, server_buf.data() + o, k, nullptr, nullptr);
          zmq_msg_send(&out, router, 0);
        }
        zmq_msg_close(&id);
      }
    });
  }
  ~RawEcho() {
    stop = true;
    thread.join();
    zmq_close(dealer);
    zmq_close(router);
    if (client_ctx != ctx) zmq_ctx_term(client_ctx);
    zmq_ctx_term(ctx);
  }
  double round_trip() {
    auto t0 = Clock::now();
    for (size_t o = 0; o < up; o += part_up) {
      zmq_msg_t out;
      zmq_msg_init_data(&out, client_buf.data() + o, std::min(part_up, up - o), nullptr, nullptr);
      zmq_msg_send(&out, dealer, 0);
    }
    for (size_t got = 0; got < down;) {
      zmq_msg_t in;
      zmq_msg_init(&in);
      zmq_msg_recv(&in, dealer, 0);
      if (got == 0) first_reply = since(t0);
      got += zmq_msg_size(&in);
      zmq_msg_close(&in);
    }
    return since(t0);
  }
  double first_reply = 0;  // of the last round trip: until the first part of the answer came
};

// ---- Limbo: a learner against a shard ---------------------------------------------------
// A shard serving n floats on its own thread (softsync n = 1).
struct ShardThread {
  std::string dir;
  std::unique_ptr<limbo::ps::Server> server;
  std::atomic<bool> stop{false};
  std::thread thread;
  ShardThread(size_t n, size_t part_floats, double momentum, double weight_decay, const limbo::ps::CurveKeys& keys) {
    char tmpl[] = "/tmp/limbo-bench-ps-XXXXXX";
    dir = ::mkdtemp(tmpl);
    limbo::ps::ServerOptions o;
    o.dir = dir;
    o.agg.alpha0 = 1e-3;
    o.optimizer.momentum = momentum;
    o.optimizer.weight_decay = weight_decay;
    o.checkpoint_every = 0;
    o.log_every = 1 << 30;
    o.part_floats = static_cast<int64_t>(part_floats);
    std::vector<float> init(n, 0.5f);
    limbo::ps::ModelFingerprint fp{"bench", 42};
    server = std::make_unique<limbo::ps::Server>(o, fp, init.data(), static_cast<int64_t>(n), keys);
    thread = std::thread([this] { server->run(stop); });
  }
  ~ShardThread() {
    stop = true;
    thread.join();
    std::system(("rm -rf " + dir).c_str());
  }
};

struct LimboPair {
  ShardThread shard;
  limbo::ps::Transport transport;
  std::unique_ptr<limbo::ps::Socket> sock;
  std::vector<float> grad, weights;
  uint64_t seq = 0, clock = 0;

  size_t part;
  uint8_t push_enc, pull_enc;  // 0, or kBf16Values (comm.compression / ps.pull_compression = bf16)
  std::vector<float> residual;
  std::vector<uint16_t> wire;
  LimboPair(size_t n, size_t part_floats, double momentum, double weight_decay, uint8_t push_encoding,
            uint8_t pull_encoding, const limbo::ps::CurveKeys& keys)
      : shard(n, part_floats, momentum, weight_decay, keys), transport(keys), grad(n, 1e-6f), weights(n, 0.f),
        part(part_floats), push_enc(push_encoding), pull_enc(pull_encoding), residual(push_encoding ? n : 0, 0.f),
        wire(push_encoding ? n : 0) {
    sock = std::make_unique<limbo::ps::Socket>(transport, limbo::ps::Socket::Kind::Dealer);
    sock->connect(shard.server->endpoint());
    limbo::ps::Header h;
    h.type = limbo::ps::MsgType::Hello;
    h.sender = 1;
    h.seq = ++seq;
    sock->send(nullptr, h, json{{"fingerprint", limbo::ps::hex64(42)}, {"total", n}}.dump(), nullptr, 0);
    expect(limbo::ps::MsgType::Welcome);
    pull();
    receive_weights();
  }
  void pull() {
    limbo::ps::Header h;
    h.type = limbo::ps::MsgType::Pull;
    h.sender = 1;
    h.seq = ++seq;
    h.flags = pull_enc;
    sock->send(nullptr, h, "", nullptr, 0);
  }
  // Receives the next message of type t; false when a weights part was not the last.
  bool expect(limbo::ps::MsgType t) {
    std::vector<limbo::ps::Frame> frames;
    for (;;) {
      if (!sock->recv(frames, nullptr, 10000)) throw std::runtime_error("no reply from the shard");
      auto d = limbo::ps::decode(frames, 1ull << 40);
      if (d.reject != limbo::ps::Reject::None) throw std::runtime_error(d.detail);
      if (d.msg.header.type != t) continue;
      if (t == limbo::ps::MsgType::Weights) {  // as a learner does: into its flat weights
        if (d.msg.header.flags & limbo::ps::kValueEncoding)
          limbo::halves_to_floats(limbo::HalfKind::Bf16, reinterpret_cast<const uint16_t*>(d.msg.payload.data),
                                  weights.data() + d.msg.header.offset, d.msg.floats());
        else
          limbo::ps::copy_floats(weights.data() + d.msg.header.offset, d.msg.payload.data, d.msg.payload.size);
        clock = d.msg.header.clock;
        return !(d.msg.header.flags & limbo::ps::kMoreParts);
      }
      return true;
    }
  }
  void receive_weights() {
    while (!expect(limbo::ps::MsgType::Weights)) {
    }
  }
  double round_trip() {
    auto t0 = Clock::now();
    limbo::ps::Header h;
    h.type = limbo::ps::MsgType::Push;
    h.sender = 1;
    h.seq = ++seq;
    h.clock = clock;
    h.aux = -1;
    auto keep = std::shared_ptr<void>(grad.data(), [](void*) {});
    const size_t n = grad.size();
    for (size_t o = 0; o < n; o += part) {
      const size_t k = std::min(part, n - o);
      if (push_enc)  // as a learner does: rounded with error feedback, part by part
        limbo::encode_with_feedback(limbo::HalfKind::Bf16, grad.data() + o, residual.data() + o, wire.data() + o, k);
      h.offset = o;
      h.flags = (o + k < n ? limbo::ps::kMoreParts : 0) | push_enc;
      if (push_enc) sock->send(nullptr, h, "", wire.data() + o, k * 2, keep);
      else sock->send(nullptr, h, "", grad.data() + o, k * 4, keep);
    }
    pull();
    expect(limbo::ps::MsgType::PushAck);
    acked = since(t0);
    receive_weights();
    return since(t0);
  }
  double acked = 0;  // of the last round trip: until the push was acknowledged
};

// The same round trip through the learner's own links (ps/shard_links.h, as
// `limbo worker` makes it): the push, the pull sent with it, the wait for the
// acknowledgement (a poll per message, heartbeats while waiting) and the
// weights part by part into the flat parameters; with --buffers K, K floats
// of model buffers ride along as a learner's do (copied into a frame of the
// push to shard 0, averaged there, back with the weights and copied out).
struct LinksPair {
  ShardThread shard;
  std::unique_ptr<limbo::ps::ShardLinks> links;
  std::vector<float> grad, weights, buffers, buffers_back;
  LinksPair(size_t n, size_t part_floats, double momentum, double weight_decay, uint8_t push_encoding,
            uint8_t pull_encoding, const limbo::ps::CurveKeys& keys, size_t buffer_floats)
      : shard(n, part_floats, momentum, weight_decay, keys), grad(n, 1e-6f), weights(n, 0.f),
        buffers(buffer_floats, 0.25f), buffers_back(buffer_floats) {
    limbo::ps::WorkerOptions o;
    o.servers = {shard.server->endpoint()};
    o.learner_id = 1;
    o.part_floats = static_cast<int64_t>(part_floats);
    o.push_encoding = push_encoding;
    o.pull_encoding = pull_encoding;
    links = std::make_unique<limbo::ps::ShardLinks>(o, keys, limbo::ps::ModelFingerprint{"bench", 42},
                                                    static_cast<int64_t>(n));
    auto& l = *links->all()[0];
    links->receive_weights(l, weights.data(), links->send_pull(l, 0), [&] { return links->send_pull(l, 0); });
  }
  double round_trip() {
    auto t0 = Clock::now();
    auto& l = *links->all()[0];
    std::string meta;
    limbo::ps::Frame frame;
    if (!buffers.empty()) {  // as a learner does: a copy, and how many are averaged
      frame = limbo::ps::float_frame(std::make_shared<std::vector<float>>(buffers));
      meta = json{{"averaged", buffers.size()}}.dump();
    }
    const uint64_t push = links->send_push(
        l, grad.data(), -1, meta, [this] { return std::shared_ptr<void>(grad.data(), [](void*) {}); },
        buffers.empty() ? nullptr : &frame);
    uint64_t pull = links->send_pull(l, 0);
    json ack = json::parse(links->await(l, push, limbo::ps::MsgType::PushAck, [&] { return pull = links->send_pull(l, 0); }).meta);
    if (ack.value("status", std::string()) != "accepted") throw std::runtime_error("push not accepted: " + ack.dump());
    links->accepted(l);
    limbo::ps::Message w = links->receive_weights(l, weights.data(), pull, [&] { return pull = links->send_pull(l, 0); });
    if (!buffers.empty()) {  // as a learner takes shard 0's buffers
      if (w.buffer_floats() != buffers.size()) throw std::runtime_error("shard 0 sent no buffers back");
      std::memcpy(buffers_back.data(), w.buffers.data, w.buffers.size);
    }
    return since(t0);
  }
};

// The two memory passes Limbo adds to the bytes on the wire, timed alone on
// the same sizes: the shard's update (w - alpha g with the NaN check, into a
// new version) and the learner's copy of the weights into its parameters.
struct Passes {
  std::vector<float> g, dst;
  limbo::ps::ShardState state;
  explicit Passes(size_t n) : g(n, 1e-6f), dst(n, 0.f), state(static_cast<int64_t>(n), dst.data(), {}) {}
  // The learner's check of its gradient before a push: as it was
  // (torch's isfinite().all()) and as it is (one read pass).
  std::pair<double, double> finite_checks() {
    torch::Tensor t = torch::from_blob(g.data(), {static_cast<int64_t>(g.size())}, torch::kFloat32);
    auto t0 = Clock::now();
    volatile bool a = t.isfinite().all().item<bool>();
    const double torch_check = since(t0);
    t0 = Clock::now();
    volatile bool b = limbo::ps::all_finite(g.data(), g.size());
    (void)a;
    (void)b;
    return {torch_check, since(t0)};
  }
  double run() {
    auto t0 = Clock::now();
    state.step_single(g.data(), 1e-3);
    limbo::ps::copy_floats(dst.data(), state.weights()->data_ptr<float>(), dst.size() * 4);
    return since(t0);
  }
};

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  const limbo::bench::BenchArgs args(
      argc, argv,
      "[--reps 20] [--sizes-m 1,10] [--part-mb 1] [--momentum 0.9] [--weight-decay 0] [--modes f32,bf16,bf16-both] "
      "[--phases 1] [--curve 1] [--buffers 0]",
      {"--reps", "--sizes-m", "--part-mb", "--momentum", "--weight-decay", "--modes", "--phases", "--curve", "--buffers"});
  const std::string modes_given = "," + args.text("--modes", "f32,bf16,bf16-both") + ",";
  const int reps = static_cast<int>(args.integer("--reps", 20));
  std::vector<size_t> sizes_m;
  for (double m : args.numbers("--sizes-m", {1, 10})) sizes_m.push_back(static_cast<size_t>(m));
  const double part_mb = args.number("--part-mb", 1.0), momentum = args.number("--momentum", 0.9),
               weight_decay = args.number("--weight-decay", 0.0);
  // LIMBO_BENCH_ONLY=limbo or raw-parts: that contender's round trips alone (for a profiler).
  const char* only_env = std::getenv("LIMBO_BENCH_ONLY");
  const std::string only = only_env ? only_env : "";
  const bool only_limbo = only == "limbo", only_raw_parts = only == "raw-parts";
  if (!only.empty() && !only_limbo && !only_raw_parts) {
    std::fprintf(stderr, "LIMBO_BENCH_ONLY: limbo or raw-parts\n");
    return 2;
  }
  const bool phases = args.integer("--phases", 0) != 0;
  const size_t buffer_floats = static_cast<size_t>(std::max<int64_t>(0, args.integer("--buffers", 0)));
  // --curve 1: every socket encrypted with CURVE (as under `limbo launch --keys`), raw ZeroMQ's too: each
  // byte then costs encryption on one side and decryption on the other, a wire slower than loopback's copies.
  limbo::ps::CurveKeys keys;
  if (args.integer("--curve", 0) != 0) {
    if (!limbo::ps::curve_available()) {
      std::fprintf(stderr, "--curve 1: this libzmq has no CURVE support\n");
      return 2;
    }
    keys = limbo::ps::generate_curve_keys();
  }
  limbo::set_log_level(limbo::LogLevel::Warn);
  limbo::keep_freed_memory();  // as the limbo binary does at start-up (applies to both sides)
  std::printf("push + pull round trip on loopback, median of %d interleaved reps, parts of %g MiB, "
              "shard momentum %g, weight decay %g%s; raw ZeroMQ moves the same bytes each way "
              "(GB/s = bytes both ways / time)\n",
              reps, part_mb, momentum, weight_decay, keys.enabled() ? ", every socket CURVE-encrypted" : "");
  // "raw parts" has an I/O thread per end, as Limbo's learner and shard do; "parts, 1 thr" shares one.
  std::printf("%10s %-18s %8s %11s %11s %13s %9s %11s %9s %9s %10s %14s\n", "floats", "wire (push/pull)", "MB",
              "raw 1 msg", "raw parts", "parts, 1 thr", "limbo", "limbo GB/s", "vs 1 msg", "vs parts", "vs 1 thr",
              "passes alone");
  struct Mode {
    const char* flag;
    const char* name;
    uint8_t push, pull;
  };
  const Mode all_modes[] = {{"f32", "f32 / f32", 0, 0},
                            {"bf16", "bf16 / f32", limbo::ps::kBf16Values, 0},
                            {"bf16-both", "bf16 / bf16", limbo::ps::kBf16Values, limbo::ps::kBf16Values}};
  std::vector<Mode> modes;
  for (const Mode& m : all_modes)
    if (modes_given.find("," + std::string(m.flag) + ",") != std::string::npos) modes.push_back(m);
  if (modes.empty()) {
    std::fprintf(stderr, "--modes: give one or more of f32, bf16, bf16-both\n");
    return 2;
  }
  for (size_t m : sizes_m) {
    const size_t n = m * 1000 * 1000;
    const size_t part = part_mb > 0 ? std::max<size_t>(1, static_cast<size_t>(part_mb * (1 << 20) / 4)) : n;
    for (const Mode& mode : modes) {
      const size_t up = n * (mode.push ? 2 : 4), down = n * (mode.pull ? 2 : 4);
      // Parts of the same number of values as Limbo's.
      const size_t part_up = part * (mode.push ? 2 : 4), part_down = part * (mode.pull ? 2 : 4);
      RawEcho raw(up, down, up, down, keys), raw_parts(up, down, part_up, part_down, keys),
          raw_shared(up, down, part_up, part_down, keys, /*shared=*/true);
      Passes passes(n);
      LimboPair limbo_pair(n, part, momentum, weight_decay, mode.push, mode.pull, keys);
      // --phases: the learner's links too, without and (--buffers K) with model buffers.
      std::unique_ptr<LinksPair> links, links_buf;
      if (phases) links = std::make_unique<LinksPair>(n, part, momentum, weight_decay, mode.push, mode.pull, keys, 0);
      if (phases && buffer_floats)
        links_buf = std::make_unique<LinksPair>(n, part, momentum, weight_decay, mode.push, mode.pull, keys, buffer_floats);
      std::vector<double> tk, tkb;
      std::vector<double> t1, tp, ts, tl, tx, up_raw, up_limbo, check_torch, check_pass, cpu_raw, cpu_limbo;
      for (int r = 0; r < reps + 3; ++r) {
        double a = only.empty() ? raw.round_trip() : 1;
        double cpu0 = process_cpu();
        double b = only_limbo ? 1 : raw_parts.round_trip();
        double cpu1 = process_cpu();
        double c = only_raw_parts ? 1 : limbo_pair.round_trip();
        double cpu2 = process_cpu();
        double sh = only.empty() ? raw_shared.round_trip() : 1;
        double k = links ? links->round_trip() : 0, kb = links_buf ? links_buf->round_trip() : 0;
        double x = only.empty() ? passes.run() : 1;
        if (r >= 3) {
          t1.push_back(a);
          tp.push_back(b);
          ts.push_back(sh);
          tk.push_back(k);
          tkb.push_back(kb);
          tl.push_back(c);
          tx.push_back(x);
          up_raw.push_back(raw_parts.first_reply);
          up_limbo.push_back(limbo_pair.acked);
          cpu_raw.push_back(cpu1 - cpu0);
          cpu_limbo.push_back(cpu2 - cpu1);
          if (phases) {
            auto [ct, cp] = passes.finite_checks();
            check_torch.push_back(ct);
            check_pass.push_back(cp);
          }
        }
      }
      const double bytes = static_cast<double>(up + down);
      double m1 = median(t1), mp = median(tp), ms = median(ts), ml = median(tl), mx = median(tx);
      std::printf("%10zu %-18s %8.1f %8.2f ms %8.2f ms %10.2f ms %6.2f ms %11.2f %8.2fx %8.2fx %9.2fx %11.2f ms\n", n,
                  mode.name, bytes / 1e6, 1e3 * m1, 1e3 * mp, 1e3 * ms, 1e3 * ml, bytes / ml / 1e9, m1 / ml, mp / ml,
                  ms / ml, 1e3 * mx);
      if (phases)
        std::printf("%10s up (until the first answer / the push acknowledged): raw parts %.2f ms, limbo %.2f ms; "
                    "down (the rest): raw parts %.2f ms, limbo %.2f ms\n",
                    "", 1e3 * median(up_raw), 1e3 * median(up_limbo), 1e3 * (mp - median(up_raw)),
                    1e3 * (ml - median(up_limbo)));
      if (phases) {
        std::vector<double> sl = tl, sp = tp;
        std::sort(sl.begin(), sl.end());
        std::sort(sp.begin(), sp.end());
        auto at = [](const std::vector<double>& v, double q) { return 1e3 * v[static_cast<size_t>(q * (v.size() - 1))]; };
        std::printf("%10s spread over the reps (min / p10 / median / p90 / max): raw parts %.2f / %.2f / %.2f / %.2f / "
                    "%.2f ms, limbo %.2f / %.2f / %.2f / %.2f / %.2f ms\n",
                    "", at(sp, 0), at(sp, 0.1), at(sp, 0.5), at(sp, 0.9), at(sp, 1), at(sl, 0), at(sl, 0.1), at(sl, 0.5),
                    at(sl, 0.9), at(sl, 1));
        std::printf("%10s CPU time of a round trip, all threads (cores busy on average): raw parts %.2f ms (%.2f), "
                    "limbo %.2f ms (%.2f)\n",
                    "", 1e3 * median(cpu_raw), median(cpu_raw) / mp, 1e3 * median(cpu_limbo), median(cpu_limbo) / ml);
        std::printf("%10s the learner's links (ShardLinks, as `limbo worker`): %.2f ms against the bare loop's %.2f ms",
                    "", 1e3 * median(tk), 1e3 * ml);
        if (links_buf) std::printf("; with %zu floats of model buffers through shard 0: %.2f ms", buffer_floats, 1e3 * median(tkb));
        std::printf("\n");
        std::printf("%10s the learner's finite check of its gradient: isfinite().all() %.2f ms, one pass %.2f ms\n", "",
                    1e3 * median(check_torch), 1e3 * median(check_pass));
      }
    }
  }
  return 0;
}
