#include "elastic/elastic_membership.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <functional>
#include <set>

#include "common/error.h"
#include "common/log.h"
#include "train/checkpoint.h"

namespace limbo::elastic {
namespace {

using Clock = std::chrono::steady_clock;
double since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

}  // namespace

std::pair<double, int> max_and_rank(comm::Collective& g, double value) {
  torch::NoGradGuard no_grad;
  // Encoded so that one max picks both: value * R + (R - 1 - rank). The
  // remainder is taken with floor, so that negative values (a step of -1:
  // a member that forgot its step) decode too.
  const double kRanks = 65536.0;
  auto key = torch::tensor({value * kRanks + (kRanks - 1 - g.rank())}, torch::kFloat64);
  g.allreduce_max(key);
  const double v = key.item<double>();
  const double top = std::floor(v / kRanks);
  return {top, static_cast<int>(kRanks - 1 - (v - top * kRanks))};
}

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
  // The fullest copy (the most records; ties: the lowest rank); then
  // whether some writer's copy holds fewer.
  const auto [top, source] = max_and_rank(g, static_cast<double>(size));
  const int64_t most = static_cast<int64_t>(top);
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

namespace {

// The member with the newest committed step (ties: the lowest rank).
int newest_member(comm::Collective& g, int64_t step) { return max_and_rank(g, static_cast<double>(step)).second; }

// Buffers, the batch-size policy, ISGD's statistics and DiLoCo's owed
// samples (meta[8] of them, see meta_of) from `source`.
void sync_small_state(comm::Collective& g, train::SyncTargets& s, int source, const torch::Tensor& meta) {
  if (const int64_t k = meta[8].item<int64_t>(); k > 0) {
    auto owed = torch::empty({k, 2}, torch::kInt64);
    if (g.rank() == source)
      for (int64_t i = 0; i < k; ++i) {
        owed[i][0] = s.state.owed[static_cast<size_t>(i)].first;
        owed[i][1] = s.state.owed[static_cast<size_t>(i)].second;
      }
    g.broadcast(owed, source);
    s.state.owed.clear();
    for (int64_t i = 0; i < k; ++i) s.state.owed.push_back({owed[i][0].item<int64_t>(), owed[i][1].item<int64_t>()});
  } else {
    s.state.owed.clear();
  }
  if (s.buffers.numel() > 0) g.broadcast(s.buffers, source);
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
  if (s.pack_extra || s.unpack_extra) {  // the front end's own state (every member runs the same front end)
    if (s.extra_current) {
      // Moved only when some member needs it (one small agreement).
      const int64_t newest = meta[0].item<int64_t>();
      const bool need = !*s.extra_current || s.state.step != newest || newest <= 0;
      auto any = torch::tensor({need ? 1.0 : 0.0}, torch::kFloat64);
      g.allreduce_max(any);
      *s.extra_current = false;  // until this sync is done
      s.extra_moved = false;
      if (any.item<double>() == 0) {
        *s.extra_current = true;
        return;
      }
    }
    torch::Tensor blob = g.rank() == source && s.pack_extra ? s.pack_extra().contiguous() : torch::Tensor();
    auto n = torch::tensor({blob.defined() ? blob.numel() : int64_t{0}}, torch::kInt64);
    g.broadcast(n, source);
    if (g.rank() != source || !blob.defined()) blob = torch::empty({n.item<int64_t>()}, torch::kUInt8);
    if (blob.numel() > 0) g.broadcast(blob, source);
    if (g.rank() != source && s.unpack_extra) s.unpack_extra(blob);
    if (s.extra_current) *s.extra_current = true;
    s.extra_moved = true;
  }
}

torch::Tensor meta_of(const train::SyncTargets& s, bool has_state, int64_t optimizer_steps) {
  return torch::tensor({s.state.step, s.state.cursor.epoch, s.state.cursor.position, s.state.samples,
                        static_cast<int64_t>(has_state), s.state.skipped_steps, s.state.skipped_in_a_row,
                        optimizer_steps, static_cast<int64_t>(s.state.owed.size())},
                       torch::kInt64);
}

void apply_meta(const torch::Tensor& meta, train::SyncTargets& s) {
  s.state.step = meta[0].item<int64_t>();
  s.state.cursor = {meta[1].item<int64_t>(), meta[2].item<int64_t>()};
  s.state.samples = meta[3].item<int64_t>();
  s.state.skipped_steps = meta[5].item<int64_t>();
  s.state.skipped_in_a_row = meta[6].item<int64_t>();
}

}  // namespace

int sync_state(comm::Collective& g, train::SyncTargets& s) {
  torch::NoGradGuard no_grad;
  const int source = newest_member(g, s.state.step);
  auto& opt = s.optimizer;
  auto meta = meta_of(s, opt.has_state(), opt.steps());
  g.broadcast(meta, source);
  g.broadcast(s.weights, source);
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
  sync_small_state(g, s, source, meta);
  apply_meta(meta, s);
  return source;
}

namespace {

// A range [lo, hi) of the flat parameters that a member holds at the
// step being synced: its weights (`w`) and/or its optimizer state (`st`).
struct Held {
  int64_t lo = 0, hi = 0;
  const float* w = nullptr;
  std::vector<const float*> st;
  // The state is in a checkpoint's shard files (a resume), read as sent.
  const train::DeferredShardState* disk = nullptr;
};

using Ranges = std::vector<std::pair<int64_t, int64_t>>;

// `r` minus every range in `minus`.
Ranges subtract(std::pair<int64_t, int64_t> r, Ranges minus) {
  std::sort(minus.begin(), minus.end());
  Ranges out;
  int64_t at = r.first;
  for (const auto& [a, b] : minus) {
    if (b <= at || a >= r.second) continue;
    if (a > at) out.push_back({at, std::min(a, r.second)});
    at = std::max(at, b);
    if (at >= r.second) break;
  }
  if (at < r.second) out.push_back({at, r.second});
  return out;
}

}  // namespace

ShardSync sync_sharded_state(comm::Collective& g, train::SyncTargets& s, AllReduceUpdate& rule, const Round& round) {
  torch::NoGradGuard no_grad;
  const auto t0 = std::chrono::steady_clock::now();
  const int64_t n = s.weights.numel();
  rule.plan_copies();
  // A commit cut short after this member counted its step: its homes are
  // finished from their logs first (elastic/full_shard.cc).
  rule.settle_logs(s.state.step);
  const int source = newest_member(g, s.state.step);
  auto& opt = s.optimizer;
  const int states = static_cast<int>(opt.state_names().size());
  const bool whole_state = opt.has_state() && opt.state()[0].numel() == n;
  int64_t steps = opt.steps();
  bool has_state = opt.has_state();
  // A resume left the state of this member's step in the checkpoint's
  // shard files (its update count is the optimizer's).
  const train::DeferredShardState* disk = rule.deferred_state();
  if (disk && (disk->step != s.state.step || disk->numel != n || disk->names.size() != static_cast<size_t>(states) ||
               disk->names != opt.state_names()))
    disk = nullptr;
  if (!whole_state && !rule.version_meta(s.state.step, &steps, &has_state) && disk) has_state = true;
  auto meta = meta_of(s, has_state, steps);
  g.broadcast(meta, source);
  const int64_t step = meta[0].item<int64_t>();
  has_state = meta[4].item<int64_t>() != 0;
  steps = meta[7].item<int64_t>();
  // Every member forgot its step (a fallback that found no checkpoint in
  // any member's run directory): nothing is left to train on from.
  if (step < 0)
    throw StateLostForGood("no member has a checkpoint to fall back to (train.checkpoint_every_steps and "
                           "train.checkpoint_every_epochs write one); the job cannot go on");

  // What this member holds at `step`: its homes' versions (its own, and
  // the homes of this host's members gone from the round: dead or frozen),
  // the whole weights when no all-gather has touched them since, the whole
  // state after a gather.
  if (!rule.home_prefix().empty())
    rule.adopt_dead(open_departed_homes(rule.home_prefix().substr(1), round.members));
  rule.settle_logs(step);
  rule.give_back_logs();  // settled: their values are in the versions now
  std::vector<Held> held;
  // With sharded weights (optim.shard_weights) a home's slot 0 holds its
  // shard's weights, and the weights are re-sharded into the new homes as
  // the state is, never whole on a member.
  const bool full = rule.shards_weights();
  const int first = rule.first_state_slot();
  for (ShardHome* h : rule.kept_homes()) {
    const int v = h->version_of(step);
    // A home with a log may hold a part (a sync retried after it gave the
    // weights back, or wrote them into a new home): each part on its own.
    const bool w = full && (h->logged() ? h->holds_weights(step) : v >= 0);
    const bool st = h->logged() ? h->holds_state(step) : v >= 0;
    if ((!w && !st) || h->n() != n || h->states() != states + first) continue;
    Held x{h->lo(), h->hi(), w ? h->state(0, 0) : nullptr, {}};
    if (has_state && st)
      for (int i = 0; i < states; ++i) x.st.push_back(h->state(v, i + first));
    held.push_back(std::move(x));
  }
  const int64_t ws = rule.whole_weights_step();
  const bool whole_weights = full ? rule.weights_whole() && s.state.step == step
                                  : (ws == step) || (ws == AllReduceUpdate::kWeightsUnknown && s.state.step == step);
  if (whole_weights) held.push_back({0, n, s.weights.data_ptr<float>(), {}});
  if (whole_state && s.state.step == step && has_state) {
    Held x{0, n, nullptr, {}};
    for (int i = 0; i < states; ++i) x.st.push_back(opt.state()[i].data_ptr<float>());
    held.push_back(std::move(x));
  }
  // Last: what is in memory anywhere is sent from there.
  if (disk && disk->step == step && has_state)
    held.push_back({0, n, nullptr, std::vector<const float*>(static_cast<size_t>(states), nullptr), disk});
  // Everyone's ranges, weights and state separately: [rank][slot] = (lo, hi).
  constexpr int kSlots = 32;
  if (held.size() > static_cast<size_t>(kSlots)) held.resize(kSlots);
  const int W = g.size();
  auto table = torch::full({2, W, kSlots, 2}, -1.0, torch::kFloat64);
  {
    auto t = table.accessor<double, 4>();
    int slot[2] = {0, 0};
    for (const auto& x : held) {
      if (x.w) { t[0][g.rank()][slot[0]][0] = x.lo; t[0][g.rank()][slot[0]++][1] = x.hi; }
      if (!x.st.empty()) { t[1][g.rank()][slot[1]][0] = x.lo; t[1][g.rank()][slot[1]++][1] = x.hi; }
    }
  }
  g.allreduce_max(table);
  auto t = table.accessor<double, 4>();
  // For kind k: the pieces this member sends (its ranges less those of lower
  // ranks and its own earlier ones), and whether the ranges cover [0, n).
  ShardSync out;
  auto plan = [&](int k, std::vector<std::pair<Ranges, const Held*>>* mine) {
    Ranges all, lower;
    for (int r = 0; r < W; ++r)
      for (int j = 0; j < kSlots && t[k][r][j][0] >= 0; ++j) {
        const std::pair<int64_t, int64_t> range{static_cast<int64_t>(t[k][r][j][0]), static_cast<int64_t>(t[k][r][j][1])};
        all.push_back(range);
        if (r < g.rank()) lower.push_back(range);
      }
    for (const auto& x : held) {
      if ((k == 0 && !x.w) || (k == 1 && x.st.empty())) continue;
      mine->push_back({subtract({x.lo, x.hi}, lower), &x});
      lower.push_back({x.lo, x.hi});
    }
    return subtract({0, n}, all).empty();
  };
  std::vector<std::pair<Ranges, const Held*>> send_w, send_s;
  const bool weights_ok = plan(0, &send_w);
  const bool state_ok = plan(1, &send_s) || !has_state || states == 0;
  if (!weights_ok || !state_ok)
    throw ShardsLost("the optimizer state of step " + std::to_string(step) + " is lost: no member holds " +
                     (weights_ok ? "every shard of the optimizer state" : "every shard of the weights") +
                     " (a shard and its copy were lost together)");

  // In pieces of 4 MiB (no member holds a second copy of the model or of
  // its state meanwhile). Every element comes from one member and is -0.0
  // elsewhere (x + -0.0 = x for every x, so a sum moves the bits unchanged).
  const int64_t piece = 1 << 20;
  auto buf = torch::empty({std::min(piece, std::max<int64_t>(n, 1))}, torch::kFloat32);
  float* f = buf.data_ptr<float>();
  // Fills buf with this member's pieces of [at, at + m) of one tensor.
  // (`tensor`: the state tensor's index, or -1 for the weights.)
  auto fill = [&](const std::vector<std::pair<Ranges, const Held*>>& send, int64_t at, int64_t m,
                  const std::function<const float*(const Held&)>& data, int tensor) {
    std::fill(f, f + m, -0.0f);
    for (const auto& [pieces, x] : send)
      for (const auto& [a, b] : pieces) {
        const int64_t lo = std::max(a, at), hi = std::min(b, at + m);
        if (hi <= lo) continue;
        if (x->disk)
          x->disk->read(static_cast<size_t>(tensor), lo, hi, f + (lo - at));
        else
          std::memcpy(f + (lo - at), data(*x) + (lo - x->lo), sizeof(float) * (hi - lo));
        out.bytes_sent += 4 * (hi - lo);
      }
  };
  // The weights, whole on everyone (sharded weights: into the new homes,
  // below).
  if (!full) {
    float* whole = s.weights.data_ptr<float>();
    for (int64_t at = 0; at < n; at += piece) {
      const int64_t m = std::min(piece, n - at);
      fill(send_w, at, m, [](const Held& x) { return x.w; }, -1);
      auto part = buf.narrow(0, 0, m);
      g.allreduce_sum(part);
      std::memcpy(whole + at, f, sizeof(float) * m);
    }
  }
  // The state: each member keeps only its new shard and the copies it
  // keeps for another host. On one host that is a reduce-scatter; across
  // hosts an all-reduce (what the groups across hosts reduce-scatter with).
  const auto& bounds = rule.bounds();
  const int64_t lo = bounds[g.rank()], hi = bounds[g.rank() + 1];
  std::vector<ShardHome*> homes{&rule.new_home(round.number, states + first)};
  for (ShardHome* c : rule.new_copy_homes(round.number, states + first)) homes.push_back(c);
  ShardHome& home = *homes[0];
  // One tensor (its pieces from `send`) into every new home's `slot`.
  auto reshard = [&](const std::vector<std::pair<Ranges, const Held*>>& send,
                     const std::function<const float*(const Held&)>& data, int slot) {
    for (int64_t at = 0; at < n; at += piece) {
      const int64_t m = std::min(piece, n - at);
      fill(send, at, m, data, slot - first);
      std::vector<int64_t> rel;
      for (int64_t b : bounds) rel.push_back(std::clamp(b, at, at + m) - at);
      auto part = buf.narrow(0, 0, m);
      if (rule.spans_hosts())
        g.allreduce_sum(part);
      else
        g.reduce_scatter_sum(part, rel);
      for (ShardHome* h : homes) {
        const int64_t a = std::max(h->lo(), at), e = std::min(h->hi(), at + m);
        if (e <= a) continue;
        std::memcpy(h->state(0, slot) + (a - h->lo()), f + (a - at), sizeof(float) * (e - a));
        out.bytes_received += 4 * (e - a);
      }
    }
  };
  if (full) {
    reshard(send_w, [](const Held& x) { return x.w; }, 0);
    // The new homes hold the weights (a retried sync reads them there):
    // this member's old homes give theirs back before the state comes.
    for (ShardHome* h : homes) h->commit_weights(step);
    rule.give_back_retired(ShardHome::kWeights);
    // So do the whole weights of a member that built the model (a joiner,
    // the first round): the new homes hold what they gave.
    rule.weights_resharded(step);
  }
  if (has_state)
    for (int i = 0; i < states; ++i) reshard(send_s, [i](const Held& x) { return x.st[i]; }, i + first);
  for (ShardHome* h : homes) h->commit(0, step, steps, has_state);
  rule.give_back_retired(ShardHome::kState);
  std::vector<torch::Tensor> views;
  if (has_state)
    for (int i = 0; i < states; ++i)
      views.push_back(torch::from_blob(home.state(0, i + first), {hi - lo}, torch::kFloat32));
  opt.set_state(std::move(views), steps);
  if (!full) rule.set_whole_weights_step(step);
  rule.set_deferred_state(nullptr);  // the homes hold the state now (or a newer step's)
  sync_small_state(g, s, source, meta);
  apply_meta(meta, s);
  out.source = source;
  out.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return out;
}

ElasticMembership::ElasticMembership(std::unique_ptr<Member> member,
                                     std::shared_ptr<AllReduceUpdate> rule,
                                     std::function<bool()> want_leave)
    : member_(std::move(member)), rule_(std::move(rule)), want_leave_(std::move(want_leave)) {
  rule_->set_member_id(member_->id());
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
      int source = 0;
      ShardSync shards;
      if (rule_->sharded()) {
        shards = sync_sharded_state(*group, s, *rule_, next);
        source = shards.source;
      } else {
        source = sync_state(*group, s);
      }
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
      if (s.pack_extra) e.event["front_end_state_moved"] = s.extra_moved;
      if (rule_->sharded()) {
        e.event["shard_bytes_sent"] = shards.bytes_sent;
        e.event["shard_bytes_received"] = shards.bytes_received;
        e.event["shard_sync_seconds"] = shards.seconds;
      }
      round_ = next;
      return e;
    } catch (const ShardsLost&) {
      // The trainer falls back to a checkpoint and re-forms: in a new
      // round (a round's group is formed once).
      member_->request_round(next.number);
      round_.number = next.number;
      throw;
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
