#include "comm/etcd.h"

#include <httplib.h>
#include <nlohmann/json.hpp>

#include <fcntl.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <mutex>
#include <random>
#include <cstring>
#include <thread>

#include "common/base64.h"
#include "common/log.h"

namespace limbo::comm {
namespace {

using Clock = std::chrono::steady_clock;
using nlohmann::json;


// gRPC status codes as the gateway reports them.
constexpr int kCancelled = 1, kUnknown = 2, kInvalidArgument = 3, kDeadline = 4, kNotFound = 5, kFailedPrecondition = 9,
              kPermissionDenied = 7, kResourceExhausted = 8, kAborted = 10, kInternal = 13, kUnavailable = 14,
              kUnauthenticated = 16;

// An answer of etcd that is not a transient failure (retrying elsewhere
// cannot help).
struct EtcdError : PeerFailure {
  EtcdError(int c, const std::string& m) : PeerFailure("etcd: " + m), code(c), message(m) {}
  int code;
  std::string message;
};

bool transient(int code) {
  return code == kCancelled || code == kUnknown || code == kDeadline || code == kResourceExhausted ||
         code == kAborted || code == kInternal || code == kUnavailable;
}

int64_t num(const json& j, const char* field) {
  if (!j.contains(field)) return 0;  // proto3's JSON leaves zero values out
  const auto& v = j[field];
  return v.is_string() ? std::stoll(v.get<std::string>()) : v.get<int64_t>();
}

// The first key after every key that starts with `prefix` (etcd's range_end).
std::string prefix_end(std::string p) {
  while (!p.empty()) {
    auto& c = p.back();
    if (static_cast<unsigned char>(c) < 0xff) {
      ++c;
      return p;
    }
    p.pop_back();
  }
  return std::string(1, '\0');
}

EtcdClient::KeyValue to_kv(const json& j) {
  EtcdClient::KeyValue kv;
  kv.key = base64_decode(j.value("key", ""));
  kv.value = base64_decode(j.value("value", ""));
  kv.create_revision = num(j, "create_revision");
  kv.mod_revision = num(j, "mod_revision");
  kv.lease = num(j, "lease");
  return kv;
}

int64_t header_revision(const json& j) { return j.contains("header") ? num(j["header"], "revision") : 0; }

}  // namespace

// One endpoint's HTTP client (keep-alive), made when first used.
struct EtcdClient::Conn {
  std::string endpoint;
  std::unique_ptr<httplib::Client> http;
};

namespace {

std::unique_ptr<httplib::Client> make_http(const EtcdOptions& o, const std::string& endpoint) {
  std::unique_ptr<httplib::Client> c;
  if (o.tls) {
    c = o.cert_file.empty() ? std::make_unique<httplib::Client>("https://" + endpoint)
                            : std::make_unique<httplib::Client>("https://" + endpoint, o.cert_file, o.key_file);
    if (!o.ca_file.empty()) c->set_ca_cert_path(o.ca_file);
    c->enable_server_certificate_verification(true);
  } else {
    c = std::make_unique<httplib::Client>("http://" + endpoint);
  }
  c->set_keep_alive(true);
  // Headers and body go out in separate writes: without this, Nagle's
  // algorithm and the server's delayed ACK add 40 ms to every call.
  c->set_tcp_nodelay(true);
  return c;
}

void set_timeouts(httplib::Client& c, Clock::duration d) {
  const auto us = std::max<int64_t>(1000, std::chrono::duration_cast<std::chrono::microseconds>(d).count());
  c.set_connection_timeout(us / 1000000, us % 1000000);
  c.set_read_timeout(us / 1000000, us % 1000000);
  c.set_write_timeout(us / 1000000, us % 1000000);
}

bool tls_error(httplib::Error e) {
  return e == httplib::Error::SSLConnection || e == httplib::Error::SSLLoadingCerts ||
         e == httplib::Error::SSLServerVerification;
}

}  // namespace

namespace {

// Endpoints that went silent (an attempt got no answer in its time), for
// this process: every client passes over them for kSilentFor unless all are
// silent. A stopped member keeps its connections open and answers nothing;
// without this, each client would spend its share of a call's time there
// again whenever its rotation came back to it (a heartbeat of 0.4 s has
// none to spare), and every new client would start there.
constexpr auto kSilentFor = std::chrono::seconds(5);
std::mutex g_silent_mu;
std::map<std::string, std::chrono::steady_clock::time_point>& silent_until() {
  static std::map<std::string, std::chrono::steady_clock::time_point> m;
  return m;
}

bool silent_now(const std::string& endpoint) {
  std::lock_guard<std::mutex> lock(g_silent_mu);
  auto it = silent_until().find(endpoint);
  return it != silent_until().end() && std::chrono::steady_clock::now() < it->second;
}

void mark_silent(const std::string& endpoint, bool silent) {
  std::lock_guard<std::mutex> lock(g_silent_mu);
  if (silent) silent_until()[endpoint] = std::chrono::steady_clock::now() + kSilentFor;
  else silent_until().erase(endpoint);
}

}  // namespace

EtcdClient::EtcdClient(EtcdOptions opt, std::chrono::milliseconds timeout)
    : opt_(std::move(opt)), timeout_(timeout) {
  if (opt_.endpoints.empty()) throw InvalidInput("etcd: no endpoint given");
  if (opt_.tls && opt_.cert_file.empty() != opt_.key_file.empty())
    throw InvalidInput("etcd: a client certificate needs its key (give both, or neither)");
  for (const auto& ep : opt_.endpoints) conns_.push_back(std::make_unique<Conn>(Conn{ep, nullptr}));
  std::random_device rd;  // one marker per client object, unique across processes
  char name[40];
  std::snprintf(name, sizeof name, "%08x%08x%08x%08x", rd(), rd(), rd(), rd());
  txn_marker_ = opt_.prefix() + "_txn/" + name;
  // OpenSSL writes without MSG_NOSIGNAL: a member that closed a TLS
  // connection would kill this process with SIGPIPE instead of failing
  // the call. Ignore it unless the program chose a handler of its own.
  struct sigaction old {};
  if (::sigaction(SIGPIPE, nullptr, &old) == 0 && old.sa_handler == SIG_DFL) ::signal(SIGPIPE, SIG_IGN);
}

EtcdClient::~EtcdClient() = default;

std::string EtcdClient::call(const std::string& path, const std::string& body, bool* resent) {
  std::lock_guard<std::mutex> lock(mu_);
  if (!opt_.user.empty() && auth_token_.empty()) authenticate_locked();
  return call_locked(path, body, false, resent);
}

void EtcdClient::authenticate_locked() {
  const json req = {{"name", opt_.user}, {"password", opt_.password}};
  const auto answer = json::parse(call_locked("/v3/auth/authenticate", req.dump(), true));
  auth_token_ = answer.value("token", "");
  if (auth_token_.empty()) throw InvalidInput("etcd at " + opt_.url() + " gave no token for user " + opt_.user);
}

// Tries the endpoints in turn until one answers or the call's time is up.
// A silent endpoint gets half of what is left (at most a second), so that
// another can still answer in time.
std::string EtcdClient::call_locked(const std::string& path, const std::string& body, bool authenticating,
                                    bool* resent) {
  const auto deadline = Clock::now() + timeout_;
  if (resent) *resent = false;
  std::string last = "no attempt";
  bool reached = false;
  bool reauthenticated = false;
  for (int attempt = 0; Clock::now() < deadline; ++attempt) {
    for (size_t k = 0; k < conns_.size() && silent_now(conns_[current_]->endpoint); ++k)
      current_ = (current_ + 1) % conns_.size();  // (all silent: the one reached first)
    Conn& c = *conns_[current_];
    if (!c.http) c.http = make_http(opt_, c.endpoint);
    // One attempt lasts at most a second: a request proposed while the
    // cluster had no leader is otherwise held by etcd for its own request
    // timeout (7 s with default settings) even after a new leader is up.
    // Retrying is safe: puts are idempotent, and adds and fenced writes are
    // transactions on what they read.
    const auto left = deadline - Clock::now();
    auto slot = conns_.size() > 1 && attempt < static_cast<int>(conns_.size()) ? left / 2 : left;
    set_timeouts(*c.http, std::min<Clock::duration>(slot, std::chrono::seconds(1)));
    // etcd's gateway ends an error answer with an HTTP trailer that
    // cpp-httplib does not read; the answer itself is in by then, so the
    // body is taken as it arrives.
    httplib::Request req;
    req.method = "POST";
    req.path = path;
    req.body = body;
    req.set_header("Content-Type", "application/json");
    if (!auth_token_.empty() && !authenticating) req.set_header("Authorization", auth_token_);
    int status = 0;
    std::string answer;
    req.response_handler = [&](const httplib::Response& r) {
      status = r.status;
      return true;
    };
    req.content_receiver = [&](const char* data, size_t n, uint64_t, uint64_t) {
      answer.append(data, n);
      return true;
    };
    httplib::Response res;
    httplib::Error err = httplib::Error::Success;
    const bool sent = c.http->send(req, res, err);
    if (!sent && (status == 0 || answer.empty() || status == 200)) {
      if (tls_error(err))
        throw InvalidInput("etcd at " + c.endpoint + ": TLS failed (" + httplib::to_string(err) +
                           "); check --etcd-cacert, --etcd-cert and --etcd-key");
      last = c.endpoint + ": " + httplib::to_string(err);
      // Unless no connection was made, etcd may have received the request
      // (and committed it) before its answer was lost.
      if (resent && err != httplib::Error::Connection) *resent = true;
      if (conns_.size() > 1) mark_silent(c.endpoint, true);
      c.http.reset();  // a fresh connection next time
      current_ = (current_ + 1) % conns_.size();
      continue;
    }
    if (!sent) c.http.reset();  // the trailer left the connection unusable
    reached = true;
    if (silent_now(c.endpoint)) mark_silent(c.endpoint, false);  // it answers again
    if (status == 200) return answer;
    int code = kUnknown;
    std::string message = answer;
    try {
      const auto j = json::parse(answer);
      code = static_cast<int>(j.value("code", kUnknown));
      message = j.value("message", j.value("error", answer));
    } catch (const std::exception&) {
    }
    if (code == kUnauthenticated && !authenticating && !opt_.user.empty() && !reauthenticated &&
        message.find("invalid auth token") != std::string::npos) {
      reauthenticated = true;  // the token expired: log in again, once per call
      authenticate_locked();
      continue;
    }
    if (!transient(code)) {
      if (code == kUnauthenticated || code == kPermissionDenied || code == kInvalidArgument ||
          code == kFailedPrecondition)
        throw InvalidInput("etcd at " + c.endpoint + " refused " + path + ": " + message);
      throw EtcdError(code, message);
    }
    last = c.endpoint + ": " + message;
    if (resent) *resent = true;  // e.g. "request timed out": the proposal may still commit
    current_ = (current_ + 1) % conns_.size();
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  const std::string what = "etcd at " + opt_.url() + " did not answer " + path + " within " +
                           std::to_string(timeout_.count()) + " ms (last: " + last + ")";
  if (reached) throw Timeout(what);
  throw PeerFailure(what);
}

void EtcdClient::put(const std::string& key, const std::string& value, int64_t lease, int64_t* revision) {
  json req = {{"key", base64_encode(key)}, {"value", base64_encode(value)}};
  if (lease) req["lease"] = std::to_string(lease);
  const auto j = json::parse(call("/v3/kv/put", req.dump()));
  if (revision) *revision = header_revision(j);
}

std::optional<EtcdClient::KeyValue> EtcdClient::get(const std::string& key, int64_t* revision) {
  const auto j = json::parse(call("/v3/kv/range", json{{"key", base64_encode(key)}}.dump()));
  if (revision) *revision = header_revision(j);
  if (!j.contains("kvs") || j["kvs"].empty()) return std::nullopt;
  return to_kv(j["kvs"][0]);
}

std::vector<EtcdClient::KeyValue> EtcdClient::list(const std::string& prefix, int64_t* revision) {
  const json req = {{"key", base64_encode(prefix)}, {"range_end", base64_encode(prefix_end(prefix))}};
  const auto j = json::parse(call("/v3/kv/range", req.dump()));
  if (revision) *revision = header_revision(j);
  std::vector<KeyValue> out;
  if (j.contains("kvs"))
    for (const auto& kv : j["kvs"]) out.push_back(to_kv(kv));
  return out;
}

int64_t EtcdClient::count(const std::string& prefix, int64_t max_create_revision) {
  // etcd's `count` ignores the revision filters (it counts the whole
  // range), so the keys come back (names only) and are counted here.
  json req = {{"key", base64_encode(prefix)}, {"range_end", base64_encode(prefix_end(prefix))}, {"keys_only", true}};
  if (max_create_revision > 0) req["max_create_revision"] = std::to_string(max_create_revision);
  const auto j = json::parse(call("/v3/kv/range", req.dump()));
  return j.contains("kvs") ? static_cast<int64_t>(j["kvs"].size()) : 0;
}

namespace {

nlohmann::json compare_json(const std::vector<EtcdClient::Compare>& when) {
  using Compare = EtcdClient::Compare;
  json compare = json::array();
  for (const auto& c : when) {
    json x = {{"key", base64_encode(c.key)}, {"result", c.not_equal ? "NOT_EQUAL" : "EQUAL"}};
    if (c.target == Compare::Value) {
      x["target"] = "VALUE";
      x["value"] = base64_encode(c.value);
    } else if (c.target == Compare::ModRevision) {
      x["target"] = "MOD";
      x["mod_revision"] = std::to_string(c.revision);
    } else {
      x["target"] = "CREATE";
      x["create_revision"] = std::to_string(c.revision);
    }
    compare.push_back(x);
  }
  return compare;
}

}  // namespace

int64_t EtcdClient::erase(const std::string& key, bool whole_prefix) {
  json req = {{"key", base64_encode(key)}};
  if (whole_prefix) {
    req["range_end"] = base64_encode(prefix_end(key));
    return num(json::parse(call("/v3/kv/deleterange", req.dump())), "deleted");
  }
  // A transaction (exactly once, txn): delete the key if it exists.
  Compare exists{Compare::CreateRevision, key, "", 0, true};
  json del = json::object();
  del["request_delete_range"] = req;
  json ops = json::array();
  ops.push_back(del);
  return txn_ops(compare_json({exists}), ops, nullptr) ? 1 : 0;
}

bool EtcdClient::txn(const std::vector<Compare>& when, const std::vector<std::pair<std::string, std::string>>& puts,
                     int64_t lease, int64_t* revision) {
  json success = json::array();
  for (const auto& [k, v] : puts) {
    json p = {{"key", base64_encode(k)}, {"value", base64_encode(v)}};
    if (lease) p["lease"] = std::to_string(lease);
    success.push_back({{"request_put", p}});
  }
  return txn_ops(compare_json(when), std::move(success), revision);
}

bool EtcdClient::txn_ops(json compare, json success, int64_t* revision) {
  // One of kMarkerSlots marker keys per client, by sequence number: threads
  // sharing this client each read their own transaction's slot (a slot is
  // reused only kMarkerSlots transactions later).
  constexpr uint64_t kMarkerSlots = 16;
  const uint64_t n = ++txn_seq_;
  const std::string seq = std::to_string(n);
  const std::string marker = txn_marker_ + "/" + std::to_string(n % kMarkerSlots);
  success.push_back({{"request_put", {{"key", base64_encode(marker)}, {"value", base64_encode(seq)}}}});
  bool resent = false;
  const auto j = json::parse(call("/v3/kv/txn", json{{"compare", compare}, {"success", success}}.dump(), &resent));
  if (revision) *revision = header_revision(j);
  if (j.value("succeeded", false)) return true;
  if (!resent) return false;
  // Refused after a lost answer: did the first attempt commit? Only this
  // client writes its marker.
  const auto read = get(marker);
  return read && read->value == seq;
}

int64_t EtcdClient::grant_lease(int ttl_seconds) {
  const auto j = json::parse(call("/v3/lease/grant", json{{"TTL", std::to_string(ttl_seconds)}}.dump()));
  const int64_t id = num(j, "ID");
  if (!id) throw PeerFailure("etcd at " + opt_.url() + " granted no lease: " + j.value("error", j.dump()));
  return id;
}

bool EtcdClient::keep_alive(int64_t lease) {
  const auto j = json::parse(call("/v3/lease/keepalive", json{{"ID", std::to_string(lease)}}.dump()));
  // A lease that no longer exists is renewed with TTL 0 (left out of the JSON).
  return j.contains("result") && num(j["result"], "TTL") > 0;
}

void EtcdClient::revoke_lease(int64_t lease) {
  try {
    call("/v3/lease/revoke", json{{"ID", std::to_string(lease)}}.dump());
  } catch (const EtcdError& e) {
    if (e.code != kNotFound) throw PeerFailure("etcd: revoking lease " + std::to_string(lease) + ": " + e.message);
  }
}

std::pair<std::string, std::string> EtcdClient::watch_target() {
  std::lock_guard<std::mutex> lock(mu_);
  if (!opt_.user.empty() && auth_token_.empty()) authenticate_locked();
  return {conns_[current_]->endpoint, auth_token_};
}

namespace {

// The POST of a watch's create request (the gateway streams its answers).
httplib::Request watch_request(const json& create, const std::string& token) {
  httplib::Request req;
  req.method = "POST";
  req.path = "/v3/watch";
  req.body = create.dump();
  req.set_header("Content-Type", "application/json");
  if (!token.empty()) req.set_header("Authorization", token);
  return req;
}

}  // namespace

// A watch from revision `after + 1` on its own connection (it is dropped
// when the wait ends). An event, or the watch being cancelled or compacted,
// ends the wait with true: the caller reads the key again.
bool EtcdClient::watch(const std::string& key, int64_t after, std::chrono::milliseconds timeout) {
  const auto [endpoint, token] = watch_target();
  auto http = make_http(opt_, endpoint);
  http->set_keep_alive(false);
  set_timeouts(*http, timeout);
  httplib::Request req = watch_request(
      {{"create_request", {{"key", base64_encode(key)}, {"start_revision", std::to_string(after + 1)}}}}, token);
  std::string pending;
  bool changed = false;
  std::string failure;
  req.content_receiver = [&](const char* data, size_t n, uint64_t, uint64_t) {
    pending.append(data, n);
    for (size_t nl; (nl = pending.find('\n')) != std::string::npos;) {
      const std::string line = pending.substr(0, nl);
      pending.erase(0, nl + 1);
      try {
        const auto j = json::parse(line);
        if (j.contains("error")) {
          failure = j["error"].value("message", j.dump());
          return false;
        }
        const auto& r = j.value("result", json::object());
        if ((r.contains("events") && !r["events"].empty()) || r.value("canceled", false) ||
            num(r, "compact_revision") > 0) {
          changed = true;
          return false;
        }
      } catch (const std::exception&) {
        // a partial line: wait for the rest
      }
    }
    return true;
  };
  httplib::Response res;
  httplib::Error err = httplib::Error::Success;
  http->send(req, res, err);
  if (changed) return true;
  if (!failure.empty()) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      current_ = (current_ + 1) % conns_.size();  // this endpoint could not watch: use another next time
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(10));  // no hot loop of failing watches
    return false;
  }
  if (err == httplib::Error::Connection || err == httplib::Error::ConnectionTimeout) {
    std::lock_guard<std::mutex> lock(mu_);
    current_ = (current_ + 1) % conns_.size();
    throw PeerFailure("etcd at " + endpoint + ": cannot watch " + key + " (" + httplib::to_string(err) + ")");
  }
  return false;  // timed out (or the stream ended) without a change
}

void EtcdClient::interrupt_streams() {
  std::lock_guard<std::mutex> lock(streams_mu_);
  ++interrupts_;
  for (const auto& [h, fd] : streams_) {
    if (fd >= 0) ::shutdown(fd, SHUT_RDWR);  // (a duplicate: never another's socket)
    static_cast<httplib::Client*>(h)->stop();
  }
}

bool EtcdClient::watch_stream(const std::string& prefix, int64_t from, std::chrono::milliseconds idle,
                              const std::function<bool()>& stop,
                              const std::function<void(std::vector<Event>&&)>& on_events) {
  int64_t next = from;
  while (!stop()) {
    const auto [endpoint, token] = watch_target();
    auto http = make_http(opt_, endpoint);
    http->set_keep_alive(false);
    set_timeouts(*http, idle);
    httplib::Request req = watch_request({{"create_request",
                                           {{"key", base64_encode(prefix)},
                                            {"range_end", base64_encode(prefix_end(prefix))},
                                            {"start_revision", std::to_string(next)}}}},
                                         token);
    std::string pending;
    bool gone = false, failed = false;
    req.content_receiver = [&](const char* data, size_t n, uint64_t, uint64_t) {
      pending.append(data, n);
      for (size_t nl; (nl = pending.find('\n')) != std::string::npos;) {
        const std::string line = pending.substr(0, nl);
        pending.erase(0, nl + 1);
        json j;
        try {
          j = json::parse(line);
        } catch (const std::exception&) {
          continue;  // not a whole answer
        }
        if (j.contains("error")) {
          failed = true;  // (opened again below)
          return false;
        }
        const auto& r = j.value("result", json::object());
        if (r.value("canceled", false) || num(r, "compact_revision") > 0) {
          gone = true;
          return false;
        }
        if (!r.contains("events") || r["events"].empty()) continue;
        std::vector<Event> events;
        for (const auto& e : r["events"]) {
          const auto kv = to_kv(e.value("kv", json::object()));
          Event ev{kv.key, kv.value, e.value("type", std::string("PUT")) == "DELETE", kv.mod_revision};
          next = std::max(next, ev.mod_revision + 1);
          events.push_back(std::move(ev));
        }
        on_events(std::move(events));
      }
      return !stop();
    };
    httplib::Response res;
    httplib::Error err = httplib::Error::Success;
    // Registered before its socket exists, and out again however send()
    // ends (an exception included).
    struct Registered {
      EtcdClient& c;
      void* h;
      uint64_t interrupts;
      Registered(EtcdClient& client, void* http) : c(client), h(http) {
        std::lock_guard<std::mutex> lock(c.streams_mu_);
        c.streams_[h] = -1;
        interrupts = c.interrupts_;
      }
      ~Registered() {
        std::lock_guard<std::mutex> lock(c.streams_mu_);
        auto it = c.streams_.find(h);
        if (it->second >= 0) ::close(it->second);
        c.streams_.erase(it);
      }
    } registered(*this, http.get());
    http->set_socket_options([this, h = http.get(), since = registered.interrupts](int sock) {
      const int dup = ::fcntl(sock, F_DUPFD_CLOEXEC, 0);
      std::lock_guard<std::mutex> lock(streams_mu_);
      auto it = streams_.find(h);
      if (dup >= 0 && it != streams_.end() && it->second < 0) it->second = dup;
      else if (dup >= 0) ::close(dup);
      if (interrupts_ != since) ::shutdown(sock, SHUT_RDWR);  // interrupted before its socket existed
    });
    if (!stop()) http->send(req, res, err);
    if (gone) return false;
    if (failed || err == httplib::Error::Connection || err == httplib::Error::ConnectionTimeout) {
      {
        std::lock_guard<std::mutex> lock(mu_);
        current_ = (current_ + 1) % conns_.size();
      }
      for (int i = 0; i < 5 && !stop(); ++i) std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
  }
  return true;
}

}  // namespace limbo::comm
