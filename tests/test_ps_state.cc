// Parameter server, a shard's state without sockets: the streamed update
// (momentum, weight decay, AdamW, 16-bit parts, abandoned steps), the
// buffers shard 0 holds and a learner's 16-bit push residual. The codec,
// aggregator and leases are tested in test_ps.cc.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "common/half.h"
#include "ps/buffer_mean.h"
#include "ps/push_parts.h"
#include "ps/push_residual.h"
#include "ps/shard_state.h"

namespace limbo::ps {

using json = nlohmann::json;

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
  // Step 2 with the second gradient (stale: half the rate), streamed:
  // v = mu v + d, the decay at the update's own rate.
  ASSERT_TRUE(stream(g2, 0.05, 4));
  for (int64_t i = 0; i < n; ++i) {
    const double d = 0.05 * g2[i] + 0.05 * wd * want[i];
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

// The fourth review (S1): a shard ran weight decay at the base rate alpha0
// in every update, whatever the update's staleness-divided rate, so
// n-softsync (about n updates a round, each at alpha0 / n) decayed n times
// what a hardsync round or a synchronous step does. By default the decay
// now runs at the update's rate (a synchronous AdamW step decays at its
// own rate); ps.weight_decay_rate = base keeps the former rule. With a zero
// gradient Adam's step is zero, so one update is the decay alone: w (1 -
// rate wd), for SGD and AdamW, whole and streamed.
TEST(ShardStateTest, WeightDecayRunsAtTheUpdatesRateUnlessTheBaseRateIsAsked) {
  const int64_t n = 64;
  const double alpha0 = 0.1, wd = 0.5, alpha = alpha0 / 4;  // a gradient of staleness 4
  std::vector<float> w(n), zero(n, 0.0f);
  for (int64_t i = 0; i < n; ++i) w[i] = 1.0f + 0.01f * static_cast<float>(i);
  for (const char* algorithm : {"sgd", "adamw"})
    for (bool base : {false, true})
      for (bool streamed : {false, true}) {
        SCOPED_TRACE(std::string(algorithm) + (base ? ", base rate" : ", update's rate") +
                     (streamed ? ", streamed" : ", whole"));
        optim::OptimizerOptions oo;
        oo.algorithm = algorithm;
        oo.momentum = 0;
        oo.weight_decay = wd;
        ShardState s(n, w.data(), UpdateOptions{alpha0, oo, base});
        if (streamed) {
          ASSERT_TRUE(s.streams());
          StreamedStep st = s.begin_step(alpha);
          s.step_part(st, GradPart{0, zero.data(), n});
          ASSERT_TRUE(s.finish_step(st));
        } else {
          ASSERT_TRUE(s.step_single(zero.data(), alpha));
        }
        const double rate = base ? alpha0 : alpha;
        const float* got = s.weights()->data_ptr<float>();
        for (int64_t i = 0; i < n; ++i) ASSERT_NEAR(got[i], w[i] * (1 - rate * wd), 1e-6) << i;
      }
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

// Found: every step in progress wrote its optimizer state into the same
// spare buffers. Learner A's push streams; learner B's push, not finite,
// completes meanwhile and is refused; A's update then adopted the state B
// had written over (NaN weights next, every later gradient refused). Now A
// ends exactly as it would alone, for SGD with momentum, Adam and AdamW,
// first update or later, with B refused before or after a finite update.
TEST(ShardStateTest, ARefusedPushDuringAStreamedOneLeavesItsStateAlone) {
  const int64_t n = 3000;
  std::vector<float> w(n), g1(n), g2(n), bad(n);
  for (int64_t i = 0; i < n; ++i) {
    w[i] = 0.3f - 1e-4f * static_cast<float>(i);
    g1[i] = 0.01f * static_cast<float>(i % 11) - 0.04f;
    g2[i] = -0.02f * static_cast<float>(i % 5) + 0.03f;
    bad[i] = 100.f * g2[i];
  }
  bad[n - 1] = std::nanf("");  // B writes every output before its last value says no
  for (const char* algorithm : {"sgd", "adam", "adamw"}) {
    SCOPED_TRACE(algorithm);
    optim::OptimizerOptions oo;
    oo.algorithm = algorithm;
    oo.momentum = 0.9;
    oo.weight_decay = 0.01;
    ShardState alone(n, w.data(), UpdateOptions{0.01, oo}), both(n, w.data(), UpdateOptions{0.01, oo});
    auto stream_a = [&](ShardState& st, const std::vector<float>& g, bool with_b) {
      StreamedStep a = st.begin_step(0.01);
      st.step_part(a, GradPart{0, g.data(), n / 2});
      if (with_b) {
        EXPECT_FALSE(st.step_single(bad.data(), 0.01));  // B: refused, whole
      }
      st.step_part(a, GradPart{n / 2, g.data() + n / 2, n - n / 2});
      EXPECT_TRUE(st.current(a));
      return st.finish_step(a);
    };
    for (int round = 0; round < 3; ++round) {
      const auto& g = round % 2 ? g2 : g1;
      ASSERT_TRUE(stream_a(alone, g, false));
      ASSERT_TRUE(stream_a(both, g, true)) << round;
      ASSERT_EQ(both.optimizer().steps(), alone.optimizer().steps());
      ASSERT_EQ(std::memcmp(both.weights()->data_ptr<float>(), alone.weights()->data_ptr<float>(), n * 4), 0)
          << round;
      for (size_t i = 0; i < alone.optimizer().state().size(); ++i)
        ASSERT_EQ(std::memcmp(both.optimizer().state()[i].data_ptr<float>(),
                              alone.optimizer().state()[i].data_ptr<float>(), n * 4),
                  0)
            << "round " << round << ", " << alone.optimizer().state_names()[i];
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
    ASSERT_TRUE(ref_opt->update(sl, optim::UpdateScalars{alphas[t], alphas[t], t + 1}));  // decay at the update's rate
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

// ZeroMQ may hand out a frame at any byte offset. A push part or buffers
// frame that starts off its values' alignment is read from an aligned copy
// (the same bytes); an aligned one is read in place.
TEST(PushAssembler, PartsAtAnyByteOffsetAreReadAligned) {
  for (const uint8_t enc : {uint8_t{0}, kBf16Values}) {
    SCOPED_TRACE(enc ? "bf16" : "float32");
    const size_t width = value_bytes(enc);
    std::vector<float> values = {0.5f, -1.25f, 3.0f, 7.5f, -0.125f};
    std::vector<unsigned char> bytes(values.size() * width);
    if (enc) {
      std::vector<uint16_t> halves(values.size());
      floats_to_halves(HalfKind::Bf16, values.data(), halves.data(), values.size());
      std::memcpy(bytes.data(), halves.data(), bytes.size());
    } else {
      std::memcpy(bytes.data(), values.data(), bytes.size());
    }
    // The payload one byte past an aligned address, in a buffer that owns it.
    auto store = std::make_shared<std::vector<float>>(bytes.size() / 4 + 2);
    auto* odd = reinterpret_cast<unsigned char*>(store->data()) + 1;
    std::memcpy(odd, bytes.data(), bytes.size());

    Frame f;
    f.data = odd;
    f.size = bytes.size();
    f.keep = store;
    const Frame a = aligned_frame(f, width);
    EXPECT_EQ(reinterpret_cast<uintptr_t>(a.data) % width, 0u);
    EXPECT_NE(a.data, f.data);
    ASSERT_EQ(a.size, f.size);
    EXPECT_EQ(std::memcmp(a.data, bytes.data(), bytes.size()), 0);
    const Frame in_place = aligned_frame(a, width);
    EXPECT_EQ(in_place.data, a.data);

    // A push of one part at that offset: its values, read where the part says.
    Message m;
    m.header.type = MsgType::Push;
    m.header.sender = 7;
    m.header.seq = 1;
    m.header.flags = enc;
    m.header.payload_bytes = f.size;
    m.payload = f;
    PushAssembler pa(static_cast<int64_t>(values.size()));
    auto r = pa.add(m, 0);
    ASSERT_EQ(r.outcome, PushAssembler::Result::Outcome::Added) << r.why;
    ASSERT_TRUE(r.complete);
    std::vector<float> got(values.size());
    if (enc) {
      ASSERT_NE(r.part.halves, nullptr);
      EXPECT_EQ(reinterpret_cast<uintptr_t>(r.part.halves) % alignof(uint16_t), 0u);
      halves_to_floats(HalfKind::Bf16, r.part.halves, got.data(), got.size());
    } else {
      ASSERT_NE(r.part.data, nullptr);
      EXPECT_EQ(reinterpret_cast<uintptr_t>(r.part.data) % alignof(float), 0u);
      std::copy(r.part.data, r.part.data + got.size(), got.begin());
    }
    EXPECT_EQ(got, values);  // each value is exact in bf16
    // The assembled push keeps the aligned bytes alive after the frame it came in is gone.
    PartedPush push = pa.take(7);
    ASSERT_EQ(push.parts.size(), 1u);
    store.reset();
    f = Frame();
    m = Message();
    std::vector<float> again(values.size());
    if (enc) halves_to_floats(HalfKind::Bf16, push.parts[0].halves, again.data(), again.size());
    else std::copy(push.parts[0].data, push.parts[0].data + again.size(), again.begin());
    EXPECT_EQ(again, values);
  }
}

}  // namespace limbo::ps
