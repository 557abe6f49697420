#include "ps/transport.h"

#include <sys/stat.h>
#include <zmq.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <sstream>

#include "common/error.h"
#include "common/files.h"
#include "common/log.h"

namespace limbo::ps {
namespace {

std::string zerr(const std::string& what) { return what + ": " + zmq_strerror(zmq_errno()); }

void setopt_int(void* s, int opt, int v) { zmq_setsockopt(s, opt, &v, sizeof v); }

std::shared_ptr<zmq_msg_t> new_msg() {
  auto* m = new zmq_msg_t;
  zmq_msg_init(m);
  return std::shared_ptr<zmq_msg_t>(m, [](zmq_msg_t* p) {
    zmq_msg_close(p);
    delete p;
  });
}

void send_frame(void* sock, const void* data, size_t n, bool more) {
  if (zmq_send(sock, data, n, more ? ZMQ_SNDMORE : 0) < 0) throw PeerFailure(zerr("zmq send"));
}

void release_keep(void*, void* hint) { delete static_cast<std::shared_ptr<void>*>(hint); }

std::string frame_text(zmq_msg_t& m) {
  return std::string(static_cast<const char*>(zmq_msg_data(&m)), zmq_msg_size(&m));
}

}  // namespace

bool curve_available() { return zmq_has("curve") != 0; }

CurveKeys generate_curve_keys() {
  if (!curve_available()) throw Error("this libzmq was built without CURVE support");
  char pub[41], sec[41];
  if (zmq_curve_keypair(pub, sec) != 0) throw Error(zerr("zmq_curve_keypair"));
  return {pub, sec, ""};
}

CurveKeys load_curve_keys(const std::string& path) {
  std::istringstream in(read_file(path));
  CurveKeys k;
  std::string word, value;
  while (in >> word >> value) {
    if (word == "public") k.public_key = value;
    else if (word == "secret") k.secret_key = value;
  }
  if (k.public_key.size() != 40 || k.secret_key.size() != 40)
    throw InvalidInput("key file '" + path + "' must have lines 'public <40 Z85 chars>' and 'secret <40 Z85 chars>' "
                       "(make one with `limbo keygen`)");
  uint8_t buf[32];
  if (!zmq_z85_decode(buf, k.public_key.c_str()) || !zmq_z85_decode(buf, k.secret_key.c_str()))
    throw InvalidInput("key file '" + path + "' holds keys that are not valid Z85");
  return k;
}

void save_curve_keys(const std::string& path, const CurveKeys& k) {
  write_file_atomic(path, "public " + k.public_key + "\nsecret " + k.secret_key + "\n");
  ::chmod(path.c_str(), 0600);
}

Transport::Transport(const CurveKeys& keys) : keys_(keys) {
  ctx_ = zmq_ctx_new();
  if (!ctx_) throw Error(zerr("zmq_ctx_new"));
  if (keys_.enabled()) {
    if (!curve_available()) throw InvalidInput("CURVE keys given, but this libzmq has no CURVE support");
    // The ZAP handler must be bound before any CURVE server socket exists.
    void* rep = zmq_socket(ctx_, ZMQ_REP);
    setopt_int(rep, ZMQ_LINGER, 0);
    if (zmq_bind(rep, "inproc://zeromq.zap.01") != 0) throw Error(zerr("binding the ZAP handler"));
    zap_socket_ = rep;
    zap_ = std::thread([this] { zap_loop(); });
  }
}

Transport::~Transport() {
  stop_ = true;
  if (zap_.joinable()) zap_.join();
  zmq_ctx_term(ctx_);
}

// ZAP (RFC 27): admit a CURVE client only if its public key is the job's.
void Transport::zap_loop() {
  void* rep = zap_socket_;
  uint8_t job_key[32];
  zmq_z85_decode(job_key, keys_.public_key.c_str());
  while (!stop_) {
    zmq_pollitem_t item{rep, 0, ZMQ_POLLIN, 0};
    if (zmq_poll(&item, 1, 100) <= 0) continue;
    std::vector<std::string> parts;
    int more = 1;
    while (more) {
      zmq_msg_t m;
      zmq_msg_init(&m);
      if (zmq_msg_recv(&m, rep, 0) < 0) {
        zmq_msg_close(&m);
        break;
      }
      parts.push_back(frame_text(m));
      more = zmq_msg_more(&m);
      zmq_msg_close(&m);
    }
    if (parts.size() < 6) {
      // A partial request still gets its answer: a REP socket that does not
      // reply can never receive again, which would lock every peer out.
      zap_refused_ += 1;
      log_warn("refused a malformed ZAP request (" + std::to_string(parts.size()) + " frames)");
      const std::vector<std::string> reply = {"1.0", parts.size() > 1 ? parts[1] : std::string(), "400",
                                              "malformed ZAP request", "", ""};
      for (size_t i = 0; i < reply.size(); ++i)
        zmq_send(rep, reply[i].data(), reply[i].size(), i + 1 < reply.size() ? ZMQ_SNDMORE : 0);
      continue;
    }
    const std::string& version = parts[0];
    const std::string& request_id = parts[1];
    const std::string& mechanism = parts[5];
    bool ok = mechanism == "CURVE" && parts.size() >= 7 && parts[6].size() == 32 &&
              std::memcmp(parts[6].data(), job_key, 32) == 0;
    if (ok) zap_accepted_ += 1;
    else {
      zap_refused_ += 1;
      log_warn("refused a peer from " + parts[3] + ": its CURVE key is not this job's");
    }
    std::vector<std::string> reply = {version, request_id, ok ? "200" : "400",
                                      ok ? "OK" : "key not allowed", "", ""};
    for (size_t i = 0; i < reply.size(); ++i)
      zmq_send(rep, reply[i].data(), reply[i].size(), i + 1 < reply.size() ? ZMQ_SNDMORE : 0);
  }
  zmq_close(rep);
}

Socket::Socket(Transport& t, Kind kind, uint64_t max_message_bytes) : kind_(kind), transport_(t) {
  sock_ = zmq_socket(t.context(), kind == Kind::Router ? ZMQ_ROUTER : ZMQ_DEALER);
  if (!sock_) throw Error(zerr("zmq_socket"));
  setopt_int(sock_, ZMQ_LINGER, 0);
  setopt_int(sock_, ZMQ_RECONNECT_IVL, 50);
  setopt_int(sock_, ZMQ_RECONNECT_IVL_MAX, 500);
  if (kind == Kind::Dealer) setopt_int(sock_, ZMQ_SNDTIMEO, 200);
  setopt_int(sock_, ZMQ_SNDHWM, 0);
  setopt_int(sock_, ZMQ_RCVHWM, 0);
  if (max_message_bytes > 0) {
    int64_t m = static_cast<int64_t>(max_message_bytes);
    zmq_setsockopt(sock_, ZMQ_MAXMSGSIZE, &m, sizeof m);
  }
  const CurveKeys& k = t.keys();
  if (k.enabled()) {
    if (kind == Kind::Router) {
      setopt_int(sock_, ZMQ_CURVE_SERVER, 1);
      zmq_setsockopt(sock_, ZMQ_CURVE_SECRETKEY, k.secret_key.c_str(), 40);
      zmq_setsockopt(sock_, ZMQ_ZAP_DOMAIN, "limbo", 5);
    } else {
      const std::string& server = k.server_key.empty() ? k.public_key : k.server_key;
      zmq_setsockopt(sock_, ZMQ_CURVE_SERVERKEY, server.c_str(), 40);
      zmq_setsockopt(sock_, ZMQ_CURVE_PUBLICKEY, k.public_key.c_str(), 40);
      zmq_setsockopt(sock_, ZMQ_CURVE_SECRETKEY, k.secret_key.c_str(), 40);
    }
  }
}

Socket::~Socket() { zmq_close(sock_); }

std::string Socket::bind(const std::string& endpoint) {
  if (zmq_bind(sock_, endpoint.c_str()) != 0) throw InvalidInput(zerr("cannot bind " + endpoint));
  char buf[256];
  size_t n = sizeof buf;
  zmq_getsockopt(sock_, ZMQ_LAST_ENDPOINT, buf, &n);
  return std::string(buf);
}

void Socket::connect(const std::string& endpoint) {
  if (zmq_connect(sock_, endpoint.c_str()) != 0) throw InvalidInput(zerr("cannot connect to " + endpoint));
}

namespace {
// A frame without a copy when `keep` owns its bytes (held until ZeroMQ has sent them).
void send_owned(void* sock, const void* data, size_t n, std::shared_ptr<void> keep, bool more) {
  if (!keep || n == 0) return send_frame(sock, data, n, more);
  zmq_msg_t m;
  auto* hint = new std::shared_ptr<void>(std::move(keep));
  zmq_msg_init_data(&m, const_cast<void*>(data), n, release_keep, hint);
  if (zmq_msg_send(&m, sock, more ? ZMQ_SNDMORE : 0) < 0) {
    zmq_msg_close(&m);
    throw PeerFailure(zerr("zmq send"));
  }
}
}  // namespace

bool Socket::send(const std::string* identity, const Header& h, const std::string& meta, const void* payload,
                  size_t bytes, std::shared_ptr<void> keep, const Frame* buffers) {
  if (identity) send_frame(sock_, identity->data(), identity->size(), true);
  Header hh = h;
  hh.payload_bytes = bytes;
  hh.flags = buffers ? (hh.flags | kBuffers) : (hh.flags & ~kBuffers);  // the frame count follows the flag
  unsigned char hdr[kHeaderBytes];
  encode_header(hh, hdr);
  if (!identity) {
    // A DEALER with no connected peer (shard down, CURVE handshake refused)
    // blocks; after the send timeout the message counts as not sent. Once the
    // first frame is queued, the rest of a multipart message always is.
    if (zmq_send(sock_, hdr, kHeaderBytes, ZMQ_SNDMORE) < 0) {
      if (zmq_errno() == EAGAIN) return false;
      throw PeerFailure(zerr("zmq send"));
    }
  } else {
    send_frame(sock_, hdr, kHeaderBytes, true);
  }
  send_frame(sock_, meta.data(), meta.size(), true);
  send_owned(sock_, payload, bytes, std::move(keep), buffers != nullptr);
  if (buffers) send_owned(sock_, buffers->data, buffers->size, buffers->keep, false);
  return true;
}

void Socket::send_raw(const std::vector<std::string>& frames) {
  for (size_t i = 0; i < frames.size(); ++i)
    send_frame(sock_, frames[i].data(), frames[i].size(), i + 1 < frames.size());
}

bool Socket::recv(std::vector<Frame>& frames, std::string* identity, int timeout_ms) {
  frames.clear();
  zmq_pollitem_t item{sock_, 0, ZMQ_POLLIN, 0};
  int rc = zmq_poll(&item, 1, timeout_ms);
  if (rc < 0) {
    if (zmq_errno() == EINTR) return false;
    throw Error(zerr("zmq_poll"));
  }
  if (rc == 0) return false;
  bool first = kind_ == Kind::Router;
  constexpr size_t kMaxFrames = 16;  // more is malformed anyway; keep memory bounded
  size_t seen = 0;
  for (;;) {
    auto m = new_msg();
    if (zmq_msg_recv(m.get(), sock_, 0) < 0) {
      if (zmq_errno() == EINTR) continue;
      throw Error(zerr("zmq recv"));
    }
    const bool more = zmq_msg_more(m.get());
    if (first) {
      if (identity) *identity = frame_text(*m);
      first = false;
    } else if (seen++ < kMaxFrames) {
      Frame f;
      f.size = zmq_msg_size(m.get());
      f.data = static_cast<const unsigned char*>(zmq_msg_data(m.get()));
      f.keep = m;
      frames.push_back(std::move(f));
    }
    if (!more) break;
  }
  return true;
}

int Socket::poll(const std::vector<Socket*>& sockets, int timeout_ms) {
  std::vector<zmq_pollitem_t> items;
  for (auto* s : sockets) items.push_back({s->sock_, 0, ZMQ_POLLIN, 0});
  int rc = zmq_poll(items.data(), static_cast<int>(items.size()), timeout_ms);
  if (rc <= 0) return -1;
  for (size_t i = 0; i < items.size(); ++i)
    if (items[i].revents & ZMQ_POLLIN) return static_cast<int>(i);
  return -1;
}

}  // namespace limbo::ps
