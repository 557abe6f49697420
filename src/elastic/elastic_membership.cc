#include "elastic/elastic_membership.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <set>

#include "common/error.h"
#include "common/log.h"

namespace limbo::elastic {
namespace {

using Clock = std::chrono::steady_clock;
double since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

}  // namespace

std::pair<bool, int> storage_writer(comm::Collective& g, int64_t storage, std::vector<int>* earlier) {
  torch::NoGradGuard no_grad;
  auto ids = torch::full({g.size()}, -1.0, torch::kFloat64);
  ids[g.rank()] = static_cast<double>(storage);
  g.allreduce_max(ids);
  const auto* v = ids.data_ptr<double>();
  bool first = storage != 0;  // no run directory: nothing to write
  for (int r = 0; r < g.rank(); ++r) {
    first = first && v[r] != v[g.rank()];
    if (earlier && storage != 0 && v[r] == v[g.rank()]) earlier->push_back(r);
  }
  std::set<double> distinct(v, v + g.size());
  distinct.erase(0.0);  // members without a run directory keep no copy
  return {first, static_cast<int>(distinct.size())};
}

std::string share_records(comm::Collective& g, const train::SyncTargets& s, bool writer) {
  torch::NoGradGuard no_grad;
  const int64_t size = s.record_count ? s.record_count() : 0;
  // The fullest copy (the most records; ties: the lowest rank), encoded so
  // that a max picks it; then whether some writer's copy holds fewer.
  const double kRanks = 65536.0;
  auto key = torch::tensor({static_cast<double>(size) * kRanks + (kRanks - 1 - g.rank())}, torch::kFloat64);
  g.allreduce_max(key);
  const double v = key.item<double>();
  const int source = static_cast<int>(kRanks - 1 - std::fmod(v, kRanks));
  const int64_t most = static_cast<int64_t>(std::floor(v / kRanks));
  const bool behind = writer && size < most;
  auto any = torch::tensor({behind ? 1.0 : 0.0}, torch::kFloat64);
  g.allreduce_max(any);
  if (any.item<double>() == 0) return {};
  const std::string mine = g.rank() == source && s.records ? s.records() : std::string();
  auto n = torch::tensor({static_cast<int64_t>(mine.size())}, torch::kInt64);
  g.broadcast(n, source);
  if (n.item<int64_t>() == 0) return {};
  auto bytes = torch::empty({n.item<int64_t>()}, torch::kUInt8);
  if (g.rank() == source) std::memcpy(bytes.data_ptr<uint8_t>(), mine.data(), mine.size());
  g.broadcast(bytes, source);
  if (!behind) return {};
  return std::string(reinterpret_cast<const char*>(bytes.data_ptr<uint8_t>()), static_cast<size_t>(bytes.numel()));
}

int sync_state(comm::Collective& g, train::SyncTargets& s) {
  torch::NoGradGuard no_grad;
  // Newest committed step wins; among equals the lowest rank (encoded so
  // that a max picks it).
  const double kRanks = 65536.0;
  auto key = torch::tensor({static_cast<double>(s.state.step) * kRanks + (kRanks - 1 - g.rank())},
                           torch::kFloat64);
  g.allreduce_max(key);
  const double v = key.item<double>();
  const int source = static_cast<int>(kRanks - 1 - std::fmod(v, kRanks));

  auto& opt = s.optimizer;
  auto meta = torch::tensor({s.state.step, s.state.cursor.epoch, s.state.cursor.position,
                             s.state.samples, static_cast<int64_t>(opt.has_state()),
                             s.state.skipped_steps, s.state.skipped_in_a_row, opt.steps()},
                            torch::kInt64);
  g.broadcast(meta, source);
  g.broadcast(s.weights, source);
  if (s.buffers.numel() > 0) g.broadcast(s.buffers, source);
  // The optimizer's state, tensor by tensor in the order of its names (every
  // member runs the same configuration, so the names agree).
  if (meta[4].item<int64_t>() != 0) {
    std::vector<torch::Tensor> tensors;
    for (size_t i = 0; i < opt.state_names().size(); ++i) {
      torch::Tensor t = opt.has_state() ? opt.state()[i] : torch::empty_like(s.weights);
      g.broadcast(t, source);
      tensors.push_back(t);
    }
    opt.set_state(std::move(tensors), meta[7].item<int64_t>());
  } else {
    opt.set_state({}, meta[7].item<int64_t>());
  }
  auto policy = s.policy.state();
  g.broadcast(policy, source);
  s.policy.load_state(policy);
  if (s.isgd) {
    auto st = s.isgd->state();
    auto n = torch::tensor({st.numel()}, torch::kInt64);
    g.broadcast(n, source);
    if (st.numel() != n.item<int64_t>()) st = torch::zeros({n.item<int64_t>()}, torch::kFloat64);
    g.broadcast(st, source);
    s.isgd->load_state(st);
  }
  s.state.step = meta[0].item<int64_t>();
  s.state.cursor = {meta[1].item<int64_t>(), meta[2].item<int64_t>()};
  s.state.samples = meta[3].item<int64_t>();
  s.state.skipped_steps = meta[5].item<int64_t>();
  s.state.skipped_in_a_row = meta[6].item<int64_t>();
  return source;
}

ElasticMembership::ElasticMembership(std::unique_ptr<Member> member,
                                     std::shared_ptr<AllReduceUpdate> rule,
                                     std::function<bool()> want_leave)
    : member_(std::move(member)), rule_(std::move(rule)), want_leave_(std::move(want_leave)) {
  rule_->set_flag_source([this] {
    return (want_leave_() || member_->newer_round(round_.number)) ? 1.0 : 0.0;
  });
}

train::Membership::Established ElasticMembership::establish(train::SyncTargets& s,
                                                            const std::string& reason) {
  auto t0 = Clock::now();
  // Close the old round's connections first: peers still blocked in one of
  // its collectives then fail at once (connection reset) instead of waiting
  // for the collective timeout.
  rule_->set_group(nullptr);
  if (round_.number > 0) member_->request_round(round_.number);
  for (int attempt = 0;; ++attempt) {
    Round next = member_->wait_round(round_.number);
    // The others may have finished the step this member failed (the last
    // one), published that training completed and left: redoing it alone
    // would train past the end.
    if (member_->completed())
      throw train::CompletedElsewhere("worker " + std::to_string(member_->id()) +
                                      ": training completed on the other members while this one re-formed");
    double rendezvous = since(t0);
    auto t1 = Clock::now();
    try {
      std::shared_ptr<comm::Collective> group = member_->form_group(next);
      double form = since(t1);
      auto t2 = Clock::now();
      rule_->set_group(group);
      int source = sync_state(*group, s);
      Established e;
      e.world = group->size();
      e.rank = group->rank();
      std::vector<int> earlier;
      std::tie(e.writes_run_dir, e.record_copies) = storage_writer(*group, s.storage, &earlier);
      earlier_on_storage_.clear();
      for (int r : earlier) earlier_on_storage_.push_back(next.members.at(static_cast<size_t>(r)));
      e.records = share_records(*group, s, e.writes_run_dir);
      e.event = {{"kind", "membership"},
                 {"time", std::chrono::duration<double>(
                              std::chrono::system_clock::now().time_since_epoch()).count()},
                 {"round", next.number},
                 {"members", next.members},
                 {"old_members", round_.members},
                 {"world", e.world},
                 {"transport", group->transport()},
                 {"reason", reason},
                 {"worker_id", member_->id()},
                 {"state_source_rank", source},
                 {"record_copies", e.record_copies},
                 {"step", s.state.step},
                 {"rendezvous_seconds", rendezvous},
                 {"group_seconds", form},
                 {"sync_seconds", since(t2)},
                 {"attempts", attempt + 1}};
      round_ = next;
      return e;
    } catch (const Error& err) {
      // A member of this round is gone too: ask for the next one.
      log_warn("worker " + std::to_string(member_->id()) + ": round " +
               std::to_string(next.number) + " failed to form (" + err.what() + "); retrying");
      member_->request_round(next.number);
      round_.number = next.number;
    }
  }
}

}  // namespace limbo::elastic
