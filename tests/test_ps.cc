// Parameter server, the parts without sockets: aggregator, leases,
// partitioning, staleness statistics, the codec (with a randomized fuzz).
// A shard's state (its update, buffers, the push residual) is tested in
// test_ps_state.cc; a shard served in-process in test_ps_shard.cc.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <set>

#include "common/error.h"
#include "common/files.h"
#include "ps/aggregator.h"
#include "ps/leases.h"
#include "ps/protocol.h"
#include "ps/server.h"
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
  EXPECT_DOUBLE_EQ(staleness_lr(StalenessPolicy::InverseSqrt, 0.1, 0), 0.1);
  EXPECT_DOUBLE_EQ(staleness_lr(StalenessPolicy::InverseSqrt, 0.1, 4), 0.05);
  EXPECT_EQ(parse_staleness_policy("inverse_sqrt"), StalenessPolicy::InverseSqrt);
  EXPECT_STREQ(policy_name(StalenessPolicy::InverseSqrt), "inverse_sqrt");

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
}  // namespace limbo::ps
