#include "comm/kv_store.h"

#include "comm/store.h"

#include "common/error.h"

namespace limbo::comm {
namespace {

class TcpKvStore : public KvStore {
 public:
  TcpKvStore(const std::string& host, int port, std::chrono::milliseconds timeout, const std::string& token)
      : client_(host, port, timeout, token) {}
  void set(const std::string& key, const std::string& value) override { client_.set(key, value); }
  std::optional<std::string> try_get(const std::string& key) override { return client_.try_get(key); }
  int64_t add(const std::string& key, int64_t delta) override { return client_.add(key, delta); }
  bool wait_for(const std::string& key, std::chrono::milliseconds timeout) override {
    return client_.wait_for({key}, timeout);
  }

 private:
  StoreClient client_;  // thread-safe: one request at a time
};

}  // namespace

std::unique_ptr<KvStore> connect_kv_store(const std::string& host, int port,
                                          std::chrono::milliseconds timeout, const std::string& token) {
  return std::make_unique<TcpKvStore>(host, port, timeout, token);
}

void MemoryKvStore::set(const std::string& key, const std::string& value) {
  std::lock_guard<std::mutex> lock(mu_);
  kv_[key] = value;
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

int64_t MemoryKvStore::add(const std::string& key, int64_t delta) {
  std::lock_guard<std::mutex> lock(mu_);
  int64_t v = kv_.count(key) ? std::stoll(kv_[key]) : 0;
  v += delta;
  kv_[key] = std::to_string(v);
  cv_.notify_all();
  return v;
}

}  // namespace limbo::comm
