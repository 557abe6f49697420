// Parameter server, the parts without sockets: aggregator, leases,
// partitioning, staleness statistics, the codec (with a randomized fuzz),
// the buffers shard 0 holds and a learner's 16-bit push residual.
// A shard served in-process is tested in test_ps_shard.cc.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <set>

#include "common/error.h"
#include "common/files.h"
#include "common/half.h"
#include "ps/aggregator.h"
#include "ps/buffer_mean.h"
#include "ps/push_residual.h"
#include "ps/leases.h"
#include "ps/protocol.h"
#include "ps/server.h"
#include "ps/shard_state.h"
#include "ps/staleness.h"
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

// The same with the model's buffers as a fourth frame (flag kBuffers).
Owned encode(Header h, const std::string& meta, const std::vector<float>& payload, const std::vector<float>& buffers) {
  h.flags |= kBuffers;
  Owned m = encode(h, meta, payload);
  m.bytes.emplace_back(reinterpret_cast<const char*>(buffers.data()), buffers.size() * 4);
  return m;
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
  h.offset = 1ull << 33;
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
  EXPECT_EQ(d.msg.header.offset, 1ull << 33);
  EXPECT_EQ(d.msg.meta, R"({"a":1})");
  ASSERT_EQ(d.msg.floats(), 3u);
  EXPECT_EQ(std::memcmp(d.msg.payload.data, g.data(), 12), 0);
  EXPECT_EQ(d.msg.buffers.size, 0u);
  // The model's buffers in a fourth frame.
  std::vector<float> b = {0.5f, 7.f};
  auto mb = encode(h, "", g, b);
  auto db = decode(mb.frames(), 1 << 20);
  ASSERT_EQ(db.reject, Reject::None) << db.detail;
  EXPECT_EQ(db.msg.header.flags, kWantLease | kBuffers);
  ASSERT_EQ(db.msg.buffer_floats(), 2u);
  EXPECT_EQ(std::memcmp(db.msg.buffers.data, b.data(), 8), 0);
  ASSERT_EQ(db.msg.floats(), 3u);
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
    // A peer of version 1 (48-byte header) is told about the version, not
    // about the header size.
    v.version = 1;
    auto old = encode(v, "", {});
    old.bytes[0].resize(48);
    expect(old, Reject::Version);
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
  // Buffers: a fourth frame only with the flag and the flag only with it,
  // whole floats, at most kMaxBufferFloats.
  {
    auto m = encode(h, "", {1.f}, {2.f});
    m.bytes.pop_back();  // flagged, no fourth frame
    expect(m, Reject::FrameCount);
    auto extra = good;
    extra.bytes.push_back("abcd");  // a fourth frame, not flagged
    expect(extra, Reject::FrameCount);
    auto odd = encode(h, "", {1.f}, {2.f});
    odd.bytes[3].pop_back();
    expect(odd, Reject::PayloadSize);
    expect(encode(h, "", {1.f}, std::vector<float>(kMaxBufferFloats + 1)), Reject::Oversized);
  }
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

TEST(Codec, PartSizesKeepPushesWithinTheMostParts) {
  EXPECT_EQ(part_size(0, 10), 10);       // 0: whole slices
  EXPECT_EQ(part_size(3, 10), 3);
  EXPECT_EQ(part_size(20, 10), 10);
  EXPECT_EQ(part_size(1, 100000), 25);   // ceil(100000 / 4096)
  EXPECT_LE((100000 + part_size(1, 100000) - 1) / part_size(1, 100000), kMaxParts);
  EXPECT_EQ(part_size(1 << 18, 10000000), 1 << 18);
}

TEST(Codec, FiniteCheck) {
  std::vector<float> v(1000, 1.f);
  EXPECT_TRUE(all_finite(v.data(), v.size()));
  v[777] = std::numeric_limits<float>::quiet_NaN();
  EXPECT_FALSE(all_finite(v.data(), v.size()));
  v[777] = -std::numeric_limits<float>::infinity();
  EXPECT_FALSE(all_finite(v.data(), v.size()));
}

TEST(Staleness, StatisticsFromAHistogram) {
  StalenessHist h = {{0, 10}, {1, 60}, {2, 29}, {7, 1}};
  auto st = staleness_stats(h);
  EXPECT_EQ(st.count, 100);
  EXPECT_DOUBLE_EQ(st.mean, (60 + 58 + 7) / 100.0);
  EXPECT_EQ(st.p99, 2);  // 99 of 100 gradients have tau <= 2
  EXPECT_EQ(st.max, 7);
  StalenessHist back;
  add_hist_json(back, hist_to_json(h));
  add_hist_json(back, hist_to_json(h));
  EXPECT_EQ(back[1], 120);
  EXPECT_EQ(staleness_stats({}).count, 0);
}

}  // namespace
// Found: the shard streamed its update part by part only without momentum
// and weight decay, so the default job (momentum 0.9) never streamed. Now a
// streamed step with momentum and weight decay gives the same result as the
// rule written out, an abandoned step (overtaken) leaves the momentum as it
// was, and a step with a NaN part changes nothing.
TEST(ShardStateTest, StreamsWithMomentumAndWeightDecay) {
  const int64_t n = 1000;
  const double alpha0 = 0.1, mu = 0.9, wd = 0.01;
  std::vector<float> w(n), g1(n), g2(n);
  for (int64_t i = 0; i < n; ++i) {
    w[i] = 0.5f - 0.001f * i;
    g1[i] = 0.01f * static_cast<float>(i % 13) - 0.05f;
    g2[i] = -0.02f * static_cast<float>(i % 7) + 0.03f;
  }
  optim::OptimizerOptions so;
  so.momentum = mu;
  so.weight_decay = wd;
  ShardState s(n, w.data(), UpdateOptions{alpha0, so});
  ASSERT_TRUE(s.streams());
  auto stream = [&](const std::vector<float>& g, double alpha, int64_t parts, bool finish = true) {
    StreamedStep st = s.begin_step(alpha);
    for (int64_t k = 0; k < parts; ++k) {
      const int64_t a = n * k / parts, b = n * (k + 1) / parts;
      s.step_part(st, GradPart{a, g.data() + a, b - a});
    }
    if (!finish) {
      s.abandon(st);
      return true;
    }
    return s.finish_step(st);
  };
  // Step 1: v = d, w1 = w0 - v.
  std::vector<double> v(n), want(n);
  ASSERT_TRUE(stream(g1, 0.1, 3));
  for (int64_t i = 0; i < n; ++i) {
    v[i] = 0.1 * g1[i] + alpha0 * wd * w[i];
    want[i] = w[i] - v[i];
  }
  // An overtaken step, abandoned after two of three parts: nothing changes.
  stream(g2, 0.05, 2, /*finish=*/false);
  // Step 2 with the second gradient, streamed: v = mu v + d.
  ASSERT_TRUE(stream(g2, 0.05, 4));
  for (int64_t i = 0; i < n; ++i) {
    const double d = 0.05 * g2[i] + alpha0 * wd * want[i];
    v[i] = mu * v[i] + d;
    want[i] = want[i] - v[i];
  }
  const float* got = s.weights()->data_ptr<float>();
  const float* mom = s.optimizer().state()[0].data_ptr<float>();
  for (int64_t i = 0; i < n; ++i) {
    ASSERT_NEAR(got[i], want[i], 1e-6) << i;
    ASSERT_NEAR(mom[i], v[i], 1e-6) << i;
  }
  // A NaN in the last part: refused, weights and momentum untouched.
  auto bad = g1;
  bad[n - 1] = std::nanf("");
  auto before = s.weights();
  std::vector<float> mom_before(mom, mom + n);
  EXPECT_FALSE(stream(bad, 0.1, 3));
  EXPECT_EQ(s.weights(), before);
  EXPECT_EQ(std::memcmp(s.optimizer().state()[0].data_ptr<float>(), mom_before.data(), n * 4), 0);
}

// 16-bit gradient parts (comm.compression) are widened a chunk at a time
// inside the update instead of into a copy of the part: the same weights and
// optimizer state, bit for bit, as the widened floats (SGD with momentum and
// weight decay, AdamW; streamed, whole and accumulated; parts longer than a
// chunk and not a multiple of it), and NaN or Inf among the 16-bit values is
// refused with nothing changed.
TEST(ShardStateTest, SixteenBitPartsUpdateExactlyAsTheirWidenedFloats) {
  const int64_t n = 20000 + 123;  // parts of ~6,700 and ~10,000 values; chunks of 8,192
  for (const char* algorithm : {"sgd", "adamw"}) {
    for (HalfKind kind : {HalfKind::Bf16, HalfKind::Fp16}) {
      SCOPED_TRACE(std::string(algorithm) + (kind == HalfKind::Bf16 ? " bf16" : " fp16"));
      optim::OptimizerOptions oo;
      oo.algorithm = algorithm;
      oo.momentum = 0.9;
      oo.weight_decay = 0.01;
      std::vector<float> w(n);
      for (int64_t i = 0; i < n; ++i) w[i] = 0.5f - 1e-5f * static_cast<float>(i);
      ShardState halves(n, w.data(), UpdateOptions{0.1, oo}), floats(n, w.data(), UpdateOptions{0.1, oo});
      auto step = [&](ShardState& st, const std::vector<uint16_t>& h, const std::vector<float>& f, int64_t parts,
                      bool use_halves, double alpha) {
        StreamedStep s = st.begin_step(alpha);
        for (int64_t k = 0; k < parts; ++k) {
          const int64_t a = n * k / parts, b = n * (k + 1) / parts;
          GradPart p{a, use_halves ? nullptr : f.data() + a, b - a};
          if (use_halves) {
            p.halves = h.data() + a;
            p.bf16 = kind == HalfKind::Bf16;
          }
          st.step_part(s, p);
        }
        return st.finish_step(s);
      };
      for (int r = 0; r < 3; ++r) {
        std::vector<float> g(n), wide(n);
        for (int64_t i = 0; i < n; ++i) g[i] = 0.01f * static_cast<float>((i * (r + 3)) % 17) - 0.08f;
        std::vector<uint16_t> h(n);
        floats_to_halves(kind, g.data(), h.data(), static_cast<size_t>(n));
        halves_to_floats(kind, h.data(), wide.data(), static_cast<size_t>(n));
        ASSERT_TRUE(step(halves, h, wide, 2 + r, true, 0.1 / (r + 1)));
        ASSERT_TRUE(step(floats, h, wide, 2 + r, false, 0.1 / (r + 1)));
      }
      ASSERT_EQ(std::memcmp(halves.weights()->data_ptr<float>(), floats.weights()->data_ptr<float>(), n * 4), 0);
      for (size_t i = 0; i < floats.optimizer().state().size(); ++i)
        ASSERT_EQ(std::memcmp(halves.optimizer().state()[i].data_ptr<float>(),
                              floats.optimizer().state()[i].data_ptr<float>(), n * 4),
                  0)
            << i;
      // Accumulated (several gradients make an update): the same sums.
      std::vector<float> g(n, 0.0625f), wide(n);
      std::vector<uint16_t> h(n);
      floats_to_halves(kind, g.data(), h.data(), static_cast<size_t>(n));
      halves_to_floats(kind, h.data(), wide.data(), static_cast<size_t>(n));
      GradPart ph{0, nullptr, n}, pf{0, wide.data(), n};
      ph.halves = h.data();
      ph.bf16 = kind == HalfKind::Bf16;
      ASSERT_TRUE(halves.accumulate(std::vector<GradPart>{ph}, 0.05));
      ASSERT_TRUE(floats.accumulate(std::vector<GradPart>{pf}, 0.05));
      halves.apply(1);
      floats.apply(1);
      ASSERT_EQ(std::memcmp(halves.weights()->data_ptr<float>(), floats.weights()->data_ptr<float>(), n * 4), 0);
      // NaN, then Inf, in the last chunk of the last part: refused, nothing changed.
      for (float bad : {std::nanf(""), std::numeric_limits<float>::infinity()}) {
        auto spoiled = g;
        spoiled[n - 1] = bad;
        floats_to_halves(kind, spoiled.data(), h.data(), static_cast<size_t>(n));
        auto before = halves.weights();
        EXPECT_FALSE(step(halves, h, wide, 3, true, 0.1));
        EXPECT_EQ(halves.weights(), before);
        EXPECT_FALSE(halves.accumulate(std::vector<GradPart>{ph}, 0.05));
      }
    }
  }
}

// Each shard keeps the AdamW state of its own slice: two shards of half the
// weights, fed the halves of the same gradients at the same rates, hold
// exactly what one shard of all of them holds and what the optimizer's own
// update gives at lr = alpha (the staleness rule divides Adam's rate; its
// decoupled decay runs at the base rate alpha0). An abandoned streamed step
// leaves the state and the update count as they were.
TEST(ShardStateTest, EachShardKeepsTheAdamStateOfItsSlice) {
  const int64_t n = 1000, half = 500;
  const double alpha0 = 1e-3;
  torch::manual_seed(5);
  auto w0 = torch::randn({n});
  auto grads = torch::randn({4, n});
  optim::OptimizerOptions oo;
  oo.algorithm = "adamw";
  oo.weight_decay = 0.1;
  ShardState whole(n, w0.data_ptr<float>(), UpdateOptions{alpha0, oo});
  ShardState lo(half, w0.data_ptr<float>(), UpdateOptions{alpha0, oo});
  ShardState hi(half, w0.data_ptr<float>() + half, UpdateOptions{alpha0, oo});
  auto ref_opt = optim::make_optimizer(oo);
  torch::Tensor ref = w0.clone();
  std::vector<torch::Tensor> ref_state = {torch::zeros({n}), torch::zeros({n})};
  const double alphas[] = {alpha0, alpha0 / 2, alpha0 / 3, alpha0};  // staleness 0, 2, 3, 0
  for (int t = 0; t < 4; ++t) {
    auto g = grads[t].contiguous();
    const float* gp = g.data_ptr<float>();
    ASSERT_TRUE(whole.step_single(gp, alphas[t]));
    ASSERT_TRUE(lo.step_single(gp, alphas[t]));
    ASSERT_TRUE(hi.step_single(gp + half, alphas[t]));
    optim::UpdateSlice sl;
    sl.w_out = ref.data_ptr<float>();
    sl.w = ref.data_ptr<float>();
    sl.g = gp;
    for (int i = 0; i < 2; ++i) {
      sl.s_out[i] = ref_state[i].data_ptr<float>();
      sl.s[i] = t == 0 ? nullptr : ref_state[i].data_ptr<float>();
    }
    sl.n = n;
    ASSERT_TRUE(ref_opt->update(sl, optim::UpdateScalars{alphas[t], alpha0, t + 1}));
    if (t == 1) {  // an overtaken step, abandoned half way: nothing changes
      StreamedStep st = whole.begin_step(alpha0);
      whole.step_part(st, GradPart{0, gp, half});
      whole.abandon(st);
    }
  }
  auto joined = torch::cat({*lo.weights(), *hi.weights()});
  EXPECT_TRUE(torch::equal(*whole.weights(), joined));
  EXPECT_TRUE(torch::equal(*whole.weights(), ref));
  EXPECT_EQ(whole.optimizer().steps(), 4);
  EXPECT_EQ(whole.optimizer().state_names(), (std::vector<std::string>{"exp_avg", "exp_avg_sq"}));
  for (int i = 0; i < 2; ++i) {
    EXPECT_TRUE(torch::equal(whole.optimizer().state()[i],
                             torch::cat({lo.optimizer().state()[i], hi.optimizer().state()[i]})));
    EXPECT_TRUE(torch::equal(whole.optimizer().state()[i], ref_state[i]));
  }
}

// Shard 0's buffers: an update makes them the mean of the buffers its
// gradients brought (the first `averaged` floats), the rest from the first
// of them; pushes without buffers or that do not fit change nothing.
TEST(BufferMean, AnUpdateAveragesFloatsAndTakesIntegersFromTheFirst) {
  auto add = [](BufferMean& b, std::vector<float> v, int64_t averaged) { return b.add(v.data(), v.size(), averaged); };
  BufferMean b;
  EXPECT_TRUE(b.empty());
  EXPECT_EQ(b.frame().size, 0u);
  b.commit();  // an update without buffers: nothing yet
  EXPECT_TRUE(b.empty());
  EXPECT_TRUE(add(b, {1.f, 10.f, 7.f, 3.f}, 2));
  EXPECT_TRUE(add(b, {3.f, 20.f, 9.f, 5.f}, 2));
  EXPECT_FALSE(add(b, {1.f, 2.f}, 2));              // another size: refused
  EXPECT_FALSE(add(b, {1.f, 2.f, 3.f, 4.f}, 3));    // another split: refused
  EXPECT_FALSE(add(b, {1.f, 2.f, 3.f, 4.f}, 5));    // more averaged than there are
  b.commit();
  EXPECT_EQ(b.value(), (std::vector<float>{2.f, 15.f, 7.f, 3.f}));
  EXPECT_EQ(b.averaged(), 2);
  // A reply frame keeps its buffers while the next update makes new ones.
  Frame sent = b.frame();
  ASSERT_EQ(sent.size, 16u);
  EXPECT_TRUE(add(b, {5.f, 5.f, 1.f, 1.f}, 2));
  b.commit();
  b.commit();  // an update with none keeps them
  EXPECT_EQ(b.value(), (std::vector<float>{5.f, 5.f, 1.f, 1.f}));
  EXPECT_EQ(std::vector<float>(reinterpret_cast<const float*>(sent.data), reinterpret_cast<const float*>(sent.data) + 4),
            (std::vector<float>{2.f, 15.f, 7.f, 3.f}));
  // Checkpoints carry them; a restored shard has them back.
  json m;
  b.write(m);
  BufferMean c;
  c.restore(m);
  EXPECT_EQ(c.value(), b.value());
  EXPECT_EQ(c.averaged(), 2);
}

// A 16-bit push's residual moves only when the shard accepted the push: a
// lost, dropped or rejected push leaves it, so the next push carries what
// the lost one held (in each shard's slice separately).
TEST(PushResidual, OnlyAnAcceptedPushMovesTheResidual) {
  std::vector<float> g = {1.0f + 1.0f / 4096, 3.0f + 1.0f / 1024, 0.1f, -7.00390625f};
  std::vector<uint16_t> w1(4), w2(4), w3(4);
  PushResidual r;
  r.encode(HalfKind::Bf16, g.data(), 4, 0, 2, w1.data());      // slice of shard 0
  r.encode(HalfKind::Bf16, g.data(), 4, 2, 2, w1.data() + 2);  // slice of shard 1
  for (float v : r.residual()) EXPECT_EQ(v, 0.f);              // nothing accepted yet
  r.encode(HalfKind::Bf16, g.data(), 4, 0, 4, w2.data());      // the same push again
  EXPECT_EQ(w1, w2);
  r.commit(2, 2);  // shard 1 accepted
  EXPECT_EQ(r.residual()[0], 0.f);
  EXPECT_EQ(r.residual()[1], 0.f);
  EXPECT_NE(r.residual()[2], 0.f);  // what bf16 dropped of 0.1
  // Shard 1's next push carries its residual; shard 0's does not change.
  r.encode(HalfKind::Bf16, g.data(), 4, 0, 4, w3.data());
  EXPECT_EQ(w3[0], w1[0]);
  EXPECT_EQ(w3[1], w1[1]);
  EXPECT_EQ(w3[2], float_to_bf16(g[2] + r.residual()[2]));
}

}  // namespace limbo::ps
