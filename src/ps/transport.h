// ZeroMQ transport for the parameter server. This header and transport.cc
// are the only places in Limbo that use ZeroMQ.
//
// Shards bind a ROUTER socket; learners connect one DEALER socket per shard.
// A message is [identity (ROUTER side only)] + header + meta + payload frames
// (see protocol.h). Payloads are sent without copying: the sender passes an
// owner (`keep`) that holds the bytes until ZeroMQ has sent them; received
// frames are handed out as views of the ZeroMQ message buffers.
//
// CURVE: with keys, the shard is a CURVE server and only peers that hold the
// job's key pair are admitted (a ZAP handler checks the client's public key
// against the job's); peers without keys fail the handshake and never
// reach the application.
#pragma once

#include <atomic>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "ps/protocol.h"

namespace limbo::ps {

// A CURVE key pair in Z85 text (40 characters each); empty = no encryption.
struct CurveKeys {
  std::string public_key, secret_key;
  std::string server_key;  // the shard's public key; empty = public_key (one pair per job)
  bool enabled() const { return !public_key.empty(); }
};
bool curve_available();
CurveKeys generate_curve_keys();  // throws Error when libzmq lacks CURVE
// Key file: two lines "public <z85>" and "secret <z85>". Throws InvalidInput.
CurveKeys load_curve_keys(const std::string& path);
void save_curve_keys(const std::string& path, const CurveKeys& k);  // mode 0600

class Transport {
 public:
  explicit Transport(const CurveKeys& keys = {});
  ~Transport();
  Transport(const Transport&) = delete;
  Transport& operator=(const Transport&) = delete;
  void* context() const { return ctx_; }
  const CurveKeys& keys() const { return keys_; }
  // ZAP decisions so far (CURVE only).
  int64_t zap_accepted() const { return zap_accepted_; }
  int64_t zap_refused() const { return zap_refused_; }

 private:
  void zap_loop();
  void* ctx_ = nullptr;
  void* zap_socket_ = nullptr;
  CurveKeys keys_;
  std::thread zap_;
  std::atomic<bool> stop_{false};
  std::atomic<int64_t> zap_accepted_{0}, zap_refused_{0};
};

class Socket {
 public:
  enum class Kind { Router, Dealer };
  // max_message_bytes: larger incoming messages drop the connection (0 = none).
  Socket(Transport& t, Kind kind, uint64_t max_message_bytes = 0);
  ~Socket();
  Socket(const Socket&) = delete;
  Socket& operator=(const Socket&) = delete;

  // Binds (ROUTER, as CURVE server when the transport has keys); returns the
  // bound endpoint (a "*" port is resolved). Throws InvalidInput on failure.
  std::string bind(const std::string& endpoint);
  // Connects (DEALER, as CURVE client when the transport has keys).
  void connect(const std::string& endpoint);

  // Sends one message. `identity` addresses a ROUTER peer (null for DEALER).
  // The payload is not copied when `keep` owns it; otherwise it is copied.
  // Returns false when a DEALER has no connected peer to queue it for (within
  // 200 ms): the caller treats the request as lost. `buffers` (the header
  // flagged kBuffers) goes as a fourth frame, not copied when its keep owns it.
  bool send(const std::string* identity, const Header& h, const std::string& meta,
            const void* payload, size_t bytes, std::shared_ptr<void> keep = nullptr,
            const Frame* buffers = nullptr);
  // Sends raw frames as they are (benchmarks, tests of malformed input).
  void send_raw(const std::vector<std::string>& frames);

  // Receives one multipart message within timeout_ms (-1 = forever); false
  // on timeout. For ROUTER, the first frame goes to *identity.
  bool recv(std::vector<Frame>& frames, std::string* identity, int timeout_ms);
  // Waits until any of the sockets is readable; returns its index or -1.
  static int poll(const std::vector<Socket*>& sockets, int timeout_ms);

 private:
  void* sock_ = nullptr;
  Kind kind_;
  Transport& transport_;
};

}  // namespace limbo::ps
