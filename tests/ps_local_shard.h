// A parameter-server shard served in-process on its own thread, and a
// client that speaks the wire protocol to it (tests of the shard).
#pragma once

#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "common/error.h"
#include "common/files.h"
#include "ps/aggregator.h"
#include "ps/protocol.h"
#include "ps/server.h"
#include "ps/transport.h"
#include "test_util.h"

namespace limbo::ps::shardtest {

using json = nlohmann::json;

inline AggregatorOptions softsync(int n) {
  AggregatorOptions o;
  o.protocol = Protocol::Softsync;
  o.softsync_n = n;
  o.alpha0 = 0.1;
  return o;
}

constexpr int64_t kTotal = 1000;

struct LocalShard {
  explicit LocalShard(AggregatorOptions agg, CurveKeys keys = {}, int64_t part_floats = -1, int64_t total = kTotal,
                      int shard = 0, int shards = 1)
      : initial(static_cast<size_t>(total), 1.f) {
    ServerOptions o;
    o.shard = shard;
    o.shards = shards;
    if (part_floats >= 0) o.part_floats = part_floats;
    o.dir = dir.path() + "/shard";
    o.agg = agg;
    o.heartbeat_timeout = std::chrono::seconds(30);
    o.max_payload_bytes = 1 << 20;
    server = std::make_unique<Server>(o, fp, initial.data(), total, keys);
    endpoint = server->endpoint();
    thread = std::thread([this] { server->run(stop); });
  }
  ~LocalShard() {
    stop = true;
    if (thread.joinable()) thread.join();
  }
  // Stops the shard (it writes its final summary) and returns that summary.
  json finish() {
    stop = true;
    if (thread.joinable()) thread.join();
    return json::parse(read_file(dir.path() + "/shard/summary.json"));
  }

  testing::TempDir dir;
  ModelFingerprint fp{"toy: w[1000]", fnv1a("toy")};
  std::vector<float> initial;
  std::unique_ptr<Server> server;
  std::string endpoint;
  std::atomic<bool> stop{false};
  std::thread thread;
};

inline Header pull_header(uint32_t id, uint64_t seq) {
  Header h;
  h.type = MsgType::Pull;
  h.sender = id;
  h.seq = seq;
  return h;
}

inline Header push_header(uint32_t id, uint64_t seq, uint64_t clock = 0) {
  Header h;
  h.type = MsgType::Push;
  h.sender = id;
  h.seq = seq;
  h.clock = clock;
  h.aux = -1;
  return h;
}

struct Client {
  Client(const std::string& endpoint, CurveKeys keys = {}) : t(keys), s(t, Socket::Kind::Dealer) { s.connect(endpoint); }
  Message call(Header h, const std::string& meta, const std::vector<float>& payload = {}, int timeout_ms = 5000) {
    s.send(nullptr, h, meta, payload.data(), payload.size() * 4);
    return reply(timeout_ms);
  }
  Message reply(int timeout_ms = 5000) {
    std::vector<Frame> frames;
    if (!s.recv(frames, nullptr, timeout_ms)) throw Timeout("no reply");
    auto d = decode(frames, 1ull << 30);
    if (d.reject != Reject::None) throw Error("bad reply: " + d.detail);
    d.msg.payload.keep = frames[2].keep;
    return d.msg;
  }
  Message hello(uint32_t id, const ModelFingerprint& fp, int64_t total = kTotal, int timeout_ms = 5000,
                const std::string& incarnation = "") {
    Header h;
    h.type = MsgType::Hello;
    h.sender = id;
    json meta = {{"fingerprint", hex64(fp.hash)}, {"model", fp.description}, {"total", total}};
    if (!incarnation.empty()) meta["incarnation"] = incarnation;
    return call(h, meta.dump(), {}, timeout_ms);
  }
  // Sends a push in parts of `part` floats (as a learner does) and returns the reply.
  Message push_parts(Header h, const std::vector<float>& g, size_t part, size_t stop_after = SIZE_MAX) {
    for (size_t o = 0, k = 0; o < g.size() && k < stop_after; o += part, ++k) {
      const size_t n = std::min(part, g.size() - o);
      h.offset = o;
      h.flags = o + n < g.size() ? kMoreParts : 0;
      s.send(nullptr, h, "", g.data() + o, n * 4);
    }
    return stop_after == SIZE_MAX ? reply() : Message();
  }
  // Pulls and assembles the weights from their parts; *parts gets their offsets.
  std::vector<float> pull_parts(uint32_t id, uint64_t seq, uint64_t* clock, std::vector<uint64_t>* parts = nullptr) {
    s.send(nullptr, pull_header(id, seq), "", nullptr, 0);
    std::vector<float> w;
    for (;;) {
      Message m = reply();
      if (m.header.type != MsgType::Weights) throw Error(std::string("expected weights, got ") + type_name(m.header.type));
      if (m.header.offset != w.size()) throw Error("weights part out of order");
      if (parts) parts->push_back(m.header.offset);
      *clock = m.header.clock;
      const float* f = reinterpret_cast<const float*>(m.payload.data);
      w.insert(w.end(), f, f + m.floats());
      if (!(m.header.flags & kMoreParts)) return w;
    }
  }
  Transport t;
  Socket s;
};

// A gradient of small distinct values.
inline std::vector<float> ramp(float scale) {
  std::vector<float> g(kTotal);
  for (int64_t i = 0; i < kTotal; ++i) g[i] = scale * static_cast<float>(i % 17 - 8);
  return g;
}

}  // namespace limbo::ps::shardtest
