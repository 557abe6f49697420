// A member's group as its Member sees it: every collective passes through,
// and the Member can tell whether the group is stuck (a collective in
// flight and none finished for a while) or answering. A member whose
// coordinator falls silent (its host paused: steal time, a live migration,
// a debugger) but whose peers answer has lost nothing and trains on; one
// whose collective is stuck as well is cut off (elastic/member.h).
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <vector>

#include "comm/collective.h"
#include "elastic/beats.h"

namespace limbo::elastic {

// What the Member reads: collectives in flight, and when the group last
// went busy or finished one (monotonic ns).
struct GroupActivity {
  std::atomic<int> in_flight{0};
  std::atomic<int64_t> last_change_ns{0};
  // A collective has been in flight for `ns` with none finished meanwhile.
  bool stuck_for(int64_t ns) const {
    return in_flight.load() > 0 && monotonic_ns() - last_change_ns.load() > ns;
  }
};

class WatchedGroup : public comm::Collective {
 public:
  WatchedGroup(std::shared_ptr<comm::Collective> inner, std::shared_ptr<GroupActivity> activity)
      : inner_(std::move(inner)), activity_(std::move(activity)) {}
  int rank() const override { return inner_->rank(); }
  int size() const override { return inner_->size(); }
  const char* transport() const override { return inner_->transport(); }
  void allreduce_sum(torch::Tensor& t) override { watched([&] { inner_->allreduce_sum(t); }); }
  void allreduce_sum_16(torch::Tensor& t) override { watched([&] { inner_->allreduce_sum_16(t); }); }
  void allreduce_max(torch::Tensor& t) override { watched([&] { inner_->allreduce_max(t); }); }
  void broadcast(torch::Tensor& t, int root) override { watched([&] { inner_->broadcast(t, root); }); }
  void reduce_scatter_sum(torch::Tensor& t, const std::vector<int64_t>& bounds) override {
    watched([&] { inner_->reduce_scatter_sum(t, bounds); });
  }
  bool reduce_scatter_sums_everywhere() const override { return inner_->reduce_scatter_sums_everywhere(); }
  void all_gather(torch::Tensor& t, const std::vector<int64_t>& bounds) override {
    watched([&] { inner_->all_gather(t, bounds); });
  }
  void abort() override { inner_->abort(); }

 private:
  template <typename F>
  void watched(F&& f) {
    struct InFlight {
      GroupActivity& a;
      explicit InFlight(GroupActivity& g) : a(g) {
        if (a.in_flight.fetch_add(1) == 0) a.last_change_ns = monotonic_ns();  // idle until now
      }
      ~InFlight() {
        a.in_flight -= 1;
        a.last_change_ns = monotonic_ns();
      }
    } in_flight(*activity_);
    f();
  }

  std::shared_ptr<comm::Collective> inner_;
  std::shared_ptr<GroupActivity> activity_;
};

}  // namespace limbo::elastic
