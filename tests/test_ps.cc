// Parameter server: aggregator, leases, codec (with a randomized fuzz),
// partitioning, and a shard served in-process (handshake, rejections,
// garbage, CURVE).
#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <nlohmann/json.hpp>

#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <set>
#include <thread>

#include "common/error.h"
#include "common/files.h"
#include "ps/aggregator.h"
#include "ps/leases.h"
#include "ps/protocol.h"
#include "ps/server.h"
#include "ps/transport.h"
#include "test_util.h"

namespace limbo::ps {
namespace {

using json = nlohmann::json;

AggregatorOptions softsync(int n, StalenessPolicy p = StalenessPolicy::Inverse) {
  AggregatorOptions o;
  o.protocol = Protocol::Softsync;
  o.softsync_n = n;
  o.policy = p;
  o.alpha0 = 0.1;
  return o;
}

TEST(Aggregator, GradientsPerUpdateFollowLambdaAndN) {
  Aggregator a(softsync(2));
  EXPECT_EQ(a.c(), 1);  // no learners yet
  for (uint32_t i = 0; i < 7; ++i) a.add_learner(i);
  EXPECT_EQ(a.c(), 3);  // floor(7 / 2)
  Aggregator b(softsync(7));
  for (uint32_t i = 0; i < 7; ++i) b.add_learner(i);
  EXPECT_EQ(b.c(), 1);  // n = lambda: plain async
  Aggregator c(softsync(10));
  for (uint32_t i = 0; i < 4; ++i) c.add_learner(i);
  EXPECT_EQ(c.c(), 1);  // never below one
  a.remove_learner(0);
  EXPECT_EQ(a.c(), 3);  // floor(6 / 2)
  a.remove_learner(1);
  EXPECT_EQ(a.c(), 2);  // floor(5 / 2): recomputed when lambda changes
}

TEST(Aggregator, StalenessAndLearningRate) {
  EXPECT_DOUBLE_EQ(staleness_lr(StalenessPolicy::Inverse, 0.1, 0), 0.1);
  EXPECT_DOUBLE_EQ(staleness_lr(StalenessPolicy::Inverse, 0.1, 1), 0.1);
  EXPECT_DOUBLE_EQ(staleness_lr(StalenessPolicy::Inverse, 0.1, 4), 0.025);
  EXPECT_DOUBLE_EQ(staleness_lr(StalenessPolicy::Constant, 0.1, 4), 0.1);

  Aggregator a(softsync(2));  // lambda 2, n 2 -> c 1
  a.add_learner(1);
  a.add_learner(2);
  a.on_pull(1);
  a.on_pull(2);  // both pulled clock 0
  auto o1 = a.offer(1, 0);
  EXPECT_EQ(o1.outcome, Aggregator::Offer::Accepted);
  EXPECT_EQ(o1.tau, 0);
  ASSERT_TRUE(a.ready());
  EXPECT_EQ(a.commit(), std::vector<int64_t>{0});
  EXPECT_EQ(a.clock(), 1u);
  auto o2 = a.offer(2, 0);  // computed on clock 0, arrives at clock 1
  EXPECT_EQ(o2.tau, 1);
  a.commit();
  a.on_pull(1);  // clock 2
  a.commit();
  a.set_clock(a.clock() + 2);  // the clock moves on (other learners' updates)
  auto o3 = a.offer(1, 2);
  EXPECT_EQ(o3.tau, 3);
  EXPECT_DOUBLE_EQ(o3.alpha, 0.1 / 3);
  auto bad = a.offer(1, 999);
  EXPECT_EQ(bad.outcome, Aggregator::Offer::Rejected);  // from the future
  EXPECT_EQ(a.offer(42, 0).outcome, Aggregator::Offer::Rejected);  // unknown learner
}

TEST(Aggregator, HardsyncWaitsForEveryRegisteredLearner) {
  AggregatorOptions o;
  o.protocol = Protocol::Hardsync;
  Aggregator a(o);
  for (uint32_t i = 1; i <= 3; ++i) {
    a.add_learner(i);
    a.on_pull(i);
  }
  EXPECT_EQ(a.offer(1, 0).outcome, Aggregator::Offer::Accepted);
  EXPECT_FALSE(a.may_pull(1));  // held until the round's update
  EXPECT_TRUE(a.may_pull(2));
  EXPECT_EQ(a.offer(1, 0).outcome, Aggregator::Offer::Rejected);  // one gradient per learner per round
  EXPECT_EQ(a.offer(2, 0).outcome, Aggregator::Offer::Accepted);
  EXPECT_FALSE(a.ready());
  // Learner 3 goes away: the barrier no longer waits for it.
  a.remove_learner(3);
  ASSERT_TRUE(a.ready());
  EXPECT_EQ(a.commit().size(), 2u);
  EXPECT_TRUE(a.may_pull(1));
  // A learner joining mid-round is waited for.
  a.on_pull(1);
  a.on_pull(2);
  a.offer(1, 1);
  a.offer(2, 1);
  a.add_learner(9);
  EXPECT_FALSE(a.ready());
  a.on_pull(9);
  a.offer(9, 1);
  EXPECT_TRUE(a.ready());
}

TEST(Aggregator, StalenessBoundDropsOrWaits) {
  auto o = softsync(2);  // lambda 2 -> c 1
  o.max_staleness = 2;
  o.bound_action = BoundAction::Drop;
  Aggregator d(o);
  d.add_learner(1);
  d.add_learner(2);
  d.on_pull(2);  // learner 2 pulls at clock 0 and is slow
  for (int i = 0; i < 3; ++i) {
    d.on_pull(1);
    d.offer(1, d.clock());
    d.commit();
  }
  auto late = d.offer(2, 0);  // tau = 3 > 2
  EXPECT_EQ(late.outcome, Aggregator::Offer::Dropped);
  EXPECT_EQ(late.tau, 3);
  EXPECT_FALSE(d.ready());

  o.bound_action = BoundAction::Wait;
  Aggregator w(o);
  w.add_learner(1);
  w.add_learner(2);
  w.on_pull(2);
  for (int i = 0; i < 2; ++i) {
    w.on_pull(1);
    w.offer(1, w.clock());
    ASSERT_TRUE(w.ready());
    w.commit();
  }
  // Clock 2: a third update would leave learner 2 three behind: held.
  w.on_pull(1);
  w.offer(1, w.clock());
  EXPECT_FALSE(w.ready());
  EXPECT_FALSE(w.may_pull(1));  // the fast learner waits
  auto o2 = w.offer(2, 0);      // the slow one arrives within the bound
  EXPECT_EQ(o2.outcome, Aggregator::Offer::Accepted);
  EXPECT_EQ(o2.tau, 2);
  ASSERT_TRUE(w.ready());
  EXPECT_EQ(w.commit().size(), 2u);
  EXPECT_TRUE(w.may_pull(1));
}

TEST(Leases, LearnersComingAndGoingNeitherRepeatNorSkip) {
  const int64_t n = 1000, batch = 7, epochs = 3;
  LeaseBook book(n, batch, epochs);
  std::mt19937 rng(5);
  std::map<uint32_t, Lease> holding;
  std::vector<std::vector<int>> seen(epochs, std::vector<int>(n, 0));
  uint32_t next_learner = 0;
  for (int i = 0; i < 4; ++i) holding[next_learner++] = Lease{};
  std::map<uint32_t, bool> has;
  for (int round = 0; round < 100000; ++round) {
    if (holding.empty()) holding[next_learner++] = Lease{};
    auto it = holding.begin();
    std::advance(it, rng() % holding.size());
    uint32_t id = it->first;
    int r = rng() % 10;
    if (r == 0) {  // leaves (or crashes) while holding its lease
      book.release(id);
      holding.erase(it);
      has.erase(id);
      if (rng() % 2) holding[next_learner++] = Lease{};  // someone joins
      continue;
    }
    if (has[id]) {  // completes
      const Lease& l = it->second;
      ASSERT_TRUE(book.complete(l.id));
      for (int64_t p = l.position; p < l.position + l.count; ++p) seen[l.epoch][p] += 1;
      has[id] = false;
      continue;
    }
    Lease l;
    auto res = book.next(id, l);
    if (res == LeaseBook::Next::Done) break;
    if (res == LeaseBook::Next::Granted) {
      it->second = l;
      has[id] = true;
    }
  }
  for (int64_t e = 0; e < epochs; ++e)
    for (int64_t p = 0; p < n; ++p) ASSERT_EQ(seen[e][p], 1) << "epoch " << e << " position " << p;
  EXPECT_EQ(book.completed_samples(), n * epochs);
}

TEST(Leases, AskingAgainReturnsTheAbandonedLease) {
  LeaseBook book(100, 10, 1);
  Lease a, b, c;
  book.next(1, a);
  book.next(1, b);  // the reply with `a` was lost: `a` is handed out again
  EXPECT_EQ(book.open(), 1);
  EXPECT_EQ(b.position, a.position);
  EXPECT_FALSE(book.complete(a.id));  // the old lease id no longer counts
  book.next(2, c);
  EXPECT_EQ(c.position, a.position + 10);
}

TEST(Partition, ContiguousAndBalancedByBytes) {
  auto r = partition(10, 3);
  ASSERT_EQ(r.size(), 3u);
  EXPECT_EQ(r[0].offset, 0);
  int64_t covered = 0, mn = 100, mx = 0;
  for (const auto& x : r) {
    EXPECT_EQ(x.offset, covered);
    covered += x.numel;
    mn = std::min(mn, x.numel);
    mx = std::max(mx, x.numel);
  }
  EXPECT_EQ(covered, 10);
  EXPECT_LE(mx - mn, 1);
  EXPECT_THROW(partition(2, 3), InvalidInput);
}

// ---- codec ---------------------------------------------------------------------

struct Owned {
  std::vector<std::string> bytes;
  std::vector<Frame> frames() const {
    std::vector<Frame> f;
    for (const auto& b : bytes) f.push_back({reinterpret_cast<const unsigned char*>(b.data()), b.size(), nullptr});
    return f;
  }
};

Owned encode(Header h, const std::string& meta, const std::vector<float>& payload) {
  h.payload_bytes = payload.size() * 4;
  unsigned char hdr[kHeaderBytes];
  encode_header(h, hdr);
  return {{std::string(reinterpret_cast<char*>(hdr), kHeaderBytes), meta,
           std::string(reinterpret_cast<const char*>(payload.data()), payload.size() * 4)}};
}

TEST(Codec, RoundTripsEveryField) {
  Header h;
  h.type = MsgType::Push;
  h.flags = kWantLease;
  h.sender = 0xdeadbeef;
  h.shard = 3;
  h.clock = 1234567890123ull;
  h.seq = 77;
  h.aux = -5;
  std::vector<float> g = {1.5f, -2.f, 0.25f};
  auto m = encode(h, R"({"a":1})", g);
  auto d = decode(m.frames(), 1 << 20);
  ASSERT_EQ(d.reject, Reject::None) << d.detail;
  EXPECT_EQ(d.msg.header.type, MsgType::Push);
  EXPECT_EQ(d.msg.header.flags, kWantLease);
  EXPECT_EQ(d.msg.header.sender, 0xdeadbeefu);
  EXPECT_EQ(d.msg.header.shard, 3u);
  EXPECT_EQ(d.msg.header.clock, 1234567890123ull);
  EXPECT_EQ(d.msg.header.seq, 77u);
  EXPECT_EQ(d.msg.header.aux, -5);
  EXPECT_EQ(d.msg.meta, R"({"a":1})");
  ASSERT_EQ(d.msg.floats(), 3u);
  EXPECT_EQ(std::memcmp(d.msg.payload.data, g.data(), 12), 0);
}

TEST(Codec, RejectsEachKindOfMalformedMessage) {
  Header h;
  h.type = MsgType::Push;
  auto good = encode(h, "", {1.f, 2.f});
  auto expect = [](Owned m, Reject r, uint64_t limit = 1 << 20) {
    auto d = decode(m.frames(), limit);
    EXPECT_EQ(d.reject, r) << reject_name(d.reject) << ": " << d.detail;
    EXPECT_FALSE(d.detail.empty());
  };
  {
    auto m = good;
    m.bytes.pop_back();
    expect(m, Reject::FrameCount);
  }
  {
    auto m = good;
    m.bytes[0].pop_back();
    expect(m, Reject::HeaderSize);  // truncated
  }
  {
    auto m = good;
    m.bytes[0][0] ^= 0x55;
    expect(m, Reject::Magic);
  }
  {
    Header v = h;
    v.version = kProtocolVersion + 1;
    expect(encode(v, "", {}), Reject::Version);
  }
  {
    auto m = good;
    m.bytes[0][6] = 99;
    expect(m, Reject::Type);
  }
  expect(encode(h, "not json", {}), Reject::MetaJson);
  expect(encode(h, "[1,2]", {}), Reject::MetaJson);
  expect(encode(h, std::string(kMaxMetaBytes + 1, ' '), {}), Reject::MetaSize);
  {
    auto m = good;
    m.bytes[2].pop_back();  // truncated payload
    expect(m, Reject::PayloadSize);
  }
  expect(encode(h, "", std::vector<float>(1000)), Reject::Oversized, 100);
}

TEST(Codec, RandomizedInputNeverCrashesAndValidOnesStayValid) {
  // A fuzz run inside the suite: mutate valid messages (bit flips, byte
  // overwrites, truncation, extension, frame drops) and random frames.
  std::mt19937_64 rng(2026);
  Header h;
  h.type = MsgType::Push;
  h.seq = 9;
  auto base = encode(h, R"({"lease":{"id":3}})", std::vector<float>(64, 0.5f));
  int accepted = 0, rejected = 0;
  for (int iter = 0; iter < 200000; ++iter) {
    Owned m = base;
    int edits = 1 + static_cast<int>(rng() % 4);
    for (int e = 0; e < edits; ++e) {
      auto& f = m.bytes[rng() % m.bytes.size()];
      switch (rng() % 6) {
        case 0:
          if (!f.empty()) f[rng() % f.size()] ^= static_cast<char>(1 << (rng() % 8));
          break;
        case 1:
          if (!f.empty()) f[rng() % f.size()] = static_cast<char>(rng());
          break;
        case 2:
          f.resize(f.empty() ? 0 : rng() % f.size());
          break;
        case 3:
          f.append(rng() % 16, static_cast<char>(rng()));
          break;
        case 4:
          if (m.bytes.size() > 1 && rng() % 8 == 0) m.bytes.erase(m.bytes.begin() + static_cast<long>(rng() % m.bytes.size()));
          break;
        default: {
          std::string r(rng() % 80, '\0');
          for (auto& c : r) c = static_cast<char>(rng());
          f = r;
        }
      }
    }
    auto d = decode(m.frames(), 1 << 16);
    if (d.reject == Reject::None) {
      ++accepted;
      // Whatever passes is self-consistent.
      ASSERT_EQ(d.msg.payload.size, d.msg.header.payload_bytes);
      ASSERT_EQ(d.msg.payload.size % 4, 0u);
      ASSERT_LE(d.msg.meta.size(), kMaxMetaBytes);
    } else {
      ++rejected;
      ASSERT_FALSE(d.detail.empty());
    }
  }
  EXPECT_GT(rejected, 100000);
  EXPECT_GT(accepted, 0);  // e.g. flips in the clock or seq fields
}

TEST(Codec, FiniteCheck) {
  std::vector<float> v(1000, 1.f);
  EXPECT_TRUE(all_finite(v.data(), v.size()));
  v[777] = std::numeric_limits<float>::quiet_NaN();
  EXPECT_FALSE(all_finite(v.data(), v.size()));
  v[777] = -std::numeric_limits<float>::infinity();
  EXPECT_FALSE(all_finite(v.data(), v.size()));
}

// ---- a shard served in-process ---------------------------------------------------

constexpr int64_t kTotal = 1000;

struct LocalShard {
  explicit LocalShard(AggregatorOptions agg, CurveKeys keys = {}) : initial(kTotal, 1.f) {
    ServerOptions o;
    o.dir = dir.path() + "/shard";
    o.agg = agg;
    o.heartbeat_timeout = 30;
    o.max_payload_bytes = 1 << 20;
    server = std::make_unique<Server>(o, fp, initial.data(), kTotal, keys);
    endpoint = server->endpoint();
    thread = std::thread([this] { server->run(stop); });
  }
  ~LocalShard() {
    stop = true;
    thread.join();
  }
  json summary() { return json::parse(read_file(dir.path() + "/shard/summary.json")); }

  testing::TempDir dir;
  ModelFingerprint fp{"toy: w[1000]", fnv1a("toy")};
  std::vector<float> initial;
  std::unique_ptr<Server> server;
  std::string endpoint;
  std::atomic<bool> stop{false};
  std::thread thread;
};

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
  Transport t;
  Socket s;
};

Header push_header(uint32_t id, uint64_t seq, uint64_t clock = 0) {
  Header h;
  h.type = MsgType::Push;
  h.sender = id;
  h.seq = seq;
  h.clock = clock;
  h.aux = -1;
  return h;
}

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
}

TEST(Shard, AppliesTheStalenessWeightedUpdateAndRejectsBadGradients) {
  auto o = softsync(1);
  o.alpha0 = 0.5;
  LocalShard shard(o);
  Client c(shard.endpoint);
  ASSERT_EQ(c.hello(1, shard.fp).header.type, MsgType::Welcome);
  Header pull;
  pull.type = MsgType::Pull;
  pull.sender = 1;
  pull.seq = 1;
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
  shard.stop = true;
  shard.thread.join();
  shard.thread = std::thread([] {});
  auto s = shard.summary();
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
  Header pull;
  pull.type = MsgType::Pull;
  pull.sender = 5;
  pull.seq = 2;
  EXPECT_EQ(good.call(pull, "").header.type, MsgType::Weights);
  shard.stop = true;
  shard.thread.join();
  shard.thread = std::thread([] {});
  auto s = shard.summary();
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
  shard.stop = true;
  shard.thread.join();
  shard.thread = std::thread([] {});
  auto s = shard.summary();
  EXPECT_GE(s["curve_peers_refused"].get<int64_t>(), 1);
  EXPECT_GE(s["curve_peers_accepted"].get<int64_t>(), 1);
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
