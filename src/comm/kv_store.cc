#include "comm/kv_store.h"

#include "comm/store.h"

#include "common/error.h"

namespace limbo::comm {
namespace {

class TcpKvStore : public KvStore {
 public:
  TcpKvStore(const std::string& host, int port, std::chrono::milliseconds timeout)
      : client_(host, port, timeout) {}
  void set(const std::string& key, const std::string& value) override { client_.set(key, value); }
  std::optional<std::string> try_get(const std::string& key) override { return client_.try_get(key); }
  int64_t add(const std::string& key, int64_t delta) override { return client_.add(key, delta); }

 private:
  StoreClient client_;  // thread-safe: one request at a time
};

}  // namespace

std::unique_ptr<KvStore> connect_kv_store(const std::string& host, int port,
                                          std::chrono::milliseconds timeout) {
  return std::make_unique<TcpKvStore>(host, port, timeout);
}

void MemoryKvStore::set(const std::string& key, const std::string& value) {
  std::lock_guard<std::mutex> lock(mu_);
  kv_[key] = value;
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
  return v;
}

}  // namespace limbo::comm
