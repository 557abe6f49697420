// Heartbeats off the store (elastic/beats.h): the host's table, its relay to
// the coordinator's listener, and a member's view of them.
#include <gtest/gtest.h>
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <numeric>
#include <chrono>
#include <condition_variable>
#include <mutex>
#include <filesystem>
#include <sstream>
#include <thread>

#include "comm/auth.h"
#include "common/error.h"
#include "comm/kv_store.h"
#include "comm/store.h"
#include "elastic/beats.h"
#include "elastic/event_relay.h"
#include "elastic/coordinator.h"
#include "elastic/member.h"

using namespace limbo;
using namespace limbo::elastic;
using Clock = std::chrono::steady_clock;
using namespace std::chrono_literals;

namespace {

const std::string kSecret = "a job secret of thirty-two bytes!";

BeatSenderOptions sender_options(std::shared_ptr<comm::KvStore> store, std::string token = "") {
  BeatSenderOptions o;
  o.interval = 20ms;
  o.token = std::move(token);
  o.connect = [store] { return store; };
  return o;
}

// Waits up to `limit` for `ok`.
template <class F>
bool eventually(F ok, std::chrono::milliseconds limit = 3000ms) {
  const auto until = Clock::now() + limit;
  while (Clock::now() < until) {
    if (ok()) return true;
    std::this_thread::sleep_for(5ms);
  }
  return ok();
}

TEST(Beats, TheRelayCarriesEveryWorkerOfTheTableAndIsAcknowledged) {
  auto store = std::make_shared<comm::MemoryKvStore>();
  BeatListener listener("127.0.0.1", "127.0.0.1", "");
  store->set("elastic/beat_addr", listener.address());
  auto table = LocalBeats::in_process();
  const int a = table->acquire(), b = table->acquire();
  table->beat(a, 7);
  table->beat(b, 9);
  BeatSender relay(table, sender_options(store));
  ASSERT_TRUE(eventually([&] { return listener.table()->read().size() == 2; }));
  ASSERT_TRUE(eventually([&] { return table->acked_ns() > 0 && relay.acked_ns() > 0; }));
  table->beat(a, 7);
  ASSERT_TRUE(eventually([&] { return listener.table()->read().at(7).counter == 2; }));
  EXPECT_EQ(listener.table()->read().at(9).counter, 1);
  // A released slot is no longer relayed (nor its worker's id).
  table->release(b);
  EXPECT_EQ(table->entries().size(), 1u);
  EXPECT_EQ(listener.refused(), 0);
}

// The relay sends every interval, but a worker that stopped beating is
// dated by its last beat, not by the datagram that carried it: otherwise a
// frozen worker would count as alive up to an interval longer.
TEST(Beats, ARelayedBeatIsDatedWhenItsWorkerMadeIt) {
  auto store = std::make_shared<comm::MemoryKvStore>();
  BeatListener listener("127.0.0.1", "127.0.0.1", "");
  store->set("elastic/beat_addr", listener.address());
  auto table = LocalBeats::in_process();
  const int s = table->acquire();
  table->beat(s, 3);
  const auto made = Clock::now();
  BeatSender relay(table, sender_options(store));
  std::this_thread::sleep_for(400ms);  // about 20 datagrams, all with the same beat
  ASSERT_EQ(listener.table()->read().count(3), 1u);
  const auto at = listener.table()->read().at(3).at;
  EXPECT_LT(std::chrono::abs(at - made), 60ms);
  EXPECT_GT(Clock::now() - listener.table()->last_arrival(), 300ms);  // no beat advanced since
}

// A datagram must carry the job secret's MAC, name this listener, and be
// newer than the sender's last one.
TEST(Beats, ForgedReplayedOrMisaddressedDatagramsAreRefused) {
  BeatListener listener("127.0.0.1", "127.0.0.1", kSecret);
  const std::string addr = listener.address();
  const std::string nonce = addr.substr(addr.find(' ') + 1);
  const int port = std::stoi(addr.substr(addr.find(':') + 1));
  sockaddr_in to{};
  to.sin_family = AF_INET;
  to.sin_port = htons(static_cast<uint16_t>(port));
  to.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  const int fd = ::socket(AF_INET, SOCK_DGRAM, 0);
  ASSERT_GE(fd, 0);
  auto send = [&](const std::string& body, const std::string& key) {
    std::string mac;
    for (unsigned char c : comm::hmac_sha256(key, body)) {
      char h[3];
      std::snprintf(h, sizeof h, "%02x", c);
      mac += h;
    }
    const std::string msg = body + "\nmac " + mac;
    ::sendto(fd, msg.data(), msg.size(), 0, reinterpret_cast<sockaddr*>(&to), sizeof to);
  };
  auto refused = [&](int64_t n) { return eventually([&] { return listener.refused() == n; }, 1000ms); };
  send("LB1 " + nonce + " s1 1\n11 5 0", "another secret of thirty-two byt");
  ASSERT_TRUE(refused(1));
  send("LB1 0000000000000000 s1 1\n11 5 0", kSecret);  // another coordinator's
  ASSERT_TRUE(refused(2));
  EXPECT_TRUE(listener.table()->read().empty());
  send("LB1 " + nonce + " s1 1\n11 5 0", kSecret);
  ASSERT_TRUE(eventually([&] { return listener.table()->read().count(11) == 1; }));
  send("LB1 " + nonce + " s1 1\n11 5 0", kSecret);  // byte for byte the same datagram, replayed
  ASSERT_TRUE(refused(3));
  send("LB1 " + nonce + " s1 1\n11 6 0", kSecret);  // the same number again
  ASSERT_TRUE(refused(4));
  EXPECT_EQ(listener.table()->read().at(11).counter, 5);
  // Longer than any real datagram (at most 200 beats): refused from a peek
  // at its length, before any MAC, even when sealed with the secret.
  std::string longer = "LB1 " + nonce + " s1 2";
  for (int i = 0; i < 300; ++i) longer += "\n" + std::to_string(1000 + i) + " 1 0" + std::string(40, ' ');
  send(longer, kSecret);
  ASSERT_TRUE(refused(5));
  EXPECT_EQ(listener.table()->read().count(1000), 0u);
  ::close(fd);
  // A sender with the secret gets through and is acknowledged; one without
  // it is refused and never acknowledged.
  auto store = std::make_shared<comm::MemoryKvStore>();
  store->set("elastic/beat_addr", addr);
  auto table = LocalBeats::in_process();
  table->beat(table->acquire(), 12);
  BeatSender wrong(table, sender_options(store, "not the secret, but as long as it"));
  ASSERT_TRUE(eventually([&] { return listener.refused() > 5; }));
  BeatSender right(table, sender_options(store, kSecret));
  ASSERT_TRUE(eventually([&] { return listener.table()->read().count(12) == 1 && right.acked_ns() > 0; }));
  EXPECT_EQ(wrong.acked_ns(), 0);
}

// A sealed message, as the job's members write them.
std::string sealed(const std::string& body, const std::string& key) {
  std::string mac;
  for (unsigned char c : comm::hmac_sha256(key, body)) {
    char h[3];
    std::snprintf(h, sizeof h, "%02x", c);
    mac += h;
  }
  return body + "\nmac " + mac;
}

// A poll reads what changed since the last one, not the whole table: each
// worker whose beat advanced once, with its latest beat; a beat that does
// not advance (a replayed, older counter) is no change.
TEST(Beats, APollTakesOnlyTheBeatsThatAdvancedSinceTheLast) {
  BeatTable t;
  const auto now = Clock::now();
  t.note(1, 1, now);
  t.note(2, 1, now);
  t.note(1, 2, now);
  auto c = t.take_changes();
  ASSERT_EQ(c.size(), 2u);
  std::map<int64_t, int64_t> got;
  for (auto& [id, s] : c) got[id] = s.counter;
  EXPECT_EQ(got, (std::map<int64_t, int64_t>{{1, 2}, {2, 1}}));
  EXPECT_TRUE(t.take_changes().empty());
  t.note(2, 1, now);  // not newer
  t.note(1, 1, now);  // older
  EXPECT_TRUE(t.take_changes().empty());
  t.note(2, 5, now);
  c = t.take_changes();
  ASSERT_EQ(c.size(), 1u);
  EXPECT_EQ(c[0].first, 2);
  EXPECT_EQ(c[0].second.counter, 5);
  EXPECT_EQ(t.size(), 2u);
}

// Workers not heard from for the table's forget time are dropped, the
// oldest first, as other beats arrive (the table does not grow with every
// worker a long job ever had); one still queued as a change is kept until
// it was taken.
TEST(Beats, TheTableForgetsWorkersSilentForItsForgetTime) {
  BeatTable t(100ms);
  const auto now = Clock::now();
  for (int id = 1; id <= 50; ++id) t.note(id, 1, now);
  t.take_changes();
  std::this_thread::sleep_for(150ms);
  t.note(100, 1, Clock::now());
  EXPECT_EQ(t.size(), 1u);
  EXPECT_EQ(t.read().count(100), 1u);
  // Heard again after it was forgotten: a change, from any counter.
  t.note(7, 1, Clock::now());
  auto c = t.take_changes();
  EXPECT_EQ(c.size(), 2u);
}

// Where a listener on 127.0.0.1 takes datagrams, and its nonce.
sockaddr_in loopback_address_of(const BeatListener& listener, std::string* nonce) {
  const std::string addr = listener.address();
  *nonce = addr.substr(addr.find(' ') + 1);
  sockaddr_in to{};
  to.sin_family = AF_INET;
  to.sin_port = htons(static_cast<uint16_t>(std::stoi(addr.substr(addr.find(':') + 1))));
  to.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  return to;
}

// Found in review: beyond 4,096 senders the listener rescanned all of them
// on every datagram (O(n) a datagram at 10,000 members). Senders gone for
// the forget time are now dropped the oldest first; the replay check holds
// for those kept.
TEST(Beats, TheListenerForgetsSilentSendersOldestFirstAndStillRefusesReplays) {
  BeatListener listener("127.0.0.1", "127.0.0.1", kSecret);
  listener.testing_forget_senders(200ms, 8);
  std::string nonce;
  sockaddr_in to = loopback_address_of(listener, &nonce);
  const int fd = ::socket(AF_INET, SOCK_DGRAM, 0);
  ASSERT_GE(fd, 0);
  auto send = [&](const std::string& sender, int64_t seq, int64_t id) {
    const std::string msg = sealed("LB1 " + nonce + " " + sender + " " + std::to_string(seq) + "\n" +
                                   std::to_string(id) + " " + std::to_string(seq) + " 0", kSecret);
    ::sendto(fd, msg.data(), msg.size(), 0, reinterpret_cast<sockaddr*>(&to), sizeof to);
  };
  for (int i = 0; i < 40; ++i) send("old" + std::to_string(i), 1, 100 + i);
  ASSERT_TRUE(eventually([&] { return listener.senders() == 40u; }));
  std::this_thread::sleep_for(300ms);
  // A live sender's datagrams drop the silent ones at the front of the
  // order until the cap (8) is reached.
  for (int k = 1; k <= 45; ++k) send("live", k, 1);
  ASSERT_TRUE(eventually([&] { return listener.table()->read().count(1) && listener.table()->read().at(1).counter == 45; }));
  EXPECT_EQ(listener.senders(), 8u);
  // The live sender's numbers are still held: a replay is refused.
  const int64_t refused = listener.refused();
  send("live", 45, 1);
  ASSERT_TRUE(eventually([&] { return listener.refused() == refused + 1; }, 1000ms));
  ::close(fd);
}

// Beyond some 30,000 members one thread could not take every host's
// datagram. The listener now reads one port through several sockets
// (SO_REUSEPORT), a thread each, with the senders spread over them by the
// kernel: every sender's beats arrive and are acknowledged, each lane
// refuses its senders' replays, and more than one lane takes senders.
TEST(Beats, ListenerLanesShareOnePortAndEachRefusesItsSendersReplays) {
  BeatListener listener("127.0.0.1", "127.0.0.1", kSecret, 4);
  ASSERT_EQ(listener.lanes(), 4);
  std::string nonce;
  sockaddr_in to = loopback_address_of(listener, &nonce);
  constexpr int kSenders = 64;
  std::vector<int> fds;
  auto send = [&](int s, int64_t seq) {
    const std::string msg = sealed("LB1 " + nonce + " s" + std::to_string(s) + " " + std::to_string(seq) + "\n" +
                                   std::to_string(1000 + s) + " " + std::to_string(seq) + " 0", kSecret);
    ::sendto(fds[s], msg.data(), msg.size(), 0, reinterpret_cast<sockaddr*>(&to), sizeof to);
  };
  for (int s = 0; s < kSenders; ++s) {
    fds.push_back(::socket(AF_INET, SOCK_DGRAM, 0));  // a port of its own: a host's relay
    ASSERT_GE(fds.back(), 0);
    const timeval tv{2, 0};
    ::setsockopt(fds.back(), SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  }
  for (int64_t seq = 1; seq <= 3; ++seq)
    for (int s = 0; s < kSenders; ++s) send(s, seq);
  ASSERT_TRUE(eventually([&] {
    const auto t = listener.table()->read();
    for (int s = 0; s < kSenders; ++s)
      if (!t.count(1000 + s) || t.at(1000 + s).counter != 3) return false;
    return true;
  }));
  // Each sender has its three acknowledgements, from the one port.
  for (int s = 0; s < kSenders; ++s)
    for (int k = 0; k < 3; ++k) {
      char buf[512];
      sockaddr_in from{};
      socklen_t flen = sizeof from;
      const ssize_t n = ::recvfrom(fds[s], buf, sizeof buf, 0, reinterpret_cast<sockaddr*>(&from), &flen);
      ASSERT_GT(n, 0) << "sender " << s << " acknowledgement " << k;
      EXPECT_EQ(from.sin_port, to.sin_port);
      EXPECT_EQ(std::string(buf, 4), "LA2 ");
    }
  const auto by_lane = listener.senders_by_lane();
  EXPECT_EQ(std::accumulate(by_lane.begin(), by_lane.end(), size_t{0}), size_t{kSenders});
  EXPECT_GE(std::count_if(by_lane.begin(), by_lane.end(), [](size_t n) { return n > 0; }), 2);
  // A replay from each sender's own port is refused by its lane.
  const int64_t refused = listener.refused();
  for (int s = 0; s < kSenders; ++s) send(s, 2);
  ASSERT_TRUE(eventually([&] { return listener.refused() == refused + kSenders; }, 2000ms));
  EXPECT_EQ(listener.table()->read().at(1000).counter, 3);
  for (int fd : fds) ::close(fd);
}

// Found: an acknowledgement counted whenever its number was not above the
// sender's current one and it named the sender, not the listener: one
// recorded acknowledgement, replayed, kept a relay "acknowledged" for ever
// (no cut-off, no search for a new coordinator). Now an acknowledgement
// names the listener and each number counts once: a replayed one, an old
// coordinator's, and one for a datagram never sent count not at all.
TEST(Beats, AReplayedOrMisaddressedAcknowledgementCountsNever) {
  const int fd = ::socket(AF_INET, SOCK_DGRAM, 0);
  ASSERT_GE(fd, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ASSERT_EQ(::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a), 0);
  socklen_t alen = sizeof a;
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &alen);
  const std::string nonce = "00112233aabbccdd";
  auto store = std::make_shared<comm::MemoryKvStore>();
  store->set("elastic/beat_addr", "127.0.0.1:" + std::to_string(ntohs(a.sin_port)) + " " + nonce);
  auto table = LocalBeats::in_process();
  table->beat(table->acquire(), 4);
  BeatSender relay(table, sender_options(store, kSecret));
  // The first datagram: its sender's nonce and number.
  char buf[2048];
  sockaddr_in from{};
  socklen_t flen = sizeof from;
  timeval tv{5, 0};
  ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  const ssize_t n = ::recvfrom(fd, buf, sizeof buf, 0, reinterpret_cast<sockaddr*>(&from), &flen);
  ASSERT_GT(n, 0);
  std::istringstream in(std::string(buf, static_cast<size_t>(n)));
  std::string magic, coord, sender;
  int64_t seq = 0;
  ASSERT_TRUE(in >> magic >> coord >> sender >> seq);
  ASSERT_EQ(coord, nonce);
  auto answer = [&](const std::string& msg) {
    ::sendto(fd, msg.data(), msg.size(), 0, reinterpret_cast<sockaddr*>(&from), flen);
  };
  const std::string ack = sealed("LA2 " + nonce + " " + sender + " " + std::to_string(seq), kSecret);
  answer(ack);
  ASSERT_TRUE(eventually([&] { return relay.acked_ns() > 0; }));
  const int64_t first = relay.acked_ns();
  for (int k = 0; k < 15; ++k) {
    answer(ack);  // the same bytes again
    answer(sealed("LA2 ffffffffffffffff " + sender + " " + std::to_string(seq + 1), kSecret));  // another listener
    answer(sealed("LA1 " + sender + " " + std::to_string(seq + 1), kSecret));  // no listener named
    answer(sealed("LA2 " + nonce + " " + sender + " 999999999", kSecret));      // never sent
    std::this_thread::sleep_for(20ms);
  }
  EXPECT_EQ(relay.acked_ns(), first);
  // A fresh acknowledgement of a datagram it sent still counts.
  answer(sealed("LA2 " + nonce + " " + sender + " " + std::to_string(seq + 1), kSecret));
  EXPECT_TRUE(eventually([&] { return relay.acked_ns() > first; }));
  ::close(fd);
}

// Found: the listener computed the MAC over each datagram (up to 64 KiB)
// before its cheap checks, and its drain loop never looked at its stop
// flag: a flood at line rate crowded out the real beats (false evictions)
// and held up the listener's stop for as long as it lasted. Now a flood
// of datagrams without the listener's nonce costs a peek each: a member
// beating every 20 ms is never heard from more than 0.4 s (the default
// heartbeat timeout) apart, and a flooded listener stops at once. A flood
// that carries the nonce (anyone who reads the store learns it) costs a
// MAC each, over at most what a full table's beats take: the same holds.
TEST(Beats, AFloodWithoutTheSecretCrowdsOutNoBeat) {
  for (const bool with_nonce : {false, true}) {
    SCOPED_TRACE(with_nonce ? "the flood carries the listener's nonce" : "a flood without the nonce");
    auto store = std::make_shared<comm::MemoryKvStore>();
    auto listener = std::make_unique<BeatListener>("127.0.0.1", "127.0.0.1", kSecret);
    store->set("elastic/beat_addr", listener->address());
    const std::string addr = listener->address();
    const int port = std::stoi(addr.substr(addr.find(':') + 1));
    const std::string nonce = addr.substr(addr.find(' ') + 1);
    auto table = LocalBeats::in_process();
    const int slot = table->acquire();
    std::atomic<bool> stop{false};
    std::thread worker([&] {
      while (!stop) {
        table->beat(slot, 21);
        std::this_thread::sleep_for(20ms);
      }
    });
    BeatSender relay(table, sender_options(store, kSecret));
    ASSERT_TRUE(eventually([&] { return listener->table()->read().count(21) == 1; }));
    std::atomic<int64_t> flooded{0};
    std::thread flood([&] {
      const int fd = ::socket(AF_INET, SOCK_DGRAM, 0);
      sockaddr_in to{};
      to.sin_family = AF_INET;
      to.sin_port = htons(static_cast<uint16_t>(port));
      to.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
      int64_t k = 0;
      while (!stop) {
        // A new sender and number each time, so that no cheap check
        // refuses it: only the MAC does.
        // With the nonce, as long as a real datagram may be (a MAC each);
        // without it, 60 KB (a peek each).
        const std::string junk = "LB1 " + (with_nonce ? nonce : std::string("0000000000000000")) + " f" +
                                 std::to_string(++k) + " 1\n" + std::string(with_nonce ? 12000 : 60000, '7');
        if (::sendto(fd, junk.data(), junk.size(), 0, reinterpret_cast<sockaddr*>(&to), sizeof to) > 0) ++flooded;
      }
      ::close(fd);
    });
    double worst = 0;
    const auto until = Clock::now() + 3s;
    while (Clock::now() < until) {
      const auto seen = listener->table()->read().at(21).at;
      worst = std::max(worst, std::chrono::duration<double>(Clock::now() - seen).count());
      std::this_thread::sleep_for(10ms);
    }
    // The listener stops while the flood goes on.
    const auto t0 = Clock::now();
    listener.reset();
    const double stop_seconds = std::chrono::duration<double>(Clock::now() - t0).count();
    stop = true;
    flood.join();
    worker.join();
    std::printf("flood%s: %lld datagrams of %s in 3 s; longest gap between beats heard %.3f s; stop %.3f s\n",
                with_nonce ? " with the nonce" : "", static_cast<long long>(flooded.load()),
                with_nonce ? "12 KB" : "60 KB", worst, stop_seconds);
    EXPECT_GT(flooded.load(), 1000);
    EXPECT_LT(worst, 0.4);
    EXPECT_LT(stop_seconds, 1.0);
  }
}

// A full table (every slot of a launcher's) travels in datagrams of at
// most 200 beats, each short enough for the listener's length bound:
// every worker is heard, and nothing is refused.
TEST(Beats, AFullTableIsRelayedWhole) {
  auto store = std::make_shared<comm::MemoryKvStore>();
  BeatListener listener("127.0.0.1", "127.0.0.1", kSecret);
  store->set("elastic/beat_addr", listener.address());
  auto table = LocalBeats::in_process();
  for (int i = 0; i < LocalBeats::kSlots; ++i) {
    const int s = table->acquire();
    ASSERT_GE(s, 0);
    table->beat(s, int64_t{1} << 40 | i);  // long ids: the longest lines
  }
  BeatSender relay(table, sender_options(store, kSecret));
  ASSERT_TRUE(eventually([&] { return listener.table()->read().size() == static_cast<size_t>(LocalBeats::kSlots); }))
      << listener.table()->read().size() << " of " << LocalBeats::kSlots << " heard";
  EXPECT_EQ(listener.refused(), 0);
}

// Found: entry() loaded a slot's counter, then its id, so a slot reused
// across a respawn could read as {the new worker's id, the old worker's
// counter}: the new worker's beats were then ignored until its counter
// passed the old one, and it was evicted. Under the sequence lock a reader
// sees one worker's id with that worker's counter only: here worker k
// beats 2000 - k times, so any mixed read shows a counter above its id's.
TEST(Beats, ASlotReusedAcrossARespawnIsNeverReadTorn) {
  auto table = LocalBeats::in_process();
  const int slot = table->acquire();
  std::atomic<bool> done{false};
  std::atomic<int64_t> reads{0};
  // The writer goes on respawning (workers 1 to 1499, again and again)
  // until the reader has read 20,000 times, at most 60 s: on a loaded
  // machine the reader may not run at all while a fixed number of respawns
  // lasts (found in CI: 1 read).
  std::thread writer([&] {
    const auto until = Clock::now() + 60s;
    for (int64_t n = 0; n < 1500 || (reads < 20000 && Clock::now() < until); ++n) {
      const int64_t k = 1 + n % 1499;
      table->release(slot);
      table->acquire();
      for (int64_t j = 0; j < 2000 - k; ++j) table->beat(slot, k);
    }
    done = true;
  });
  int64_t torn = 0;
  while (!done) {
    const auto e = table->entry(slot);
    ++reads;
    if (e.id > 0 && e.counter > 2000 - e.id) ++torn;
    if (e.id == 0 && e.counter > 0) ++torn;
  }
  writer.join();
  std::printf("%lld reads, %lld torn\n", static_cast<long long>(reads.load()), static_cast<long long>(torn));
  EXPECT_GE(reads.load(), 20000);
  EXPECT_EQ(torn, 0);
}

// The review: a worker killed in the middle of a beat leaves its slot's
// version odd; the release after it wrote two more numbers, so the parity
// stayed inverted and every later holder of that slot (the restarted
// worker, most likely: the lowest free slot is handed out) read as empty,
// was never relayed, and was evicted. The release now ends even.
TEST(Beats, ASlotReleasedAfterAWorkerKilledMidBeatIsReadAgain) {
  auto table = LocalBeats::in_process();
  const int slot = table->acquire();
  table->beat(slot, 5);
  table->testing_cut_beat(slot);  // killed in the middle of its next beat
  EXPECT_EQ(table->entry(slot).id, 0);  // (a slot mid-change reads as empty)
  table->release(slot);
  ASSERT_EQ(table->acquire(), slot);
  table->beat(slot, 6);
  EXPECT_EQ(table->entry(slot).id, 6);
  EXPECT_EQ(table->entry(slot).counter, 1);
  EXPECT_EQ(table->entries().size(), 1u);
}

// An etcd take-over: the new coordinator listens elsewhere and writes its
// address; senders that miss acknowledgements read it again.
TEST(Beats, ASenderFollowsTheCoordinatorToItsNewAddress) {
  auto store = std::make_shared<comm::MemoryKvStore>();
  auto table = LocalBeats::in_process();
  const int s = table->acquire();
  table->beat(s, 5);
  auto first = std::make_unique<BeatListener>("127.0.0.1", "127.0.0.1", "");
  store->set("elastic/beat_addr", first->address());
  // The launcher's interval: a member beats every heartbeat timeout / 4.
  auto o = sender_options(store);
  o.interval = 100ms;
  const auto heartbeat_timeout = 4 * o.interval;
  BeatSender relay(table, o);
  ASSERT_TRUE(eventually([&] { return first->table()->read().count(5) == 1; }));
  first.reset();
  std::this_thread::sleep_for(500ms);  // the relay has been asking for a while: the take-over is late
  BeatListener second("127.0.0.1", "127.0.0.1", "");
  const auto moved = Clock::now();
  store->set("elastic/beat_addr", second.address());
  ASSERT_TRUE(eventually([&] { return second.table()->read().count(5) == 1; }));
  // The relay asks again every interval while unanswered, so it finds the
  // new coordinator an interval or two after the address is written. The
  // bound is the grace a new coordinator gives a member it has not heard
  // from: a relay slower than that gets its live host evicted.
  const double found = std::chrono::duration<double>(Clock::now() - moved).count();
  const double grace = std::chrono::duration<double>(kTakeOverGraceTimeouts * heartbeat_timeout).count();
  std::printf("the relay found the new coordinator %.3f s after its address was written (grace %.1f s)\n", found,
              grace);
  EXPECT_LT(found, grace);
  const int64_t acked = relay.acked_ns();
  ASSERT_TRUE(eventually([&] { return relay.acked_ns() > acked; }));
}

// Members under an embedded store, with a coordinator and its listener.
struct Job {
  comm::StoreServer server{"127.0.0.1", 0};
  std::atomic<int64_t> writes{0};
  std::shared_ptr<comm::KvStore> connect() {
    return comm::connect_kv_store("127.0.0.1", server.port(), 2000ms);
  }
  std::unique_ptr<BeatListener> listener;
  std::unique_ptr<Coordinator> coord;
  void start_coordinator(int workers) {
    listener = std::make_unique<BeatListener>("127.0.0.1", "127.0.0.1", "");
    CoordinatorOptions co;
    co.initial_workers = workers;
    co.heartbeat_timeout = 400ms;
    co.beat_address = listener->address();
    coord = std::make_unique<Coordinator>(connect(), co, listener->table());
  }
  MemberOptions member_options() {
    MemberOptions mo;
    mo.group.store_host = "127.0.0.1";
    mo.group.store_port = server.port();
    return mo;
  }
};

// The heartbeats cost the store nothing: in a steady second of four
// members (each beating ten times), the store takes no write.
TEST(Beats, MembersBeatWithoutWritingToTheStore) {
  Job job;
  job.start_coordinator(4);
  std::vector<std::unique_ptr<Member>> members;
  for (int i = 0; i < 4; ++i) members.push_back(std::make_unique<Member>(job.connect(), job.member_options()));
  ASSERT_TRUE(eventually([&] { return job.coord->poll().round.members.size() == 4; }));
  const int64_t rev = job.connect()->changes_since({"elastic/"}, 0).revision;
  for (int i = 0; i < 20; ++i) {
    auto r = job.coord->poll();
    EXPECT_FALSE(r.new_round) << r.reason;
    EXPECT_EQ(r.alive, 4);
    std::this_thread::sleep_for(50ms);
  }
  const auto ch = job.connect()->changes_since({"elastic/"}, rev);
  EXPECT_TRUE(ch.written.empty()) << ch.written.size() << " keys written, the first " << ch.written[0].first;
  for (auto& m : members) EXPECT_FALSE(m->cut_off());
}

// A member's threads (training, publishing, watching, beating) share one
// connection to the embedded store: a member adds one connection, not three.
TEST(Beats, AMemberHoldsOneStoreConnectionForAllItsThreads) {
  Job job;
  job.start_coordinator(2);
  ASSERT_TRUE(eventually([&] { return job.server.connections() == 1; }));  // the coordinator's
  Member a(job.connect(), job.member_options());
  Member b(job.connect(), job.member_options());
  ASSERT_TRUE(eventually([&] { return job.coord->poll().round.members.size() == 2; }));
  std::this_thread::sleep_for(300ms);  // every thread of both has made its calls
  EXPECT_EQ(job.server.connections(), 3u);
  EXPECT_FALSE(a.cut_off());
  EXPECT_FALSE(b.cut_off());
}

// A member whose beats nobody acknowledges (no coordinator listens) is cut
// off after its cut-off time, and back once one does.
TEST(Beats, AMemberIsCutOffWhileNoBeatIsAcknowledged) {
  Job job;
  Member m(job.connect(), job.member_options());
  ASSERT_TRUE(eventually([&] { return m.cut_off(); }, 2000ms));
  job.start_coordinator(1);
  ASSERT_TRUE(eventually([&] { return !m.cut_off(); }, 3000ms));
  EXPECT_EQ(job.listener->table()->read().count(m.id()), 1u);
}

// A worker whose launcher stopped relaying its host's table (the launcher
// is gone: the worker is leaving) sends its own beats.
TEST(Beats, AMemberWhoseTableIsNotRelayedSendsItsOwnBeats) {
  Job job;
  job.start_coordinator(1);
  auto table = LocalBeats::in_process();  // nobody relays it
  MemberOptions mo = job.member_options();
  mo.beats = table;
  mo.beat_slot = table->acquire();
  Member m(job.connect(), mo);
  ASSERT_TRUE(eventually([&] { return job.listener->table()->read().count(m.id()) == 1; }));
  std::this_thread::sleep_for(600ms);
  EXPECT_FALSE(m.cut_off());
  const auto r = job.coord->poll();
  EXPECT_EQ(r.alive, 1);
}

// Counts the calls of its clients that wait in the store (a watch).
class CountingWaits : public comm::KvStore {
 public:
  CountingWaits(std::shared_ptr<comm::KvStore> inner, std::shared_ptr<std::atomic<int>> waits)
      : inner_(std::move(inner)), waits_(std::move(waits)) {}
  void set(const std::string& k, const std::string& v) override { inner_->set(k, v); }
  std::optional<std::string> try_get(const std::string& k) override { return inner_->try_get(k); }
  int64_t add(const std::string& k, int64_t d) override { return inner_->add(k, d); }
  bool wait_for(const std::string& k, std::chrono::milliseconds t) override {
    ++*waits_;
    return inner_->wait_for(k, t);
  }
  std::vector<std::pair<std::string, std::string>> list(const std::string& p) override { return inner_->list(p); }
  std::string compare_set(const std::string& k, const std::string& e, const std::string& v) override {
    return inner_->compare_set(k, e, v);
  }
  bool erase(const std::string& k) override { return inner_->erase(k); }

 private:
  std::shared_ptr<comm::KvStore> inner_;
  std::shared_ptr<std::atomic<int>> waits_;
};

// The launcher's one watch of the event log stands for its workers': the
// newest round and abort and `elastic/done` land in the host's table, and
// a worker waiting on it is woken when they do (long before its wait's
// timeout).
TEST(EventRelay, TheEventLogReachesTheHostsTableAndWakesItsWaiters) {
  Job job;
  job.start_coordinator(1);
  auto table = LocalBeats::create();
  EXPECT_FALSE(table->events_current(monotonic_ns()));  // no relay yet: workers watch the store
  EventRelay relay(table, [&] { return job.connect(); }, 200ms);
  ASSERT_TRUE(eventually([&] { return table->events_current(monotonic_ns()); }));
  // Another process's view of the same table (a worker's).
  auto worker_view = LocalBeats::open(table->name());
  const auto before = worker_view->events();
  std::atomic<bool> woken{false};
  std::thread waiter([&] {
    worker_view->wait_events(before.seq, 20000ms);
    woken = true;
  });
  std::this_thread::sleep_for(100ms);
  MemberOptions mo = job.member_options();
  Member m(job.connect(), mo);
  ASSERT_TRUE(eventually([&] { return job.coord->poll().round.members.size() == 1; }));
  ASSERT_TRUE(eventually([&] { return woken.load(); }, 5000ms));  // not the 20 s timeout
  waiter.join();
  EXPECT_EQ(worker_view->events().round, job.coord->current().number);
  EXPECT_EQ(worker_view->events().abort, 0);
  EXPECT_FALSE(worker_view->events().done);
  auto kv = job.connect();
  kv->set("elastic/done", "1");
  ASSERT_TRUE(eventually([&] { return worker_view->events().done; }));
  // A malformed event is skipped; the ones after it still arrive.
  kv->set("elastic/event/" + std::to_string(kv->add("elastic/events", 0) + 1), "garbage");
  kv->set("elastic/events", std::to_string(kv->add("elastic/events", 0) + 1));
  kv->set("elastic/event/" + std::to_string(kv->add("elastic/events", 0) + 1), "abort 9");
  ASSERT_TRUE(eventually([&] { return worker_view->events().abort == 9; }));
}

// A worker of a host whose launcher relays the events makes no watch of its
// own: it learns of rounds from the table. When the relay stops (the
// launcher gone) it watches the store itself and still learns of them.
TEST(EventRelay, AWorkerLearnsRoundsFromTheTableAndFromTheStoreWhenTheRelayStops) {
  Job job;
  job.start_coordinator(1);
  auto table = LocalBeats::create();
  BeatSenderOptions bo = sender_options(job.connect());
  bo.connect = [&] { return job.connect(); };
  BeatSender beats(table, bo);
  auto relay = std::make_unique<EventRelay>(table, [&] { return job.connect(); }, 200ms);
  ASSERT_TRUE(eventually([&] { return table->events_current(monotonic_ns()); }));
  auto waits = std::make_shared<std::atomic<int>>(0);
  MemberOptions mo = job.member_options();
  mo.beats = table;
  mo.beat_slot = table->acquire();
  mo.connect = [&]() -> std::shared_ptr<comm::KvStore> { return std::make_shared<CountingWaits>(job.connect(), waits); };
  Member m(mo.connect(), mo);
  ASSERT_TRUE(eventually([&] { return job.coord->poll().round.members.size() == 1; }));
  const int64_t first = job.coord->current().number;
  ASSERT_TRUE(eventually([&] { return m.newer_round(first - 1); }));
  job.connect()->set("elastic/want/" + std::to_string(first), std::to_string(m.id()));  // a new round, asked
  ASSERT_TRUE(eventually([&] { return job.coord->poll().round.number > first; }));
  const int64_t second = job.coord->current().number;
  ASSERT_TRUE(eventually([&] { return m.newer_round(second - 1); }));
  EXPECT_EQ(waits->load(), 0) << "the worker watched the store although its launcher relays the events";
  // The relay stops: within two of its waits (and half a second) the
  // worker watches the store, and learns of the next round there.
  relay.reset();
  std::this_thread::sleep_for(1200ms);
  job.connect()->set("elastic/want/" + std::to_string(second), std::to_string(m.id()));
  ASSERT_TRUE(eventually([&] { return job.coord->poll().round.number > second; }));
  const int64_t third = job.coord->current().number;
  ASSERT_TRUE(eventually([&] { return m.newer_round(third - 1); }));
  EXPECT_GT(waits->load(), 0);
}

// A store with streams whose stream delivers nothing while it looks open
// (an etcd member cut off from its cluster holds it, or a proxy buffers
// it); point reads answer. Each follow() counts, and ends on an interrupt.
class SilentStreamStore : public comm::KvStore {
 public:
  SilentStreamStore(std::shared_ptr<comm::KvStore> inner, std::shared_ptr<std::atomic<int>> follows)
      : inner_(std::move(inner)), follows_(std::move(follows)) {}
  void set(const std::string& k, const std::string& v) override { inner_->set(k, v); }
  std::optional<std::string> try_get(const std::string& k) override { return inner_->try_get(k); }
  int64_t add(const std::string& k, int64_t d) override { return inner_->add(k, d); }
  bool wait_for(const std::string& k, std::chrono::milliseconds t) override { return inner_->wait_for(k, t); }
  std::vector<std::pair<std::string, std::string>> list(const std::string& p) override { return inner_->list(p); }
  std::string compare_set(const std::string& k, const std::string& e, const std::string& v) override {
    return inner_->compare_set(k, e, v);
  }
  bool erase(const std::string& k) override { return inner_->erase(k); }
  bool follow(const std::string&, std::chrono::milliseconds idle, const std::function<bool()>& stop,
              const std::function<void(const std::string&, const std::string&)>&) override {
    ++*follows_;
    while (!stop()) {  // as a stream: stop() before it opens and after each idle period
      std::unique_lock<std::mutex> lock(mu_);
      if (cv_.wait_for(lock, idle, [&] { return interrupted_; })) {
        interrupted_ = false;
        return false;  // broken: the caller reads the state and follows anew
      }
    }
    return true;
  }
  void interrupt_follow() override {
    std::lock_guard<std::mutex> lock(mu_);
    interrupted_ = true;
    cv_.notify_all();
  }

 private:
  std::shared_ptr<comm::KvStore> inner_;
  std::shared_ptr<std::atomic<int>> follows_;
  std::mutex mu_;
  std::condition_variable cv_;
  bool interrupted_ = false;
};

// Found: the relay over a stream marked its table current from point reads
// of `elastic/done` alone, and read the round and abort every fifth idle
// period: a stream that delivered nothing left an abort 5-22 s late at the
// workers (the heartbeat timeout is 0.4 s). Current means true as of a
// read: an event the stream misses reaches the table within about a wait,
// and the stream is opened again.
TEST(EventRelay, AStreamThatDeliversNothingLosesNoEventAndIsOpenedAgain) {
  Job job;
  auto follows = std::make_shared<std::atomic<int>>(0);
  auto table = LocalBeats::create();
  EventRelay relay(table, [&] { return std::make_shared<SilentStreamStore>(job.connect(), follows); }, 200ms);
  ASSERT_TRUE(eventually([&] { return table->events_current(monotonic_ns()) && follows->load() == 1; }));
  auto kv = job.connect();
  kv->set("elastic/event/1", "abort 3");
  kv->set("elastic/abort", "3");
  kv->set("elastic/events", "1");
  // Within a few of the relay's waits (it was one in five idle periods of
  // five waits: 5 s here).
  ASSERT_TRUE(eventually([&] { return table->events().abort == 3; }, 2500ms)) << "the abort reached the table late";
  // Still behind at the next look: the stream is opened again.
  ASSERT_TRUE(eventually([&] { return follows->load() >= 2; }, 3000ms));
  kv->set("elastic/event/2", "round 4");
  kv->set("elastic/round", "4");
  kv->set("elastic/events", "2");
  ASSERT_TRUE(eventually([&] { return table->events().round == 4; }, 5000ms));
  EXPECT_TRUE(table->events_current(monotonic_ns()));
}

// A store that stops answering (an etcd member stopped: every call waits
// out its time, then fails) while `stalled` is set.
class StallingStore : public comm::KvStore {
 public:
  StallingStore(std::shared_ptr<comm::KvStore> inner, std::shared_ptr<std::atomic<bool>> stalled)
      : inner_(std::move(inner)), stalled_(std::move(stalled)) {}
  void set(const std::string& k, const std::string& v) override { stall(), inner_->set(k, v); }
  std::optional<std::string> try_get(const std::string& k) override { return stall(), inner_->try_get(k); }
  int64_t add(const std::string& k, int64_t d) override { return stall(), inner_->add(k, d); }
  bool wait_for(const std::string& k, std::chrono::milliseconds t) override { return stall(), inner_->wait_for(k, t); }
  std::vector<std::pair<std::string, std::string>> list(const std::string& p) override { return stall(), inner_->list(p); }
  std::string compare_set(const std::string& k, const std::string& e, const std::string& v) override {
    return stall(), inner_->compare_set(k, e, v);
  }
  bool erase(const std::string& k) override { return stall(), inner_->erase(k); }

 private:
  void stall() {
    if (!*stalled_) return;
    std::this_thread::sleep_for(1s);
    throw Error("the store did not answer in time");
  }
  std::shared_ptr<comm::KvStore> inner_;
  std::shared_ptr<std::atomic<bool>> stalled_;
};

// The longest gap between two changes of `read()` over `span`, sampled
// every 5 ms.
template <class F>
std::chrono::milliseconds longest_still(F read, std::chrono::milliseconds span) {
  auto last = read();
  auto changed = Clock::now(), until = changed + span;
  std::chrono::milliseconds longest{0};
  while (Clock::now() < until) {
    std::this_thread::sleep_for(5ms);
    const auto v = read();
    const auto now = Clock::now();
    if (v != last) last = v, changed = now;
    longest = std::max(longest, std::chrono::duration_cast<std::chrono::milliseconds>(now - changed));
  }
  return longest;
}

// A store that stops answering holds up no beat: the member's heartbeat
// thread makes no store call (its progress and records wait on another
// thread), so the coordinator keeps it alive and it is not cut off. (A
// second member beats all along: silence counts only while someone beats.)
TEST(Beats, AStoreThatStopsAnsweringHoldsUpNoBeat) {
  Job job;
  job.start_coordinator(2);
  auto stalled = std::make_shared<std::atomic<bool>>(false);
  auto table = LocalBeats::in_process();
  MemberOptions slow = job.member_options(), steady = job.member_options();
  slow.connect = [&job, stalled]() -> std::shared_ptr<comm::KvStore> {
    return std::make_shared<StallingStore>(job.connect(), stalled);
  };
  slow.beats = steady.beats = table;
  slow.beat_slot = table->acquire();
  steady.beat_slot = table->acquire();
  Member m(job.connect(), slow), other(job.connect(), steady);
  BeatSender relay(table, sender_options(job.connect()));
  ASSERT_TRUE(eventually([&] { return job.coord->poll().round.members.size() == 2; }));
  *stalled = true;
  const auto until = Clock::now() + 1500ms;
  for (int i = 0; Clock::now() < until; ++i) {
    m.publish_progress(0.01 * i);  // store work queued all along
    m.publish_record("{\"step\": " + std::to_string(i) + "}");
    const auto r = job.coord->poll();
    ASSERT_EQ(r.alive, 2) << "a member went silent while its store stalled";
    ASSERT_FALSE(r.new_round) << r.reason;
    std::this_thread::sleep_for(50ms);
  }
  EXPECT_FALSE(m.cut_off());
  *stalled = false;
}

// This process's threads.
int thread_count() {
  int n = 0;
  for ([[maybe_unused]] const auto& e : std::filesystem::directory_iterator("/proc/self/task")) ++n;
  return n;
}

// A member that registers with a store that does not answer in time (the
// etcd benchmark's "did not answer /v3/kv/put within 400 ms" under load)
// gets the store's error on the calling thread, a limbo::Error the caller
// can catch and retry on (bench/coordination.cc registers again), and
// leaves no thread behind; once the store answers, the same registration
// gets the member into a round.
TEST(Beats, AMemberRegisteringWithAStalledStoreGetsAnErrorAndLeavesNoThread) {
  Job job;
  job.start_coordinator(1);
  auto stalled = std::make_shared<std::atomic<bool>>(true);
  MemberOptions mo = job.member_options();
  mo.connect = [&job, stalled]() -> std::shared_ptr<comm::KvStore> {
    return std::make_shared<StallingStore>(job.connect(), stalled);
  };
  const int before = thread_count();
  EXPECT_THROW(Member(mo.connect(), mo), Error);
  EXPECT_EQ(thread_count(), before) << "a failed registration left a thread running";
  *stalled = false;
  Member m(mo.connect(), mo);
  ASSERT_TRUE(eventually([&] { return job.coord->poll().round.members.size() == 1; }));
  EXPECT_FALSE(m.cut_off());
}

// Nor does it hold up a relay that looks for a moved coordinator: the
// address is read on another thread, and the relay goes on sending.
TEST(Beats, ARelayLookingForTheCoordinatorInAStalledStoreKeepsSending) {
  auto store = std::make_shared<comm::MemoryKvStore>();
  auto stalled = std::make_shared<std::atomic<bool>>(false);
  auto listener = std::make_unique<BeatListener>("127.0.0.1", "127.0.0.1", "");
  store->set("elastic/beat_addr", listener->address());
  auto table = LocalBeats::in_process();
  table->beat(table->acquire(), 7);
  auto slow = std::make_shared<StallingStore>(store, stalled);
  BeatSender relay(table, sender_options(slow));
  ASSERT_TRUE(eventually([&] { return relay.acked_ns() > 0; }));
  *stalled = true;
  listener.reset();  // no answer: after three intervals the relay asks the store again
  const auto gap = longest_still([&] { return table->sent_ns(); }, 1500ms);
  EXPECT_LT(gap.count(), 200) << "the relay stood still while the store stalled";
  *stalled = false;
}

}  // namespace
