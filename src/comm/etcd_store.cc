// The etcd rendezvous's user-facing layer: `etcd://` addresses, the
// credentials' trip through the environment, and the rendezvous interface
// (comm/kv_store.h) over EtcdClient (etcd.cc). See comm/etcd.h.
#include <algorithm>
#include <cctype>
#include <atomic>
#include <cstdlib>
#include <map>
#include <mutex>
#include <random>
#include <sstream>
#include <thread>

#include "comm/etcd.h"

namespace limbo::comm {

using Clock = std::chrono::steady_clock;

std::string EtcdOptions::url() const {
  std::string s = tls ? "etcds://" : "etcd://";
  for (size_t i = 0; i < endpoints.size(); ++i) s += (i ? "," : "") + endpoints[i];
  return s + "/" + job;
}

bool is_etcd_url(const std::string& s) { return s.rfind("etcd://", 0) == 0 || s.rfind("etcds://", 0) == 0; }

EtcdOptions parse_etcd_url(const std::string& url, const std::string& flag) {
  auto bad = [&](const std::string& why) {
    return InvalidInput(flag + " " + url + ": " + why +
                        " (expected etcd://HOST:PORT[,HOST:PORT...]/JOB, or etcds:// for TLS)");
  };
  if (!is_etcd_url(url)) throw bad("not an etcd address");
  EtcdOptions o;
  o.tls = url.rfind("etcds://", 0) == 0;
  const std::string rest = url.substr(o.tls ? 8 : 7);
  const auto slash = rest.find('/');
  if (slash == std::string::npos || slash + 1 >= rest.size()) throw bad("no job name after the endpoints");
  o.job = rest.substr(slash + 1);
  for (char c : o.job)
    if (!(std::isalnum(static_cast<unsigned char>(c)) || c == '-' || c == '_' || c == '.'))
      throw bad("the job name may hold letters, digits, '-', '_' and '.'");
  std::stringstream ss(rest.substr(0, slash));
  for (std::string ep; std::getline(ss, ep, ',');) {
    const auto colon = ep.rfind(':');
    int port = 0;
    try {
      size_t used = 0;
      if (colon == std::string::npos || colon == 0) throw std::invalid_argument("");
      port = std::stoi(ep.substr(colon + 1), &used);
      if (used != ep.size() - colon - 1) throw std::invalid_argument("");
    } catch (const std::exception&) {
      throw bad("endpoint '" + ep + "' is not HOST:PORT");
    }
    if (port < 1 || port > 65535) throw bad("port " + std::to_string(port) + " is out of range");
    o.endpoints.push_back(ep);
  }
  if (o.endpoints.empty()) throw bad("no endpoint");
  return o;
}

void etcd_from_env(EtcdOptions* o) {
  auto take = [](const char* name, std::string* into) {
    if (const char* v = std::getenv(name); v && *v && into->empty()) *into = v;
  };
  take("LIMBO_ETCD_USER", &o->user);
  take("LIMBO_ETCD_PASSWORD", &o->password);
  take("LIMBO_ETCD_CACERT", &o->ca_file);
  take("LIMBO_ETCD_CERT", &o->cert_file);
  take("LIMBO_ETCD_KEY", &o->key_file);
}

void etcd_to_env(const EtcdOptions& o) {
  auto put = [](const char* name, const std::string& v) {
    if (!v.empty()) ::setenv(name, v.c_str(), 1);
  };
  put("LIMBO_ETCD_USER", o.user);
  put("LIMBO_ETCD_PASSWORD", o.password);
  put("LIMBO_ETCD_CACERT", o.ca_file);
  put("LIMBO_ETCD_CERT", o.cert_file);
  put("LIMBO_ETCD_KEY", o.key_file);
}

namespace {

class EtcdKvStore : public KvStore {
 public:
  EtcdKvStore(const EtcdOptions& o, std::chrono::milliseconds timeout,
              std::optional<std::pair<std::string, std::string>> fence)
      : c_(o, timeout), prefix_(o.prefix()), fence_(std::move(fence)) {}

  void set(const std::string& key, const std::string& value) override {
    if (!fence_) return c_.put(prefix_ + key, value);
    if (!c_.txn({fence_cond()}, {{prefix_ + key, value}})) fenced_out();
  }
  std::optional<std::string> try_get(const std::string& key) override {
    auto kv = c_.get(prefix_ + key);
    if (!kv) return std::nullopt;
    return kv->value;
  }
  // A compare-and-swap on the key's revision, retried while others write it.
  int64_t add(const std::string& key, int64_t delta) override {
    const auto deadline = Clock::now() + c_.timeout();
    int lost = 0;
    while (true) {
      auto kv = c_.get(prefix_ + key);
      int64_t v = 0;
      try {
        v = kv ? std::stoll(kv->value) : 0;
      } catch (const std::exception&) {
        throw InvalidInput("etcd key '" + key + "' does not hold an integer");
      }
      if (delta == 0) return v;  // a read: no write, no race (600 members reading at once stalled on it)
      v += delta;
      std::vector<EtcdClient::Compare> when = {{EtcdClient::Compare::ModRevision, prefix_ + key, "",
                                                kv ? kv->mod_revision : 0}};
      if (fence_) when.push_back(fence_cond());
      if (c_.txn(when, {{prefix_ + key, std::to_string(v)}})) return v;
      check_fence();
      // Lost the race to another writer: back off a random while (growing
      // to 50 ms) so that many contenders do not keep colliding.
      ++lost;
      std::this_thread::sleep_for(std::chrono::microseconds(
          std::uniform_int_distribution<int64_t>(0, std::min<int64_t>(50000, 1000LL << std::min(lost, 6)))(rng_)));
      if (Clock::now() > deadline)
        throw Timeout("etcd at " + c_.describe() + ": adding to '" + key + "' lost every race for " +
                      std::to_string(c_.timeout().count()) + " ms");
    }
  }
  // A key of its own under `key`/, numbered by how many were created up to
  // and including it: three calls whatever the contention, no retries.
  int64_t ticket(const std::string& key) override {
    std::random_device rd;  // not rng_: two processes seeded alike would draw the same key
    char name[40];
    std::snprintf(name, sizeof name, "%08x%08x%08x%08x", rd(), rd(), rd(), rd());
    const std::string mine = prefix_ + key + "/" + name;
    c_.put(mine, "");
    const auto kv = c_.get(mine);
    if (!kv) throw PeerFailure("etcd at " + c_.describe() + ": the ticket '" + mine + "' vanished");
    return c_.count(prefix_ + key + "/", kv->create_revision);
  }
  bool wait_for(const std::string& key, std::chrono::milliseconds timeout) override {
    const auto deadline = Clock::now() + timeout;
    while (true) {
      int64_t revision = 0;
      if (c_.get(prefix_ + key, &revision)) return true;
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
      if (left.count() <= 0) return false;
      if (!c_.watch(prefix_ + key, revision, left) && Clock::now() >= deadline) return c_.get(prefix_ + key).has_value();
    }
  }
  std::vector<std::pair<std::string, std::string>> list(const std::string& prefix) override {
    std::vector<std::pair<std::string, std::string>> out;
    for (auto& kv : c_.list(prefix_ + prefix)) out.emplace_back(kv.key.substr(prefix_.size()), std::move(kv.value));
    return out;
  }
  std::string compare_set(const std::string& key, const std::string& expected, const std::string& desired) override {
    std::vector<EtcdClient::Compare> when;
    if (expected.empty()) when.push_back({EtcdClient::Compare::CreateRevision, prefix_ + key, "", 0});
    else when.push_back({EtcdClient::Compare::Value, prefix_ + key, expected, 0});
    if (fence_) when.push_back(fence_cond());
    if (c_.txn(when, {{prefix_ + key, desired}})) return desired;
    check_fence();
    auto kv = c_.get(prefix_ + key);
    if (expected.empty() && kv && kv->value.empty()) {
      // c10d's rule: a key that holds "" holds the expected value too.
      std::vector<EtcdClient::Compare> again = {{EtcdClient::Compare::Value, prefix_ + key, "", 0}};
      if (fence_) again.push_back(fence_cond());
      if (c_.txn(again, {{prefix_ + key, desired}})) return desired;
      check_fence();
      kv = c_.get(prefix_ + key);
    }
    return kv ? kv->value : expected;
  }
  bool erase(const std::string& key) override { return c_.erase(prefix_ + key) > 0; }
  std::string describe() const override { return c_.describe(); }

  ~EtcdKvStore() override { stop_watching(); }

  void interrupt_follow() override { c_.interrupt_streams(); }
  bool follow(const std::string& prefix, std::chrono::milliseconds idle, const std::function<bool()>& stop,
              const std::function<void(const std::string&, const std::string&)>& on_write) override {
    int64_t revision = 0;
    c_.get(prefix_ + prefix, &revision);  // (for the revision: from here on)
    return c_.watch_stream(prefix_ + prefix, revision + 1, idle, stop, [&](std::vector<EtcdClient::Event>&& events) {
      for (const auto& e : events)
        if (!e.deleted) on_write(e.key.substr(prefix_.size()), e.value);
    });
  }

  // The first call (and any after the stream broke, or from another
  // reader's revision) lists the prefixes and starts a watch stream from
  // the revision after the listing (EtcdClient::watch_stream, one
  // connection, one thread); later calls hand over what the stream
  // delivered since: a poll costs etcd nothing more than the changes
  // (listing three prefixes every 20 ms cost etcd most of a core at 1,000
  // members). Keys written and then erased come out as erased; each key
  // once, in its last state.
  KvChanges changes_since(const std::vector<std::string>& prefixes, int64_t since) override {
    KvChanges c;
    {
      std::unique_lock<std::mutex> lock(watch_mu_);
      if (watching_ && !watch_broken_ && since != 0 && since == handed_ && prefixes == watched_) {
        for (auto& [key, value] : pending_) {
          if (!under(prefixes, key)) continue;
          if (value) c.written.emplace_back(key, std::move(*value));
          else c.erased.push_back(key);
        }
        pending_.clear();
        c.full = false;
        c.revision = handed_ = ++tokens_;
        return c;
      }
    }
    stop_watching();
    int64_t from = 0;
    for (const auto& p : prefixes) {
      int64_t revision = 0;
      for (auto& kv : c_.list(prefix_ + p, &revision)) c.written.emplace_back(kv.key.substr(prefix_.size()), std::move(kv.value));
      from = from == 0 ? revision : std::min(from, revision);
    }
    std::string common = prefixes.empty() ? std::string() : prefixes[0];
    for (const auto& p : prefixes) {
      size_t n = 0;
      while (n < common.size() && n < p.size() && common[n] == p[n]) ++n;
      common.resize(n);
    }
    std::lock_guard<std::mutex> lock(watch_mu_);
    watched_ = prefixes;
    pending_.clear();
    watch_broken_ = false;
    watch_stop_ = false;
    watching_ = true;
    // From the oldest listing's next revision: an event the listings already
    // hold comes again, harmlessly (the same key, the same or a later state).
    watcher_ = std::thread([this, common, from] {
      const bool ok = c_.watch_stream(
          prefix_ + common, from + 1, std::chrono::milliseconds(500), [this] { return watch_stop_.load(); },
          [this](std::vector<EtcdClient::Event>&& events) {
            std::lock_guard<std::mutex> lock(watch_mu_);
            for (auto& e : events) {
              std::string key = e.key.substr(prefix_.size());
              if (e.deleted) pending_[key] = std::nullopt;
              else pending_[key] = std::move(e.value);
            }
          });
      if (!ok) {
        std::lock_guard<std::mutex> lock(watch_mu_);
        watch_broken_ = true;  // the next call lists again
      }
    });
    c.full = true;
    c.revision = handed_ = ++tokens_;
    return c;
  }

 private:
  static bool under(const std::vector<std::string>& prefixes, const std::string& key) {
    for (const auto& p : prefixes)
      if (key.compare(0, p.size(), p) == 0) return true;
    return false;
  }
  void stop_watching() {
    std::thread t;
    {
      std::lock_guard<std::mutex> lock(watch_mu_);
      watch_stop_ = true;
      watching_ = false;
      t = std::move(watcher_);
    }
    if (t.joinable()) {
      c_.interrupt_streams();  // (not its idle period)
      t.join();
    }
  }

  EtcdClient::Compare fence_cond() const {
    return {EtcdClient::Compare::Value, prefix_ + fence_->first, fence_->second, 0};
  }
  void check_fence() {
    if (!fence_) return;
    auto kv = c_.get(prefix_ + fence_->first);
    if (!kv || kv->value != fence_->second) fenced_out();
  }
  [[noreturn]] void fenced_out() {
    throw FencedOut("etcd key '" + fence_->first + "' no longer holds '" + fence_->second +
                    "': another launcher coordinates the job now");
  }

  EtcdClient c_;
  std::string prefix_;
  std::optional<std::pair<std::string, std::string>> fence_;
  std::minstd_rand rng_{std::random_device{}()};
  // changes_since's watch stream: its thread, the prefixes it serves, what
  // it delivered since the last call (a key's last state; nullopt: erased),
  // and the revision token the last call handed out (tokens of this
  // object, from a random start, so that another store's revision passed
  // in is not taken for one).
  std::mutex watch_mu_;
  std::thread watcher_;
  std::atomic<bool> watch_stop_{false};
  bool watching_ = false, watch_broken_ = false;
  std::vector<std::string> watched_;
  std::map<std::string, std::optional<std::string>> pending_;
  int64_t handed_ = 0;
  int64_t tokens_ = static_cast<int64_t>(std::random_device{}() & 0x3fffffff) << 20;
};

}  // namespace

std::unique_ptr<KvStore> connect_etcd(const EtcdOptions& o, std::chrono::milliseconds timeout,
                                      std::optional<std::pair<std::string, std::string>> fence) {
  return std::make_unique<EtcdKvStore>(o, timeout, std::move(fence));
}

}  // namespace limbo::comm
