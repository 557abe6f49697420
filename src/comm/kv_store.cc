#include "comm/kv_store.h"

#include "comm/store.h"

#include "common/error.h"

namespace limbo::comm {
namespace {

class TcpKvStore : public KvStore {
 public:
  TcpKvStore(const std::string& host, int port, std::chrono::milliseconds timeout, const std::string& token)
      : client_(host, port, timeout, token) {}
  TcpKvStore(const StoreClient& client, std::chrono::milliseconds timeout) : client_(client, timeout) {}
  void set(const std::string& key, const std::string& value) override { client_.set(key, value); }
  std::optional<std::string> try_get(const std::string& key) override { return client_.try_get(key); }
  int64_t add(const std::string& key, int64_t delta) override { return client_.add(key, delta); }
  bool wait_for(const std::string& key, std::chrono::milliseconds timeout) override {
    return client_.wait_for({key}, timeout);
  }
  std::vector<std::pair<std::string, std::string>> list(const std::string& prefix) override {
    return client_.list(prefix);
  }
  std::string compare_set(const std::string& key, const std::string& expected, const std::string& desired) override {
    return client_.compare_set(key, expected, desired);
  }
  bool erase(const std::string& key) override { return client_.erase(key); }
  KvChanges changes_since(const std::vector<std::string>& prefixes, int64_t since) override {
    return client_.changes_since(prefixes, since);
  }
  std::string describe() const override { return client_.address(); }
  std::shared_ptr<KvStore> share(std::chrono::milliseconds timeout) override {
    return std::make_shared<TcpKvStore>(client_, timeout);
  }

 private:
  StoreClient client_;  // thread-safe: many calls in flight on its connection
};

}  // namespace

std::unique_ptr<KvStore> connect_kv_store(const std::string& host, int port,
                                          std::chrono::milliseconds timeout, const std::string& token) {
  return std::make_unique<TcpKvStore>(host, port, timeout, token);
}

std::unique_ptr<KvStore> kv_store_on(const StoreClient& client, std::chrono::milliseconds timeout) {
  return std::make_unique<TcpKvStore>(client, timeout);
}

KvChanges KvStore::changes_since(const std::vector<std::string>& prefixes, int64_t) {
  KvChanges c;
  for (const auto& p : prefixes)
    for (auto& kv : list(p)) c.written.push_back(std::move(kv));
  return c;
}

void Revisions::bump(const std::string& key) {
  auto [it, fresh] = of_key_.emplace(key, 0);
  if (!fresh) by_revision_.erase(it->second);
  it->second = ++revision_;
  by_revision_.emplace(revision_, key);
}

KvChanges MemoryKvStore::changes_since(const std::vector<std::string>& prefixes, int64_t since) {
  std::lock_guard<std::mutex> lock(mu_);
  return revisions_.since(
      prefixes, since, [&](const std::string& k) { return kv_.count(k) > 0; },
      [&](const std::string& k) { return kv_.at(k); });
}

void MemoryKvStore::bump(const std::string& key) { revisions_.bump(key); }

void MemoryKvStore::set(const std::string& key, const std::string& value) {
  std::lock_guard<std::mutex> lock(mu_);
  kv_[key] = value;
  bump(key);
  cv_.notify_all();
}

bool MemoryKvStore::wait_for(const std::string& key, std::chrono::milliseconds timeout) {
  std::unique_lock<std::mutex> lock(mu_);
  return cv_.wait_for(lock, timeout, [&] { return kv_.count(key) > 0; });
}

std::optional<std::string> MemoryKvStore::try_get(const std::string& key) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = kv_.find(key);
  if (it == kv_.end()) return std::nullopt;
  return it->second;
}

std::vector<std::pair<std::string, std::string>> MemoryKvStore::list(const std::string& prefix) {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<std::pair<std::string, std::string>> out;
  for (auto it = kv_.lower_bound(prefix); it != kv_.end() && it->first.compare(0, prefix.size(), prefix) == 0; ++it)
    out.emplace_back(it->first, it->second);
  return out;
}

std::string MemoryKvStore::compare_set(const std::string& key, const std::string& expected,
                                       const std::string& desired) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = kv_.find(key);
  if (it == kv_.end()) {
    if (!expected.empty()) return expected;
    kv_[key] = desired;
    bump(key);
    cv_.notify_all();
    return desired;
  }
  if (it->second == expected) {
    it->second = desired;
    bump(key);
  }
  cv_.notify_all();
  return it->second;
}

bool MemoryKvStore::erase(const std::string& key) {
  std::lock_guard<std::mutex> lock(mu_);
  if (kv_.erase(key) == 0) return false;
  bump(key);
  return true;
}

int64_t MemoryKvStore::add(const std::string& key, int64_t delta) {
  std::lock_guard<std::mutex> lock(mu_);
  int64_t v = kv_.count(key) ? std::stoll(kv_[key]) : 0;
  v += delta;
  kv_[key] = std::to_string(v);
  bump(key);
  cv_.notify_all();
  return v;
}

}  // namespace limbo::comm
