#include "comm/hier_group.h"

#include <algorithm>
#include <map>
#include <vector>

#include "comm/shm_group.h"
#include "common/error.h"

namespace limbo::comm {
namespace {

// The local group of a host with one member.
class SoloGroup : public Collective {
 public:
  int rank() const override { return 0; }
  int size() const override { return 1; }
  void allreduce_sum(torch::Tensor&) override {}
  void allreduce_sum_16(torch::Tensor&) override {}
  void allreduce_max(torch::Tensor&) override {}
  void broadcast(torch::Tensor&, int) override {}
  void abort() override {}
};

// Where each member sits: its host (numbered by lowest rank) and its place
// among that host's members (by rank).
struct Layout {
  std::vector<int> host, local;
  std::vector<int> members;  // per host
  int chunks = 1;            // K: the smallest host's member count
};

Layout layout_of(const std::vector<std::string>& ids) {
  Layout l;
  std::map<std::string, int> index;
  for (const auto& id : ids) {
    auto [it, fresh] = index.emplace(id, static_cast<int>(l.members.size()));
    if (fresh) l.members.push_back(0);
    l.host.push_back(it->second);
    l.local.push_back(l.members[it->second]++);
  }
  l.chunks = *std::min_element(l.members.begin(), l.members.end());
  return l;
}

class HierGroup : public Collective {
 public:
  HierGroup(int rank, Layout layout, std::unique_ptr<Collective> local, std::unique_ptr<Collective> cross)
      : rank_(rank), l_(std::move(layout)), local_(std::move(local)), cross_(std::move(cross)) {}

  int rank() const override { return rank_; }
  int size() const override { return static_cast<int>(l_.host.size()); }
  const char* transport() const override { return "hierarchical"; }

  void allreduce_sum(torch::Tensor& t) override {
    if (t.scalar_type() == torch::kFloat32 && t.is_contiguous() && local_->size() > 1) return scattered_sum(t);
    guarded(t, [](Collective& g, torch::Tensor& x) { g.allreduce_sum(x); });
  }
  void allreduce_sum_16(torch::Tensor& t) override {
    guarded(t, [](Collective& g, torch::Tensor& x) { g.allreduce_sum_16(x); });
  }
  void allreduce_max(torch::Tensor& t) override {
    guarded(t, [](Collective& g, torch::Tensor& x) { g.allreduce_max(x); });
  }

  // From the root within its host, from the root's host to local member 0
  // of every other host (cross group 0), then within each other host.
  void broadcast(torch::Tensor& t, int root) override {
    if (root < 0 || root >= size())
      throw Error("broadcast from member " + std::to_string(root) + " of " + std::to_string(size()));
    const int my_host = l_.host[rank_], root_host = l_.host[root];
    try {
      torch::Tensor c = t.is_contiguous() ? t : t.contiguous();
      if (my_host == root_host) local_->broadcast(c, l_.local[root]);
      // Cross group 0 is every host's member 0, which has the tensor now
      // on the root's host.
      if (cross_ && l_.local[rank_] == 0) cross_->broadcast(c, root_host);
      if (my_host != root_host) local_->broadcast(c, 0);
      if (!c.is_same(t)) t.copy_(c);
    } catch (...) {
      abort();
      throw;
    }
  }

  void abort() override {
    local_->abort();
    if (cross_) cross_->abort();
  }

 private:
  // A float32 sum as guarded() makes it, with step 1 a reduce-scatter
  // within the host (local member j < K sums only chunk j, with the bits
  // the host's all-reduce gives it; a shared-memory host's members split
  // the additions and copies) and step 3 an all-gather of the chunks: the
  // same bits with a K-th of step 1's work on each member.
  void scattered_sum(torch::Tensor& t) {
    try {
      auto flat = t.view(-1);
      const int64_t n = flat.numel(), k = l_.chunks;
      std::vector<int64_t> bounds(static_cast<size_t>(local_->size()) + 1, n);  // members >= K: no chunk
      for (int64_t j = 0; j <= k; ++j) bounds[static_cast<size_t>(j)] = n * j / k;
      local_->reduce_scatter_sum(flat, bounds);
      const int me = l_.local[rank_];
      if (cross_ && me < k) {
        auto mine = flat.narrow(0, bounds[me], bounds[me + 1] - bounds[me]);
        if (mine.numel() > 0) cross_->allreduce_sum(mine);
      }
      local_->all_gather(flat, bounds);
    } catch (...) {
      abort();
      throw;
    }
  }

  template <typename Op>
  void guarded(torch::Tensor& t, Op op) {
    try {
      torch::Tensor c = t.is_contiguous() ? t : t.contiguous();
      op(*local_, c);  // 1. the host's sum, on every member of the host
      auto flat = c.view(-1);
      const int64_t n = flat.numel(), k = l_.chunks;
      auto chunk = [&](int64_t j) { return flat.narrow(0, n * j / k, n * (j + 1) / k - n * j / k); };
      const int me = l_.local[rank_];
      if (cross_ && me < k) {  // 2. chunk `me` between hosts
        auto mine = chunk(me);
        if (mine.numel() > 0) op(*cross_, mine);
      }
      if (local_->size() > 1)  // 3. every chunk within the host
        for (int64_t j = 0; j < k; ++j) {
          auto part = chunk(j);
          if (part.numel() > 0) local_->broadcast(part, static_cast<int>(j));
        }
      if (!c.is_same(t)) t.copy_(c);
    } catch (...) {
      abort();
      throw;
    }
  }

  int rank_;
  Layout l_;
  std::unique_ptr<Collective> local_, cross_;
};

// Every member's host, as each published it under the group's prefix.
std::vector<std::string> hosts_of_members(const GroupOptions& opt, int rank, int size) {
  auto kv = group_store(opt);
  kv->set(opt.prefix + "/host/" + std::to_string(rank), opt.host.empty() ? host_identity() : opt.host);
  std::vector<std::string> ids(static_cast<size_t>(size));
  for (int r = 0; r < size; ++r) ids[r] = wait_group_key(*kv, opt.prefix + "/host/" + std::to_string(r), opt);
  return ids;
}

std::unique_ptr<Collective> local_group(const GroupOptions& opt, int rank, int size) {
  if (size == 1) return std::make_unique<SoloGroup>();
  if (auto g = make_shm_group(opt, rank, size)) return g;
  return make_gloo_group(opt, rank, size);
}

}  // namespace

void check_shards(const torch::Tensor& t, const std::vector<int64_t>& bounds, int size, const char* what) {
  bool ok = t.is_contiguous() && static_cast<int>(bounds.size()) == size + 1 && bounds.front() == 0 &&
            bounds.back() == t.numel();
  for (size_t i = 1; ok && i < bounds.size(); ++i) ok = bounds[i - 1] <= bounds[i];
  if (!ok)
    throw Error(std::string(what) + ": the shard bounds do not cut a contiguous tensor of " +
                std::to_string(t.numel()) + " elements among " + std::to_string(size) + " members");
}

void Collective::all_gather(torch::Tensor& t, const std::vector<int64_t>& bounds) {
  check_shards(t, bounds, size(), "all-gather");
  auto flat = t.view(-1);
  for (int r = 0; r < size(); ++r) {
    auto part = flat.narrow(0, bounds[r], bounds[r + 1] - bounds[r]);
    if (part.numel() > 0) broadcast(part, r);
  }
}

std::unique_ptr<Collective> make_group(const GroupOptions& opt, int rank, int size) {
  if (size < 1 || rank < 0 || rank >= size)
    throw InvalidInput("bad rank " + std::to_string(rank) + " for a group of " + std::to_string(size));
  if (!opt.shared_memory || size == 1) return make_gloo_group(opt, rank, size);
  Layout l = layout_of(hosts_of_members(opt, rank, size));
  const int hosts = static_cast<int>(l.members.size());
  if (hosts == 1) return local_group(opt, rank, size);
  if (!opt.hierarchical || hosts == size) return make_gloo_group(opt, rank, size);

  const int host = l.host[rank], me = l.local[rank];
  GroupOptions lo = opt;
  lo.prefix = opt.prefix + "/local/" + std::to_string(host);
  auto local = local_group(lo, me, l.members[host]);
  std::unique_ptr<Collective> cross;
  if (me < l.chunks) {
    GroupOptions co = opt;
    co.prefix = opt.prefix + "/cross/" + std::to_string(me);
    try {
      cross = make_gloo_group(co, host, hosts);
    } catch (...) {
      local->abort();  // the host's other members stop waiting for this one
      throw;
    }
  }
  return std::make_unique<HierGroup>(rank, std::move(l), std::move(local), std::move(cross));
}

}  // namespace limbo::comm
