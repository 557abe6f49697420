// Parameter-server round trip: a learner's push (gradient) + pull (weights)
// against a real shard on loopback (ps::Server on its own thread, softsync
// n = 1, so every push is also an update), against raw ZeroMQ moving the same
// bytes (a DEALER sends N floats, a ROUTER echoes N floats back, both without
// copies). The two are interleaved rep by rep so machine noise hits both.
// GB/s counts the bytes moved both ways: 2 * 4 * N per round trip.
//
//   build/bench/limbo_bench_ps_roundtrip [--reps 20] [--sizes-m 1,10]
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
#include <vector>

#include "common/files.h"
#include "common/log.h"
#include "common/memory.h"
#include "ps/server.h"
#include "ps/shard_state.h"
#include "ps/transport.h"

namespace {

using Clock = std::chrono::steady_clock;
using json = nlohmann::json;
double since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

// ---- raw ZeroMQ echo ---------------------------------------------------------------
struct RawEcho {
  void* ctx = zmq_ctx_new();
  void* router = nullptr;
  void* dealer = nullptr;
  std::vector<float> server_buf, client_buf;
  std::atomic<bool> stop{false};
  std::thread thread;

  explicit RawEcho(size_t n) : server_buf(n, 1.f), client_buf(n, 2.f) {
    router = zmq_socket(ctx, ZMQ_ROUTER);
    int zero = 0;
    zmq_setsockopt(router, ZMQ_LINGER, &zero, sizeof zero);
    zmq_bind(router, "tcp://127.0.0.1:*");
    char ep[256];
    size_t len = sizeof ep;
    zmq_getsockopt(router, ZMQ_LAST_ENDPOINT, ep, &len);
    dealer = zmq_socket(ctx, ZMQ_DEALER);
    zmq_setsockopt(dealer, ZMQ_LINGER, &zero, sizeof zero);
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
        zmq_msg_close(&body);
        zmq_msg_send(&id, router, ZMQ_SNDMORE);
        zmq_msg_t out;
        zmq_msg_init_data(&out, server_buf.data(), server_buf.size() * 4, nullptr, nullptr);
        zmq_msg_send(&out, router, 0);
      }
    });
  }
  ~RawEcho() {
    stop = true;
    thread.join();
    zmq_close(dealer);
    zmq_close(router);
    zmq_ctx_term(ctx);
  }
  double round_trip() {
    auto t0 = Clock::now();
    zmq_msg_t out;
    zmq_msg_init_data(&out, client_buf.data(), client_buf.size() * 4, nullptr, nullptr);
    zmq_msg_send(&out, dealer, 0);
    zmq_msg_t in;
    zmq_msg_init(&in);
    zmq_msg_recv(&in, dealer, 0);
    zmq_msg_close(&in);
    return since(t0);
  }
};

// ---- Limbo: a learner against a shard ---------------------------------------------------
struct LimboPair {
  std::string dir;
  std::unique_ptr<limbo::ps::Server> server;
  std::atomic<bool> stop{false};
  std::thread thread;
  limbo::ps::Transport transport;
  std::unique_ptr<limbo::ps::Socket> sock;
  std::vector<float> grad, weights;
  uint64_t seq = 0, clock = 0;

  explicit LimboPair(size_t n) : grad(n, 1e-6f), weights(n, 0.f) {
    char tmpl[] = "/tmp/limbo-bench-ps-XXXXXX";
    dir = ::mkdtemp(tmpl);
    limbo::ps::ServerOptions o;
    o.dir = dir;
    o.agg.alpha0 = 1e-3;
    o.checkpoint_every = 0;
    o.log_every = 1 << 30;
    std::vector<float> init(n, 0.5f);
    limbo::ps::ModelFingerprint fp{"bench", 42};
    server = std::make_unique<limbo::ps::Server>(o, fp, init.data(), static_cast<int64_t>(n), limbo::ps::CurveKeys{});
    thread = std::thread([this] { server->run(stop); });
    sock = std::make_unique<limbo::ps::Socket>(transport, limbo::ps::Socket::Kind::Dealer);
    sock->connect(server->endpoint());
    limbo::ps::Header h;
    h.type = limbo::ps::MsgType::Hello;
    h.sender = 1;
    h.seq = ++seq;
    sock->send(nullptr, h, json{{"fingerprint", limbo::ps::hex64(42)}, {"total", n}}.dump(), nullptr, 0);
    expect(limbo::ps::MsgType::Welcome);
    pull();
    expect(limbo::ps::MsgType::Weights);
  }
  ~LimboPair() {
    stop = true;
    thread.join();
    std::system(("rm -rf " + dir).c_str());
  }
  void pull() {
    limbo::ps::Header h;
    h.type = limbo::ps::MsgType::Pull;
    h.sender = 1;
    h.seq = ++seq;
    sock->send(nullptr, h, "", nullptr, 0);
  }
  void expect(limbo::ps::MsgType t) {
    std::vector<limbo::ps::Frame> frames;
    for (;;) {
      if (!sock->recv(frames, nullptr, 10000)) throw std::runtime_error("no reply from the shard");
      auto d = limbo::ps::decode(frames, 1ull << 40);
      if (d.reject != limbo::ps::Reject::None) throw std::runtime_error(d.detail);
      if (d.msg.header.type != t) continue;
      if (t == limbo::ps::MsgType::Weights) {  // as a learner does: into its flat weights
        limbo::ps::copy_floats(weights.data(), d.msg.payload.data, d.msg.payload.size);
        clock = d.msg.header.clock;
      }
      return;
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
    sock->send(nullptr, h, "", grad.data(), grad.size() * 4, keep);
    pull();
    expect(limbo::ps::MsgType::PushAck);
    expect(limbo::ps::MsgType::Weights);
    return since(t0);
  }
};

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  int reps = 20;
  std::vector<size_t> sizes_m = {1, 10};
  for (int i = 1; i + 1 < argc; i += 2) {
    std::string a = argv[i];
    if (a == "--reps") reps = std::atoi(argv[i + 1]);
    else if (a == "--sizes-m") {
      sizes_m.clear();
      std::stringstream ss(argv[i + 1]);
      std::string item;
      while (std::getline(ss, item, ',')) sizes_m.push_back(std::stoul(item));
    } else {
      std::fprintf(stderr, "usage: %s [--reps N] [--sizes-m 1,10]\n", argv[0]);
      return 2;
    }
  }
  limbo::set_log_level(limbo::LogLevel::Warn);
  limbo::keep_freed_memory();  // as the limbo binary does at start-up (applies to both sides)
  std::printf("push + pull round trip on loopback, median of %d interleaved reps (GB/s = 2 x payload / time)\n", reps);
  std::printf("%10s %10s %12s %12s %12s %8s\n", "floats", "MB", "raw zmq ms", "limbo ms", "limbo GB/s", "ratio");
  for (size_t m : sizes_m) {
    const size_t n = m * 1000 * 1000;
    RawEcho raw(n);
    LimboPair limbo_pair(n);
    std::vector<double> tr, tl;
    for (int r = 0; r < reps + 3; ++r) {
      double a = raw.round_trip();
      double b = limbo_pair.round_trip();
      if (r >= 3) {
        tr.push_back(a);
        tl.push_back(b);
      }
    }
    const double bytes = 2.0 * 4 * n;
    double mr = median(tr), ml = median(tl);
    std::printf("%10zu %10.1f %12.2f %12.2f %12.2f %7.2fx   (raw zmq %.2f GB/s)\n", n, 4.0 * n / 1e6, 1e3 * mr,
                1e3 * ml, bytes / ml / 1e9, mr / ml, bytes / mr / 1e9);
  }
  return 0;
}
