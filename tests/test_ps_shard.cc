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
#include <zmq.h>

#include "common/files.h"
#include "common/half.h"
#include "ps/aggregator.h"
#include "ps/protocol.h"
#include "optim/flat_params.h"
#include "ps/buffer_mean.h"
#include "ps/model_layout.h"
#include "ps/server.h"
#include "ps/shard_links.h"
#include "ps/transport.h"
#include "ps_local_shard.h"
#include "test_util.h"

namespace limbo::ps {
namespace {

using namespace shardtest;

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

// comm.compression and ps.pull_compression: pushes of 16-bit values are
// widened and applied like float32 ones; a pull flagged for 16 bits gets the
// float32 weights rounded; malformed 16-bit payloads are refused.
TEST(Shard, SixteenBitPushesAreWidenedAndPullsRounded) {
  auto o = softsync(1);
  o.alpha0 = 0.5;
  LocalShard shard(o);
  Client c(shard.endpoint);
  ASSERT_EQ(c.hello(1, shard.fp).header.type, MsgType::Welcome);
  auto w0 = c.call(pull_header(1, 1), "");
  ASSERT_EQ(w0.header.type, MsgType::Weights);
  std::vector<float> g(kTotal);
  for (int64_t i = 0; i < kTotal; ++i) g[i] = 0.1f + 1e-3f * static_cast<float>(i);
  std::vector<uint16_t> wire(kTotal);
  floats_to_halves(HalfKind::Bf16, g.data(), wire.data(), wire.size());
  // In two parts, as a learner sends them.
  Header h = push_header(1, 2);
  const size_t half = kTotal / 2;
  h.flags = kMoreParts | kBf16Values;
  c.s.send(nullptr, h, "", wire.data(), half * 2);
  h.flags = kBf16Values;
  h.offset = half;
  c.s.send(nullptr, h, "", wire.data() + half, (kTotal - half) * 2);
  auto ack = c.reply();
  ASSERT_EQ(ack.header.type, MsgType::PushAck) << ack.meta;
  EXPECT_EQ(json::parse(ack.meta)["status"], "accepted");
  uint64_t clock = 0;
  auto w = c.pull_parts(1, 3, &clock);
  ASSERT_EQ(w.size(), static_cast<size_t>(kTotal));
  int64_t rounded = 0;
  for (int64_t i = 0; i < kTotal; ++i) {
    const float sent = bf16_to_float(wire[i]);
    ASSERT_FLOAT_EQ(w[i], 1.f - 0.5f * sent) << i;
    rounded += std::fabs(w[i] - (1.f - 0.5f * g[i])) > 1e-5f;
  }
  EXPECT_GT(rounded, kTotal / 2) << "the shard applied float32 values, not the bf16 ones sent";
  // Pulls in 16 bits: the same weights, rounded, in half the bytes.
  for (uint8_t enc : {kBf16Values, kFp16Values}) {
    Header p = pull_header(1, enc == kBf16Values ? 4 : 5);
    p.flags = enc;
    auto r = c.call(p, "");
    ASSERT_EQ(r.header.type, MsgType::Weights);
    EXPECT_EQ(r.header.flags & kValueEncoding, enc);
    ASSERT_EQ(r.payload.size, static_cast<size_t>(kTotal) * 2);
    ASSERT_EQ(r.floats(), static_cast<size_t>(kTotal));
    std::vector<uint16_t> got(kTotal), want(kTotal);
    std::memcpy(got.data(), r.payload.data, r.payload.size);
    floats_to_halves(enc == kBf16Values ? HalfKind::Bf16 : HalfKind::Fp16, w.data(), want.data(), want.size());
    EXPECT_EQ(got, want);
  }
  // Malformed: both encodings, an odd byte count, the wrong number of values.
  Header bad = push_header(1, 6);
  bad.flags = kBf16Values | kFp16Values;
  c.s.send(nullptr, bad, "", wire.data(), kTotal * 2);
  EXPECT_EQ(json::parse(c.reply().meta)["code"], "payload_size");
  bad.flags = kFp16Values;
  bad.seq = 7;
  c.s.send(nullptr, bad, "", wire.data(), kTotal * 2 - 1);
  EXPECT_EQ(json::parse(c.reply().meta)["code"], "payload_size");
  bad.seq = 8;
  c.s.send(nullptr, bad, "", wire.data(), (kTotal - 1) * 2);
  EXPECT_EQ(json::parse(c.reply().meta)["code"], "shape");
  auto s = shard.finish();
  EXPECT_EQ(s["updates"], 1);
}

// A learner restarted with the same --learner-id is a new process whose
// sequence numbers start again: its pushes must not be taken for duplicates of
// its earlier process's. The same process registering again keeps its
// numbers, so a re-sent push is still recognised.
TEST(Shard, ALearnerRestartedWithItsOldIdStartsAfresh) {
  LocalShard shard(softsync(1));
  Client old_process(shard.endpoint);
  ASSERT_EQ(old_process.hello(3, shard.fp, kTotal, 5000, "aaaa").header.type, MsgType::Welcome);
  std::vector<float> g(kTotal, 0.01f);
  EXPECT_EQ(json::parse(old_process.call(push_header(3, 40), "", g).meta)["status"], "accepted");
  // The same process again (e.g. after a shard restart it still knows): dedup holds.
  ASSERT_EQ(old_process.hello(3, shard.fp, kTotal, 5000, "aaaa").header.type, MsgType::Welcome);
  EXPECT_EQ(json::parse(old_process.call(push_header(3, 40), "", g).meta)["status"], "duplicate");
  // The old process is gone (SIGKILL); a new one starts with the same id.
  Client new_process(shard.endpoint);
  ASSERT_EQ(new_process.hello(3, shard.fp, kTotal, 5000, "bbbb").header.type, MsgType::Welcome);
  EXPECT_EQ(json::parse(new_process.call(push_header(3, 2), "", g).meta)["status"], "accepted");
  EXPECT_EQ(json::parse(new_process.call(push_header(3, 3), "", g).meta)["status"], "accepted");
  auto s = shard.finish();
  EXPECT_EQ(s["updates"], 3);
}

// Under hardsync a learner that pushed waits for the round: its pulls are
// held. A peer that keeps pulling holds one pull, not one per message; a
// peer that never registered cannot read the weights, not even as an
// observer (which only the finisher, registered before, may be).
TEST(Shard, HeldPullsAreBoundedAndUnregisteredPeersCannotPull) {
  AggregatorOptions o;
  o.protocol = Protocol::Hardsync;
  o.alpha0 = 0.1;
  LocalShard shard(o);
  Client a(shard.endpoint), b(shard.endpoint), stranger(shard.endpoint);
  ASSERT_EQ(a.hello(1, shard.fp).header.type, MsgType::Welcome);
  ASSERT_EQ(b.hello(2, shard.fp).header.type, MsgType::Welcome);
  std::vector<float> g(kTotal, 0.01f);
  EXPECT_EQ(json::parse(a.call(push_header(1, 1), "", g).meta)["status"], "accepted");
  for (uint64_t seq = 2; seq < 52; ++seq) a.s.send(nullptr, pull_header(1, seq), "", nullptr, 0);
  // A heartbeat on the same connection is answered after every pull before it
  // was handled (one connection is read in order): all 50 have arrived.
  Header beat;
  beat.type = MsgType::Heartbeat;
  beat.sender = 1;
  beat.seq = 60;
  ASSERT_EQ(a.call(beat, "").header.type, MsgType::Heartbeat);
  Header obs = pull_header(9, 1);
  obs.flags = kObserver;
  auto refused = stranger.call(obs, "");
  ASSERT_EQ(refused.header.type, MsgType::Error);
  EXPECT_EQ(json::parse(refused.meta)["code"], "unknown_learner");
  EXPECT_EQ(json::parse(b.call(push_header(2, 1), "", g).meta)["status"], "accepted");
  // The round is complete: the one held pull (the newest) is answered.
  auto w = a.reply();
  EXPECT_EQ(w.header.type, MsgType::Weights);
  EXPECT_EQ(w.header.seq, 51u);
  auto s = shard.finish();
  EXPECT_LE(s["held_pulls_peak"].get<int64_t>(), 1);
}

// A partial ZAP request is answered (400) and leaves the handler working:
// the next, complete request from another client is answered too.
TEST(Shard, APartialZapRequestLeavesTheCurveHandlerWorking) {
  if (!curve_available()) GTEST_SKIP() << "libzmq without CURVE";
  CurveKeys keys = generate_curve_keys();
  Transport t(keys);
  auto ask = [&](const std::vector<std::string>& frames) {
    void* req = zmq_socket(t.context(), ZMQ_REQ);
    int linger = 0, timeout = 2000;
    zmq_setsockopt(req, ZMQ_LINGER, &linger, sizeof linger);
    zmq_setsockopt(req, ZMQ_RCVTIMEO, &timeout, sizeof timeout);
    EXPECT_EQ(zmq_connect(req, "inproc://zeromq.zap.01"), 0);
    for (size_t i = 0; i < frames.size(); ++i)
      zmq_send(req, frames[i].data(), frames[i].size(), i + 1 < frames.size() ? ZMQ_SNDMORE : 0);
    std::vector<std::string> reply;
    for (int more = 1; more;) {
      char buf[256];
      int n = zmq_recv(req, buf, sizeof buf, 0);
      if (n < 0) break;  // timed out: no answer
      reply.emplace_back(buf, static_cast<size_t>(std::min(n, 256)));
      int m = 0;
      size_t len = sizeof m;
      zmq_getsockopt(req, ZMQ_RCVMORE, &m, &len);
      more = m;
    }
    zmq_close(req);
    return reply;
  };
  auto partial = ask({"1.0", "7", "limbo"});
  ASSERT_GE(partial.size(), 3u) << "a partial request got no answer";
  EXPECT_EQ(partial[2], "400");
  uint8_t key[32];
  zmq_z85_decode(key, keys.public_key.c_str());
  auto full = ask({"1.0", "8", "limbo", "127.0.0.1", "", "CURVE", std::string(reinterpret_cast<char*>(key), 32)});
  ASSERT_GE(full.size(), 3u) << "the handler stopped answering after a partial request";
  EXPECT_EQ(full[1], "8");
  EXPECT_EQ(full[2], "200");
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

// A model's buffers (batch-norm statistics) travel with the push to shard 0
// and back with its weights, as float32 in a frame of their own: a ResNet-50
// has about 53,000 floats of them (in base64 inside the JSON meta, as they
// used to travel, every such push was refused for a meta over 64 KiB).
// Through a learner's own links: the gradient is accepted, and the buffers
// come back as the mean of the update's pushes.
TEST(Shard, TheBuffersOfALargeModelTravelWithPushesAndWeights) {
  LocalShard shard(softsync(1));
  WorkerOptions o;
  o.servers = {shard.endpoint};
  o.learner_id = 1;
  o.request_timeout = std::chrono::milliseconds(10000);
  o.part_floats = 300;  // the buffers go with the first of 4 parts
  ShardLinks links(o, {}, shard.fp, kTotal);
  ShardLink& l = *links.all()[0];
  std::vector<float> weights(kTotal), g(kTotal, 1.f);
  Message w0 = links.receive_weights(l, weights.data(), links.send_pull(l, 0), [&] { return links.send_pull(l, 0); });
  EXPECT_EQ(w0.buffers.size, 0u);  // none yet
  const size_t numel = 60000;
  for (int step = 0; step < 2; ++step) {
    auto buffers = std::make_shared<std::vector<float>>(numel);
    for (size_t i = 0; i < numel; ++i) (*buffers)[i] = 0.25f * static_cast<float>(i % 13) + static_cast<float>(step);
    Frame f = float_frame(buffers);
    const uint64_t push = links.send_push(l, g.data(), -1, json{{"averaged", numel - 1}}.dump(),
                                          [] { return std::shared_ptr<void>(); }, &f);
    uint64_t pull = links.send_pull(l, 0);
    auto ack = json::parse(links.await(l, push, MsgType::PushAck, [&] { return pull = links.send_pull(l, 0); }).meta);
    ASSERT_EQ(ack.value("status", std::string()), "accepted") << ack.dump();
    Message w = links.receive_weights(l, weights.data(), pull, [&] { return pull = links.send_pull(l, 0); });
    ASSERT_EQ(w.buffer_floats(), numel) << step;
    EXPECT_EQ(json::parse(w.meta).value("averaged", 0), static_cast<int>(numel - 1));
    EXPECT_EQ(std::memcmp(w.buffers.data, buffers->data(), numel * 4), 0) << step;
  }
  EXPECT_EQ(shard.finish()["updates"], 2);
  // The most a model may have passes; one more is refused up front, by name.
  EXPECT_NO_THROW(check_buffers_fit(static_cast<int64_t>(kMaxBufferFloats)));
  try {
    check_buffers_fit(static_cast<int64_t>(kMaxBufferFloats) + 1);
    ADD_FAILURE() << "no error for too many floats of buffers";
  } catch (const InvalidInput& e) {
    EXPECT_NE(std::string(e.what()).find(std::to_string(kMaxBufferFloats + 1) + " floats of buffers"), std::string::npos)
        << e.what();
  }
}

// Found: a learner checked its gradient for NaN and Inf before the 16-bit
// encoding, so an fp16 push whose value (plus its residual) passed 65504
// became infinite on one shard only: that shard refused it while the other
// applied its part. Now such a gradient goes out as NaN to every shard and
// both refuse it, as does one whose residual carries it over the range;
// the weights of both stay as they were.
TEST(Shard, AnFp16PushThatOverflowsOnOneShardIsRefusedByEvery) {
  LocalShard a(softsync(1), {}, -1, kTotal, 0, 2), b(softsync(1), {}, -1, kTotal, 1, 2);
  WorkerOptions o;
  o.servers = {a.endpoint, b.endpoint};
  o.learner_id = 1;
  o.request_timeout = std::chrono::milliseconds(10000);
  o.push_encoding = kFp16Values;
  ShardLinks links(o, {}, a.fp, kTotal);
  ASSERT_EQ(links.all().size(), 2u);
  std::vector<float> weights(kTotal);
  auto push_both = [&](std::vector<float>& g) {
    std::vector<std::string> status;
    for (auto& l : links.all()) {
      links.receive_weights(*l, weights.data(), links.send_pull(*l, 0), [&] { return links.send_pull(*l, 0); });
      const uint64_t push = links.send_push(*l, g.data(), -1, "", [] { return std::shared_ptr<void>(); });
      uint64_t pull = links.send_pull(*l, 0);
      auto ack = json::parse(links.await(*l, push, MsgType::PushAck, [&] { return pull = links.send_pull(*l, 0); }).meta);
      links.receive_weights(*l, weights.data(), pull, [&] { return pull = links.send_pull(*l, 0); });
      status.push_back(ack.value("status", std::string()) + ":" + ack.value("code", std::string()));
      if (ack.value("status", std::string()) == "accepted") links.accepted(*l);
    }
    return status;
  };
  // A plain step: both accept (the residual of 65510 -> 65504 is 6).
  std::vector<float> g(kTotal, 0.f);
  g[kTotal - 1] = 65510.f;  // shard 1's slice
  ASSERT_TRUE(links.prepare_push(g.data(), true));
  auto st = push_both(g);
  EXPECT_EQ(st[0], "accepted:");
  EXPECT_EQ(st[1], "accepted:");
  const std::vector<float> after_one = weights;
  // 70000 in shard 1's slice only: infinite in fp16.
  std::vector<float> big(kTotal, 0.001f);
  big[kTotal - 1] = 70000.f;
  EXPECT_FALSE(links.prepare_push(big.data(), true));
  st = push_both(big);
  EXPECT_EQ(st[0], "rejected:non_finite");
  EXPECT_EQ(st[1], "rejected:non_finite");
  EXPECT_EQ(weights, after_one);  // neither shard applied its part
  // 65515 alone fits, but 65515 + the residual 6 rounds to infinity.
  std::vector<float> near(kTotal, 0.001f);
  near[kTotal - 1] = 65515.f;
  EXPECT_FALSE(links.pushable(near.data()));
  // A loss that is not finite spoils a finite gradient too.
  std::vector<float> fine(kTotal, 0.001f);
  EXPECT_FALSE(links.prepare_push(fine.data(), false));
  EXPECT_TRUE(std::isnan(fine[0]));
  EXPECT_EQ(a.finish()["updates"], 1);
  EXPECT_EQ(b.finish()["updates"], 1);
}

// The hello names the learner's model (every parameter's name and shape) so
// that a refusal can name both models. A model of thousands of parameter
// tensors made a hello over the meta limit: refused as `meta_size` instead of
// registered, or refused by name. The description is now cut short, the
// fingerprint still covers every parameter.
TEST(Shard, AModelOfThousandsOfTensorsRegistersAndIsRefusedByName) {
  torch::nn::Module big, other;
  for (int i = 0; i < 3000; ++i) {
    big.register_parameter("transformer_h_" + std::to_string(i) + "_mlp_c_proj_weight", torch::zeros({2}));
    other.register_parameter("transformer_h_" + std::to_string(i) + "_mlp_c_proj_weight", torch::zeros({2}));
  }
  other.register_parameter("extra", torch::zeros({1}));
  optim::FlatParams fb(big), fo(other);
  const ModelFingerprint fp = model_fingerprint("big", fb), fp_other = model_fingerprint("big", fo);
  EXPECT_NE(fp.hash, fp_other.hash);  // the one parameter past the cut still counts
  EXPECT_LT(fp.description.size(), 4096u);
  EXPECT_NE(fp.description.find("transformer_h_0_mlp_c_proj_weight[2]"), std::string::npos) << fp.description;
  EXPECT_NE(fp.description.find("more"), std::string::npos) << fp.description;

  auto o = softsync(1);
  testing::TempDir dir;
  ServerOptions so;
  so.dir = dir.path() + "/shard";
  so.agg = o;
  std::vector<float> init(6000, 0.f);
  Server server(so, fp, init.data(), 6000, {});
  std::atomic<bool> stop{false};
  std::thread t([&] { server.run(stop); });
  Client c(server.endpoint());
  const Message refused = c.hello(1, fp_other, 6001);
  const Message welcome = c.hello(2, fp, 6000);
  stop = true;
  t.join();
  ASSERT_EQ(refused.header.type, MsgType::Refuse) << refused.meta;
  EXPECT_NE(json::parse(refused.meta)["reason"].get<std::string>().find("model mismatch"), std::string::npos);
  EXPECT_EQ(welcome.header.type, MsgType::Welcome) << welcome.meta;
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
