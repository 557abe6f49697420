// A parameter-server shard served in-process: handshake, the update rule,
// rejections of bad gradients, garbage on the port, CURVE admission.
#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <nlohmann/json.hpp>

#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <thread>

#include "common/error.h"
#include "common/files.h"
#include "ps/aggregator.h"
#include "ps/protocol.h"
#include "ps/server.h"
#include "ps/transport.h"
#include "test_util.h"

namespace limbo::ps {
namespace {

using json = nlohmann::json;

AggregatorOptions softsync(int n) {
  AggregatorOptions o;
  o.protocol = Protocol::Softsync;
  o.softsync_n = n;
  o.alpha0 = 0.1;
  return o;
}

// ---- a shard served in-process ---------------------------------------------------

constexpr int64_t kTotal = 1000;

struct LocalShard {
  explicit LocalShard(AggregatorOptions agg, CurveKeys keys = {}, int64_t part_floats = -1, int64_t total = kTotal)
      : initial(static_cast<size_t>(total), 1.f) {
    ServerOptions o;
    if (part_floats >= 0) o.part_floats = part_floats;
    o.dir = dir.path() + "/shard";
    o.agg = agg;
    o.heartbeat_timeout = 30;
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

Header pull_header(uint32_t id, uint64_t seq) {
  Header h;
  h.type = MsgType::Pull;
  h.sender = id;
  h.seq = seq;
  return h;
}

Header push_header(uint32_t id, uint64_t seq, uint64_t clock = 0) {
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
  Message hello(uint32_t id, const ModelFingerprint& fp, int64_t total = kTotal, int timeout_ms = 5000) {
    Header h;
    h.type = MsgType::Hello;
    h.sender = id;
    return call(h, json{{"fingerprint", hex64(fp.hash)}, {"model", fp.description}, {"total", total}}.dump(), {},
                timeout_ms);
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

TEST(Shard, HandshakeChecksTheModelFingerprint) {
  LocalShard shard(softsync(1));
  Client c(shard.endpoint);
  auto ok = c.hello(1, shard.fp);
  ASSERT_EQ(ok.header.type, MsgType::Welcome);
  EXPECT_EQ(json::parse(ok.meta)["numel"], kTotal);
  auto refused = c.hello(2, ModelFingerprint{"other: v[999]", fnv1a("other")}, 999);
  ASSERT_EQ(refused.header.type, MsgType::Refuse);
  std::string reason = json::parse(refused.meta)["reason"];
  EXPECT_NE(reason.find("model mismatch"), std::string::npos) << reason;
  EXPECT_NE(reason.find("toy: w[1000]"), std::string::npos) << reason;
  EXPECT_NE(reason.find("other: v[999]"), std::string::npos) << reason;
  // A message of another protocol version is refused with a reason.
  Header v;
  v.type = MsgType::Hello;
  v.version = kProtocolVersion + 1;
  unsigned char hdr[kHeaderBytes];
  encode_header(v, hdr);
  c.s.send_raw({std::string(reinterpret_cast<char*>(hdr), kHeaderBytes), "", ""});
  auto err = c.reply();
  ASSERT_EQ(err.header.type, MsgType::Error);
  EXPECT_EQ(json::parse(err.meta)["code"], "version");
  EXPECT_NE(json::parse(err.meta)["reason"].get<std::string>().find("protocol version"), std::string::npos);
  // So is a peer of protocol version 1, whose header was 48 bytes.
  v.version = 1;
  encode_header(v, hdr);
  c.s.send_raw({std::string(reinterpret_cast<char*>(hdr), 48), "", ""});
  auto err1 = c.reply();
  ASSERT_EQ(err1.header.type, MsgType::Error);
  EXPECT_NE(json::parse(err1.meta)["reason"].get<std::string>().find("protocol version 1,"), std::string::npos);
}

TEST(Shard, AppliesTheStalenessWeightedUpdateAndRejectsBadGradients) {
  auto o = softsync(1);
  o.alpha0 = 0.5;
  LocalShard shard(o);
  Client c(shard.endpoint);
  ASSERT_EQ(c.hello(1, shard.fp).header.type, MsgType::Welcome);
  Header pull = pull_header(1, 1);
  auto w0 = c.call(pull, "");
  ASSERT_EQ(w0.header.type, MsgType::Weights);
  ASSERT_EQ(w0.floats(), static_cast<size_t>(kTotal));
  EXPECT_EQ(reinterpret_cast<const float*>(w0.payload.data)[5], 1.f);

  std::vector<float> g(kTotal, 1.f);
  auto ack = c.call(push_header(1, 2), "", g);
  ASSERT_EQ(ack.header.type, MsgType::PushAck);
  EXPECT_EQ(json::parse(ack.meta)["status"], "accepted");
  // Duplicate (same seq) is not applied twice.
  EXPECT_EQ(json::parse(c.call(push_header(1, 2), "", g).meta)["status"], "duplicate");
  // Wrong shape, NaN, Inf, clock from the future, unknown learner: rejected.
  EXPECT_EQ(json::parse(c.call(push_header(1, 3), "", std::vector<float>(kTotal - 1, 1.f)).meta)["code"], "shape");
  auto nan = g;
  nan[10] = std::nanf("");
  EXPECT_EQ(json::parse(c.call(push_header(1, 4), "", nan).meta)["code"], "non_finite");
  auto inf = g;
  inf[999] = std::numeric_limits<float>::infinity();
  EXPECT_EQ(json::parse(c.call(push_header(1, 5), "", inf).meta)["code"], "non_finite");
  EXPECT_EQ(json::parse(c.call(push_header(1, 6, 50), "", g).meta)["code"], "protocol");
  EXPECT_EQ(json::parse(c.call(push_header(7, 7), "", g).meta)["code"], "unknown_learner");

  // A stale gradient (computed at clock 0, applied at clock 1): rate 0.5 / 1.
  auto ack2 = c.call(push_header(1, 8, 0), "", g);
  EXPECT_EQ(json::parse(ack2.meta)["tau"], 1);
  pull.seq = 9;
  auto w2 = c.call(pull, "");
  EXPECT_EQ(w2.header.clock, 2u);
  // No momentum configured: w = 1 - 0.5 * 1 - (0.5 / 1) * 1 = 0.
  EXPECT_FLOAT_EQ(reinterpret_cast<const float*>(w2.payload.data)[0], 0.f);
  auto s = shard.finish();
  EXPECT_EQ(s["updates"], 2);
  EXPECT_EQ(s["gradients_rejected"], 5);
  EXPECT_EQ(s["rejected_by_reason"]["non_finite"], 2);
  EXPECT_EQ(s["staleness_max"], 1);
}

TEST(Shard, KeepsServingAfterGarbage) {
  LocalShard shard(softsync(1));
  // 1. Raw bytes on the TCP port (not even ZeroMQ's greeting).
  auto colon = shard.endpoint.rfind(':');
  int port = std::stoi(shard.endpoint.substr(colon + 1));
  std::mt19937 rng(3);
  for (int i = 0; i < 20; ++i) {
    int fd = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_port = htons(static_cast<uint16_t>(port));
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    ASSERT_EQ(::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a), 0);
    std::string junk(1 + rng() % 4096, '\0');
    for (auto& ch : junk) ch = static_cast<char>(rng());
    (void)!::write(fd, junk.data(), junk.size());
    ::close(fd);
  }
  // 2. Well-framed ZeroMQ messages with garbage inside.
  Client bad(shard.endpoint);
  for (int i = 0; i < 200; ++i) {
    std::vector<std::string> frames(1 + rng() % 5);
    for (auto& f : frames) {
      f.resize(rng() % 100);
      for (auto& ch : f) ch = static_cast<char>(rng());
    }
    bad.s.send_raw(frames);
  }
  // A header claiming a huge payload.
  Header huge = push_header(1, 1);
  huge.payload_bytes = 1ull << 40;
  unsigned char hdr[kHeaderBytes];
  encode_header(huge, hdr);
  bad.s.send_raw({std::string(reinterpret_cast<char*>(hdr), kHeaderBytes), "", "abcd"});
  // Messages on one connection are handled in order: once this peer is
  // welcomed, all of its garbage has been seen.
  {
    Header h;
    h.type = MsgType::Hello;
    h.sender = 4;
    bad.s.send(nullptr, h, json{{"fingerprint", hex64(shard.fp.hash)}, {"total", kTotal}}.dump(), nullptr, 0);
    MsgType t = MsgType::Error;
    while (t != MsgType::Welcome) t = bad.reply().header.type;
  }
  // 3. The shard still serves a well-behaved learner.
  Client good(shard.endpoint);
  ASSERT_EQ(good.hello(5, shard.fp).header.type, MsgType::Welcome);
  Header pull = pull_header(5, 2);
  EXPECT_EQ(good.call(pull, "").header.type, MsgType::Weights);
  auto s = shard.finish();
  EXPECT_GE(s["gradients_rejected"].get<int64_t>(), 200);
  EXPECT_EQ(s["rejected_by_reason"]["oversized"], 1);
}

TEST(Shard, CurveAdmitsOnlyPeersWithTheJobKeys) {
  if (!curve_available()) GTEST_SKIP() << "libzmq without CURVE";
  auto keys = generate_curve_keys();
  LocalShard shard(softsync(1), keys);
  Client ok(shard.endpoint, keys);
  EXPECT_EQ(ok.hello(1, shard.fp, kTotal).header.type, MsgType::Welcome);
  Client plain(shard.endpoint);  // no keys: the handshake fails, nothing arrives
  EXPECT_THROW(plain.hello(2, shard.fp, kTotal, 1500), Timeout);
  // Knows the shard's public key but holds another key pair: refused by ZAP.
  CurveKeys intruder = generate_curve_keys();
  intruder.server_key = keys.public_key;
  Client wrong(shard.endpoint, intruder);
  EXPECT_THROW(wrong.hello(3, shard.fp, kTotal, 1500), Timeout);
  auto s = shard.finish();
  EXPECT_GE(s["curve_peers_refused"].get<int64_t>(), 1);
  EXPECT_GE(s["curve_peers_accepted"].get<int64_t>(), 1);
}

std::vector<float> ramp(float scale) {
  std::vector<float> g(kTotal);
  for (int64_t i = 0; i < kTotal; ++i) g[i] = scale * static_cast<float>(i % 17 - 8);
  return g;
}

TEST(Shard, PushesAndWeightsTravelInParts) {
  auto o = softsync(1);
  o.alpha0 = 0.5;
  LocalShard shard(o, {}, /*part_floats=*/300);
  Client c(shard.endpoint);
  ASSERT_EQ(c.hello(1, shard.fp).header.type, MsgType::Welcome);
  uint64_t clock = 99;
  std::vector<uint64_t> offsets;
  auto w0 = c.pull_parts(1, 1, &clock, &offsets);
  EXPECT_EQ(offsets, (std::vector<uint64_t>{0, 300, 600, 900}));
  ASSERT_EQ(w0, shard.initial);
  EXPECT_EQ(clock, 0u);

  // A push in 4 parts (streamed: it makes the update alone) is the same
  // update as one message: w = w - alpha g.
  auto g = ramp(0.25f);
  auto ack = c.push_parts(push_header(1, 2), g, 256);
  ASSERT_EQ(ack.header.type, MsgType::PushAck);
  EXPECT_EQ(json::parse(ack.meta)["status"], "accepted");
  auto w1 = c.pull_parts(1, 3, &clock);
  ASSERT_EQ(clock, 1u);
  for (int64_t i = 0; i < kTotal; ++i) ASSERT_EQ(w1[i], 1.f - 0.5f * g[i]) << i;

  // NaN in the last part: rejected, nothing applied.
  auto nan = g;
  nan[kTotal - 1] = std::nanf("");
  EXPECT_EQ(json::parse(c.push_parts(push_header(1, 4, 1), nan, 256).meta)["code"], "non_finite");
  EXPECT_EQ(c.pull_parts(1, 5, &clock), w1);
  EXPECT_EQ(clock, 1u);
  // Parts that skip floats, parts of a push whose first part never came,
  // and parts adding up to the wrong size: rejected.
  Header skip = push_header(1, 6, 1);
  skip.flags = kMoreParts;
  c.s.send(nullptr, skip, "", g.data(), 400);
  skip.offset = 200;
  skip.flags = 0;
  EXPECT_EQ(json::parse(c.call(skip, "", std::vector<float>(g.begin() + 200, g.end())).meta)["code"], "protocol");
  Header orphan = push_header(1, 7, 1);
  orphan.offset = 500;
  EXPECT_EQ(json::parse(c.call(orphan, "", std::vector<float>(500, 1.f)).meta)["code"], "protocol");
  EXPECT_EQ(json::parse(c.push_parts(push_header(1, 8, 1), std::vector<float>(kTotal - 3, 1.f), 256).meta)["code"],
            "shape");
  // A push abandoned after its first parts is replaced by the next one.
  c.push_parts(push_header(1, 9, 1), g, 256, /*stop_after=*/2);
  EXPECT_EQ(json::parse(c.push_parts(push_header(1, 10, 1), g, 256).meta)["status"], "accepted");
  auto w2 = c.pull_parts(1, 11, &clock);
  ASSERT_EQ(clock, 2u);
  for (int64_t i = 0; i < kTotal; ++i) ASSERT_EQ(w2[i], w1[i] - 0.5f * g[i]) << i;
  auto s = shard.finish();
  EXPECT_EQ(s["updates"], 2);
  EXPECT_EQ(s["gradients_rejected"], 4);
}

TEST(Shard, AStreamedPushOvertakenByAnotherUpdateIsAppliedAgainAsStale) {
  // lambda = 2, n = 2: c = 1, every push is an update of its own.
  auto o = softsync(2);
  o.alpha0 = 0.5;
  LocalShard shard(o, {}, 300);
  Client a(shard.endpoint), b(shard.endpoint);
  ASSERT_EQ(a.hello(1, shard.fp).header.type, MsgType::Welcome);
  ASSERT_EQ(b.hello(2, shard.fp).header.type, MsgType::Welcome);
  uint64_t clock;
  a.pull_parts(1, 1, &clock);
  b.pull_parts(2, 1, &clock);
  auto ga = ramp(0.25f), gb = ramp(-0.125f);
  // A's first two parts arrive (the shard starts its update from clock 0)...
  a.push_parts(push_header(1, 2, 0), ga, 256, /*stop_after=*/2);
  Header beat;
  beat.type = MsgType::Heartbeat;
  beat.sender = 1;
  ASSERT_EQ(a.call(beat, "").header.type, MsgType::Heartbeat);  // ordered: the parts were handled
  // ...then B's whole push makes an update first...
  EXPECT_EQ(json::parse(b.push_parts(push_header(2, 2, 0), gb, 256).meta)["tau"], 0);
  // ...so A's gradient is one update stale when its last parts arrive.
  std::vector<float> rest(ga.begin() + 512, ga.end());
  Header tail = push_header(1, 2, 0);
  tail.offset = 512;
  auto ack = a.call(tail, "", rest);
  EXPECT_EQ(json::parse(ack.meta)["tau"], 1);
  auto w = a.pull_parts(1, 3, &clock);
  ASSERT_EQ(clock, 2u);
  for (int64_t i = 0; i < kTotal; ++i) ASSERT_EQ(w[i], (1.f - 0.5f * gb[i]) - (0.5f / 1) * ga[i]) << i;
}

TEST(Shard, APushInTooManyPartsIsRefusedAndADuplicateDoesNotCutAPushShort) {
  const int64_t total = kMaxParts + 100;
  LocalShard shard(softsync(1), {}, -1, total);
  Client c(shard.endpoint);
  ASSERT_EQ(c.hello(1, shard.fp, total).header.type, MsgType::Welcome);
  // Parts of one float: a shard holds at most kMaxParts parts of a push.
  std::vector<float> g(static_cast<size_t>(total), 0.5f);
  Header h = push_header(1, 2);
  for (int64_t k = 0; k < kMaxParts; ++k) {
    h.offset = static_cast<uint64_t>(k);
    h.flags = kMoreParts;
    c.s.send(nullptr, h, "", g.data() + k, 4);
  }
  Message r = c.reply();
  EXPECT_EQ(json::parse(r.meta)["code"], "shape");
  EXPECT_NE(json::parse(r.meta)["reason"].get<std::string>().find("parts"), std::string::npos);
  // A repeated first part of an applied push, arriving while a newer push is
  // under way, is answered as a duplicate and leaves the newer push whole.
  EXPECT_EQ(json::parse(c.push_parts(push_header(1, 3), g, 1000).meta)["status"], "accepted");
  c.push_parts(push_header(1, 4, 1), g, 1000, /*stop_after=*/2);
  Header dup = push_header(1, 3);
  dup.flags = kMoreParts;
  EXPECT_EQ(json::parse(c.call(dup, "", std::vector<float>(g.begin(), g.begin() + 1000)).meta)["status"], "duplicate");
  Header rest = push_header(1, 4, 1);
  for (size_t o = 2000; o < g.size(); o += 1000) {
    const size_t n = std::min<size_t>(1000, g.size() - o);
    rest.offset = o;
    rest.flags = o + n < g.size() ? kMoreParts : 0;
    c.s.send(nullptr, rest, "", g.data() + o, n * 4);
  }
  EXPECT_EQ(json::parse(c.reply().meta)["status"], "accepted");
  uint64_t clock;
  auto w = c.pull_parts(1, 5, &clock);
  EXPECT_EQ(clock, 2u);
  EXPECT_FLOAT_EQ(w[0], 1.f - 2 * 0.1f * 0.5f);
}

TEST(Shard, PushesInPartsAreAccumulatedWhenSeveralMakeAnUpdate) {
  // lambda = 2, n = 1: c = 2 gradients per update.
  auto o = softsync(1);
  o.alpha0 = 0.5;
  LocalShard shard(o, {}, 300);
  Client a(shard.endpoint), b(shard.endpoint);
  ASSERT_EQ(a.hello(1, shard.fp).header.type, MsgType::Welcome);
  ASSERT_EQ(b.hello(2, shard.fp).header.type, MsgType::Welcome);
  uint64_t clock;
  a.pull_parts(1, 1, &clock);
  b.pull_parts(2, 1, &clock);
  auto ga = ramp(0.25f), gb = ramp(-0.125f);
  EXPECT_EQ(json::parse(a.push_parts(push_header(1, 2, 0), ga, 256).meta)["status"], "accepted");
  EXPECT_EQ(json::parse(b.push_parts(push_header(2, 2, 0), gb, 333).meta)["status"], "accepted");
  auto w = a.pull_parts(1, 3, &clock);
  ASSERT_EQ(clock, 1u);
  for (int64_t i = 0; i < kTotal; ++i) ASSERT_NEAR(w[i], 1.f - 0.5f * (ga[i] + gb[i]) / 2, 1e-6) << i;
}

// Random part sizes, and pushes spoiled in random ways (a skipped part, NaN or
// Inf in a random part, a wrong total, abandoned half way): after every push
// the weights are exactly those of applying the good pushes alone.
TEST(Shard, RandomlySplitAndSpoiledPushesLeaveExactlyTheGoodUpdates) {
  auto o = softsync(1);
  o.alpha0 = 0.25;
  o.policy = StalenessPolicy::Constant;
  LocalShard shard(o, {}, /*part_floats=*/128);
  Client c(shard.endpoint);
  ASSERT_EQ(c.hello(1, shard.fp).header.type, MsgType::Welcome);
  std::mt19937 rng(11);
  uint64_t seq = 1, clock = 0;
  std::vector<float> oracle = c.pull_parts(1, seq++, &clock);
  int good = 0, rejected = 0;
  for (int round = 0; round < 60; ++round) {
    std::vector<float> g(kTotal);
    for (auto& v : g) v = std::uniform_real_distribution<float>(-1, 1)(rng);
    // Parts of random sizes.
    std::vector<std::pair<size_t, size_t>> parts;
    for (size_t at = 0; at < g.size();) {
      size_t n = std::min<size_t>(1 + rng() % 300, g.size() - at);
      parts.push_back({at, n});
      at += n;
    }
    const int kind = round < 10 ? 0 : static_cast<int>(rng() % 5);  // 0 = good
    if (kind == 1 && parts.size() < 3) continue;
    if (kind == 2) g[rng() % g.size()] = (rng() % 2) ? std::nanf("") : std::numeric_limits<float>::infinity();
    Header h = push_header(1, seq++, clock);
    std::string want = kind == 0 ? "accepted" : kind == 1 ? "protocol" : kind == 2 ? "non_finite" : "shape";
    for (size_t k = 0; k < parts.size(); ++k) {
      auto [at, n] = parts[k];
      if (kind == 1 && k == 1) continue;                      // a skipped part
      if (kind == 3 && k + 1 == parts.size()) n -= 1;  // one float short
      if (kind == 4 && k == parts.size() / 2) break;          // abandoned
      h.offset = at;
      h.flags = k + 1 < parts.size() ? kMoreParts : 0;
      c.s.send(nullptr, h, "", g.data() + at, n * 4);
    }
    if (kind == 4) {
      want = "";  // no answer; the next push replaces it
    } else {
      Message r = c.reply();
      std::string got = r.header.type == MsgType::PushAck ? json::parse(r.meta)["status"].get<std::string>()
                                                          : json::parse(r.meta)["code"].get<std::string>();
      ASSERT_EQ(got, want) << "round " << round << " kind " << kind;
    }
    if (kind == 0) {
      for (int64_t i = 0; i < kTotal; ++i) oracle[i] = oracle[i] - 0.25f * g[i];
      good += 1;
    } else if (kind != 4) {
      rejected += 1;
    }
    auto w = c.pull_parts(1, seq++, &clock);
    ASSERT_EQ(clock, static_cast<uint64_t>(good)) << "round " << round;
    for (int64_t i = 0; i < kTotal; ++i) ASSERT_EQ(w[i], oracle[i]) << "round " << round << " float " << i;
  }
  auto s = shard.finish();
  EXPECT_EQ(s["updates"], good);
  EXPECT_EQ(s["gradients_rejected"].get<int>(), rejected);
  EXPECT_GT(good, 15);
  EXPECT_GT(rejected, 15);
}

TEST(Curve, KeyFilesRoundTripAndBadFilesAreRefused) {
  if (!curve_available()) GTEST_SKIP() << "libzmq without CURVE";
  testing::TempDir d;
  auto k = generate_curve_keys();
  save_curve_keys(d.file("job.keys"), k);
  auto back = load_curve_keys(d.file("job.keys"));
  EXPECT_EQ(back.public_key, k.public_key);
  EXPECT_EQ(back.secret_key, k.secret_key);
  write_file_atomic(d.file("bad.keys"), "public abc\n");
  EXPECT_THROW(load_curve_keys(d.file("bad.keys")), InvalidInput);
}

}  // namespace
}  // namespace limbo::ps
