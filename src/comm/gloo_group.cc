// c10d/Gloo implementation of Collective. The only translation unit that
// includes c10d headers.
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include "comm/collective.h"
#include "common/error.h"

namespace limbo::comm {
namespace {

// c10d reports failures as c10::Error / std::runtime_error with messages;
// classify them so callers can recover (re-form on peer loss, retry on timeout).
// c10::Error's what() carries a backtrace; keep the message only.
std::string message_of(const std::exception& e) {
  if (auto* c = dynamic_cast<const c10::Error*>(&e)) return c->what_without_backtrace();
  return e.what();
}

[[noreturn]] void rethrow_classified(const std::string& what, const std::string& context) {
  auto has = [&](const char* s) { return what.find(s) != std::string::npos; };
  if (has("Timed out") || has("timed out") || has("Timeout") || has("timeout"))
    throw Timeout(context + ": " + what.substr(0, 300));
  throw PeerFailure(context + ": " + what.substr(0, 300));
}

class GlooGroup : public Collective {
 public:
  GlooGroup(const GroupOptions& opt, int rank, int size) : opt_(opt) {
    try {
      c10d::TCPStoreOptions so;
      so.port = static_cast<uint16_t>(opt.store_port);
      so.isServer = false;
      so.waitWorkers = false;
      so.timeout = opt.timeout;
      auto tcp = c10::make_intrusive<c10d::TCPStore>(opt.store_host, so);
      auto store = c10::make_intrusive<c10d::PrefixStore>(opt.prefix, tcp);
      auto go = c10d::ProcessGroupGloo::Options::create(opt.timeout);
      go->devices.push_back(c10d::ProcessGroupGloo::createDeviceForHostname(opt.bind_host));
      go->threads = opt.worker_threads;
      pg_ = c10::make_intrusive<c10d::ProcessGroupGloo>(store, rank, size, go);
    } catch (const limbo::Error&) {
      throw;
    } catch (const std::exception& e) {
      rethrow_classified(message_of(e), "forming the Gloo group '" + opt.prefix + "' (rank " +
                                       std::to_string(rank) + " of " + std::to_string(size) +
                                       ", store " + opt.store_host + ":" +
                                       std::to_string(opt.store_port) + ")");
    }
  }

  int rank() const override { return pg_->getRank(); }
  int size() const override { return pg_->getSize(); }

  void allreduce_sum(torch::Tensor& t) override {
    if (size() == 1) return;
    auto flat = t.view(-1);
    const int64_t per_bucket = std::max<int64_t>(1, opt_.bucket_bytes / t.element_size());
    // Issue every bucket, then wait: Gloo pipelines them on its own thread.
    std::vector<c10::intrusive_ptr<c10d::Work>> work;
    std::vector<std::vector<at::Tensor>> buckets;
    for (int64_t off = 0; off < flat.numel(); off += per_bucket) {
      buckets.push_back({flat.narrow(0, off, std::min(per_bucket, flat.numel() - off))});
    }
    try {
      for (auto& b : buckets) work.push_back(pg_->allreduce(b));
      for (auto& w : work) w->wait(opt_.timeout);
    } catch (const std::exception& e) {
      rethrow_classified(message_of(e), "all-reduce in group '" + opt_.prefix + "'");
    }
  }

  void allreduce_max(torch::Tensor& t) override {
    if (size() == 1) return;
    std::vector<at::Tensor> v = {t};
    c10d::AllreduceOptions ao;
    ao.reduceOp = c10d::ReduceOp::MAX;
    try {
      pg_->allreduce(v, ao)->wait(opt_.timeout);
    } catch (const std::exception& e) {
      rethrow_classified(message_of(e), "all-reduce (max) in group '" + opt_.prefix + "'");
    }
  }

  void broadcast(torch::Tensor& t, int root) override {
    if (size() == 1) return;
    std::vector<at::Tensor> v = {t};
    c10d::BroadcastOptions bo;
    bo.rootRank = root;
    try {
      pg_->broadcast(v, bo)->wait(opt_.timeout);
    } catch (const std::exception& e) {
      rethrow_classified(message_of(e), "broadcast in group '" + opt_.prefix + "'");
    }
  }

 private:
  GroupOptions opt_;
  c10::intrusive_ptr<c10d::ProcessGroupGloo> pg_;
};

}  // namespace

std::unique_ptr<Collective> make_gloo_group(const GroupOptions& opt, int rank, int size) {
  if (size < 1 || rank < 0 || rank >= size)
    throw InvalidInput("bad rank " + std::to_string(rank) + " for a group of " + std::to_string(size));
  return std::make_unique<GlooGroup>(opt, rank, size);
}

std::shared_ptr<void> host_store(const std::string& host, int* port,
                                 std::chrono::milliseconds timeout) {
  try {
    c10d::TCPStoreOptions so;
    so.port = static_cast<uint16_t>(*port);
    so.isServer = true;
    so.waitWorkers = false;
    so.timeout = timeout;
    auto store = c10::make_intrusive<c10d::TCPStore>(host, so);
    *port = store->getPort();
    // Keep the intrusive_ptr alive inside a shared_ptr<void>.
    auto holder = std::make_shared<c10::intrusive_ptr<c10d::TCPStore>>(store);
    return std::shared_ptr<void>(holder, holder.get());
  } catch (const std::exception& e) {
    throw InvalidInput("cannot host the rendezvous store on " + host + ":" + std::to_string(*port) +
                       ": " + std::string(e.what()).substr(0, 200));
  }
}

}  // namespace limbo::comm
