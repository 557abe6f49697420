#include "comm/kv_store.h"

#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include "common/error.h"

namespace limbo::comm {
namespace {

class TcpKvStore : public KvStore {
 public:
  TcpKvStore(const std::string& host, int port, std::chrono::milliseconds timeout) {
    c10d::TCPStoreOptions so;
    so.port = static_cast<uint16_t>(port);
    so.isServer = false;
    so.waitWorkers = false;
    so.timeout = timeout;
    try {
      store_ = c10::make_intrusive<c10d::TCPStore>(host, so);
    } catch (const std::exception& e) {
      throw PeerFailure("cannot reach the rendezvous store at " + host + ":" +
                        std::to_string(port) + ": " + std::string(e.what()).substr(0, 200));
    }
  }
  void set(const std::string& key, const std::string& value) override {
    std::lock_guard<std::mutex> lock(mu_);
    guard([&] { store_->set(key, std::vector<uint8_t>(value.begin(), value.end())); });
  }
  std::optional<std::string> try_get(const std::string& key) override {
    std::lock_guard<std::mutex> lock(mu_);
    std::optional<std::string> out;
    guard([&] {
      if (store_->check({key})) {
        auto v = store_->get(key);
        out = std::string(v.begin(), v.end());
      }
    });
    return out;
  }
  int64_t add(const std::string& key, int64_t delta) override {
    std::lock_guard<std::mutex> lock(mu_);
    int64_t v = 0;
    guard([&] { v = store_->add(key, delta); });
    return v;
  }

 private:
  template <typename F>
  void guard(F&& f) {
    try {
      f();
    } catch (const std::exception& e) {
      throw PeerFailure(std::string("rendezvous store: ") + std::string(e.what()).substr(0, 200));
    }
  }
  std::mutex mu_;  // one connection, used from several threads
  c10::intrusive_ptr<c10d::TCPStore> store_;
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
