#include "elastic/allreduce_update.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>

#include "comm/shm_group.h"
#include "elastic/elastic_membership.h"
#include "common/error.h"

namespace limbo::elastic {

AllReduceUpdate::AllReduceUpdate(std::shared_ptr<comm::Collective> group,
                                 std::shared_ptr<train::OptimizerStep> optimizer, optim::FlatParams& flat,
                                 const ReduceOptions& opt)
    : group_(std::move(group)),
      opt_(std::move(optimizer)),
      flat_(flat),
      reducer_(flat, opt.bucket_bytes, opt.overlap, opt.compression, opt.shard_state, opt.unit_starts),
      loss_buf_(torch::zeros({1}, torch::kFloat64)),
      compression_(opt.compression),
      shard_(opt.shard_state),
      full_(opt.shard_weights),
      home_prefix_(opt.home_prefix),
      stats_(torch::zeros({2}, torch::kFloat32)) {
  paces_ = opt.paces;
  if (const char* d = std::getenv("LIMBO_TESTING_DIE_IN_COMMIT")) {  // ITERATION:WHERE:RANK:HOW:MARKER
    std::vector<std::string> f;
    std::string v = d;
    for (size_t at = 0, next; f.size() < 4 && (next = v.find(':', at)) != std::string::npos; at = next + 1)
      f.push_back(v.substr(at, next - at));
    if (f.size() == 4) {
      die_in_commit_.iteration = std::stoll(f[0]);
      die_in_commit_.where = f[1];
      die_in_commit_.rank = std::stoi(f[2]);
      die_in_commit_.freeze = f[3] == "stop";
      size_t at = 0;
      for (int i = 0; i < 4; ++i) at = v.find(':', at) + 1;
      die_in_commit_.marker = v.substr(at);
    }
  }
  reducer_.set_testing_death(opt.testing_die_in_bucket);
  if (opt.finish_in_backward) {
    reducer_.set_finish_in_backward(true);
    if (shard_) reducer_.set_after_finish([this] { shard_sum_ = own_shard_sum(); });
  }
  if (shard_ && opt.compression != comm::Compression::None)
    throw InvalidInput("optim.shard_state = true reduce-scatters a float32 gradient; set comm.compression = \"none\"");
  if (full_ && !shard_)
    throw InvalidInput("optim.shard_weights = true shards the weights with the optimizer state: set optim.shard_state = true");
  if (full_ && !flat_.lazy()) throw Error("internal: sharded weights need lazy flat buffers");
  if (full_)
    reducer_.set_reduce_in_hook([this](int64_t a, int64_t b) { bucket_reduced(a, b); }, &queue_,
                                [this](int64_t a, int64_t b) {  // the step fails: the bucket's pages go now
                                  flat_.release_grad(a, b);
                                  release_weights(a, b);
                                });
  if (group_) set_group(group_);
}

void AllReduceUpdate::set_group(std::shared_ptr<comm::Collective> group) {
  queue_.reset();  // no job handed over for the old group is left to run on the new one
  group_ = std::move(group);
  planned_ = false;
  gather_error_ = nullptr;
  commit_error_ = nullptr;  // the sync settles the logs it left
  // A new group re-shards the state (sync_sharded_state): a gather made
  // before it no longer holds, and a joiner has made none. Every member of
  // the group starts from none, so whether a gather runs never differs
  // between them.
  gathered_everywhere_ = -1;
  if (!shard_ || !group_) return;
  bounds_ = shard_bounds(flat_.numel(), group_->size());
  reducer_.set_shards(bounds_);
}

// A home named `base` (or `base`-<k>, the first name no kept home has: a
// round formed again after a failure has the same number), or unnamed.
std::unique_ptr<ShardHome> AllReduceUpdate::make_home(const std::string& base, int64_t lo, int64_t hi, int states) {
  std::string name;
  const auto kept = kept_homes();
  for (int k = 0; !home_prefix_.empty(); ++k) {
    const std::string tried = k == 0 ? base : base + "-" + std::to_string(k);
    bool taken = false;
    for (const auto* h : kept) taken = taken || h->name() == tried;
    if (!taken) {
      name = tried;
      break;
    }
  }
  return std::make_unique<ShardHome>(name, flat_.numel(), lo, hi, states, /*logged=*/full_);
}

namespace {
std::string home_base(const std::string& prefix, int64_t member, int64_t round) {
  return prefix + "m" + std::to_string(member) + "-r" + std::to_string(round);
}
}  // namespace

ShardHome& AllReduceUpdate::new_home(int64_t round, int states) {
  auto h = make_home(home_base(home_prefix_, member_id_, round), bounds_.at(group_->rank()),
                     bounds_.at(group_->rank() + 1), states);
  if (home_) retired_.push_back(std::move(home_));
  home_ = std::move(h);
  return *home_;
}

std::vector<ShardHome*> AllReduceUpdate::new_copy_homes(int64_t round, int states) {
  std::vector<std::unique_ptr<ShardHome>> made;
  for (int r : copy_ranks_)
    made.push_back(make_home(home_base(home_prefix_, member_id_, round) + "-c" + std::to_string(r), bounds_.at(r),
                             bounds_.at(r + 1), states));
  for (auto& c : copies_) retired_.push_back(std::move(c));
  copies_ = std::move(made);
  std::vector<ShardHome*> out;
  for (auto& c : copies_) out.push_back(c.get());
  return out;
}

void AllReduceUpdate::plan_copies() {
  planned_ = true;
  copy_ranks_.clear();
  hosts_ = 1;
  const int W = group_->size(), me = group_->rank();
  if (W == 1) return;
  // Every member's host: a 64-bit hash of its identity, in two halves.
  const uint64_t id = std::hash<std::string>{}(comm::host_identity());
  auto t = torch::zeros({W, 2}, torch::kFloat64);
  t[me][0] = static_cast<double>(id >> 32);
  t[me][1] = static_cast<double>(id & 0xffffffffu);
  group_->allreduce_max(t);
  auto a = t.accessor<double, 2>();
  std::vector<std::pair<double, double>> ids;
  std::vector<std::vector<int>> members;  // per host, numbered by lowest rank
  std::vector<int> host(W), local(W);
  for (int r = 0; r < W; ++r) {
    const std::pair<double, double> key{a[r][0], a[r][1]};
    const auto it = std::find(ids.begin(), ids.end(), key);
    host[r] = static_cast<int>(it - ids.begin());
    if (it == ids.end()) {
      ids.push_back(key);
      members.emplace_back();
    }
    local[r] = static_cast<int>(members[host[r]].size());
    members[host[r]].push_back(r);
  }
  hosts_ = static_cast<int>(members.size());
  if (hosts_ == 1) return;
  if (!group_->reduce_scatter_sums_everywhere())
    throw Error(std::string("internal: a group across hosts (") + group_->transport() +
                ") whose reduce-scatter leaves only each member's shard");
  for (int r = 0; r < W; ++r) {
    const auto& next = members[(host[r] + 1) % hosts_];
    if (next[local[r] % next.size()] == me) copy_ranks_.push_back(r);
  }
}

std::vector<ShardHome*> AllReduceUpdate::kept_homes() {
  std::vector<ShardHome*> out;
  if (home_) out.push_back(home_.get());
  for (auto& h : copies_) out.push_back(h.get());
  for (auto& h : retired_) out.push_back(h.get());
  return out;
}

void AllReduceUpdate::adopt_dead(std::vector<std::unique_ptr<ShardHome>> homes) {
  for (auto& h : homes) {
    bool known = false;
    for (auto* k : kept_homes()) known = known || k->name() == h->name();
    if (!known) retired_.push_back(std::move(h));
  }
}

bool AllReduceUpdate::version_meta(int64_t step, int64_t* optimizer_steps, bool* has_state) {
  const int v = home_ ? home_->version_of(step) : -1;
  if (v < 0) return false;
  *optimizer_steps = home_->optimizer_steps(v);
  *has_state = home_->has_state(v);
  return true;
}

// The home of this member's shard, and of the copies it keeps, hold
// committed step `step`; when not (a new group's first step when it is not
// elastic, or after a resume), they are made from the optimizer's whole
// state (or none).
void AllReduceUpdate::ensure_home(int64_t step) {
  if (commit_error_) {  // the homes hold the last step's log, not the step: the group re-forms first
    auto e = commit_error_;
    commit_error_ = nullptr;
    std::rethrow_exception(e);
  }
  if (!planned_) plan_copies();
  auto& opt = opt_->optimizer();
  const int first = first_state_slot();
  const int states = static_cast<int>(opt.state_names().size()) + first;
  auto fits = [&](const ShardHome* h, int r) {
    return h && h->version_of(step) >= 0 && h->lo() == bounds_[r] && h->hi() == bounds_[r + 1];
  };
  bool ok = fits(home_.get(), group_->rank()) && copies_.size() == copy_ranks_.size();
  for (size_t i = 0; ok && i < copies_.size(); ++i) ok = fits(copies_[i].get(), copy_ranks_[i]);
  if (ok) return;
  const int64_t n = flat_.numel();
  if (full_ && !weights_whole_)
    throw Error("internal: the weights are sharded and no home holds step " + std::to_string(step));
  if (opt.has_state() && opt.state()[0].numel() != n)
    throw Error("internal: the optimizer holds a shard of another layout and no home has step " + std::to_string(step));
  std::vector<ShardHome*> made{&new_home(0, states)};
  for (ShardHome* c : new_copy_homes(0, states)) made.push_back(c);
  for (ShardHome* h : made) {
    if (full_) std::memcpy(h->state(0, 0), flat_.data().data_ptr<float>() + h->lo(), sizeof(float) * h->size());
    if (opt.has_state())
      for (int i = first; i < states; ++i)
        std::memcpy(h->state(0, i), opt.state()[i - first].data_ptr<float>() + h->lo(), sizeof(float) * h->size());
    h->commit(0, step, opt.steps(), opt.has_state());
  }
}

void AllReduceUpdate::gather_state(optim::Optimizer& opt, int64_t step, bool here) {
  if (!shard_ || !group_) return;
  // Whether everyone takes part must not depend on this member's own state.
  auto flag = torch::tensor({here ? 1.0f : 0.0f, 1.0f});
  group_->allreduce_sum(flag);
  const bool everywhere = flag[0].item<float>() == flag[1].item<float>();
  // Sharded weights: whole on every member too (the checkpoint's weights,
  // the model the program holds after training); ready_weights() gives
  // them back before the next step.
  if (full_) gather_all_weights();
  if (full_ && flag[0].item<float>() == 0) return;  // the weights were what was asked for
  if (gathered_everywhere_ == step) return;
  ensure_home(step);
  const int v = home_->version_of(step);
  const int states = static_cast<int>(opt.state_names().size());
  const int64_t n = flat_.numel(), lo = home_->lo(), hi = home_->hi();
  if (!home_->has_state(v)) {
    opt.set_state({}, home_->optimizer_steps(v));
  } else {
    std::vector<torch::Tensor> whole;
    if (here)
      for (int i = 0; i < states; ++i) whole.push_back(torch::empty({n}, torch::kFloat32));
    const int64_t piece = 1 << 20;  // floats
    auto buf = torch::empty({std::min(piece, n)}, torch::kFloat32);
    float* b = buf.data_ptr<float>();
    for (int i = 0; i < states; ++i)
      for (int64_t at = 0; at < n; at += piece) {
        const int64_t m = std::min(piece, n - at);
        auto part = buf.narrow(0, 0, m);
        part.fill_(-0.0f);
        const int64_t a = std::max(at, lo), e = std::min(at + m, hi);
        if (e > a) std::memcpy(b + (a - at), home_->state(v, i + first_state_slot()) + (a - lo), sizeof(float) * (e - a));
        group_->allreduce_sum(part);
        if (here) std::memcpy(whole[i].data_ptr<float>() + at, b, sizeof(float) * m);
      }
    if (here) opt.set_state(std::move(whole), home_->optimizer_steps(v));
  }
  if (everywhere) gathered_everywhere_ = step;
}

void AllReduceUpdate::scale_momentum(optim::Optimizer& opt, double factor, int64_t step) {
  if (!shard_ || !home_) return opt.scale_momentum(factor);  // the replicated path
  // The optimizer holds views of this member's home after a sync (the
  // whole range in a group of one), or a gathered whole state of its own.
  const float* held = opt.has_state() ? opt.state()[0].data_ptr<float>() : nullptr;
  const int first = first_state_slot();
  const bool views = held && home_->states() > first && (held == home_->state(0, first) || held == home_->state(1, first));
  if (views) opt.set_state({}, factor == 0 ? 0 : opt.steps());  // scaled through the home below
  else if (held) opt.scale_momentum(factor);
  std::vector<ShardHome*> mine;
  if (home_) mine.push_back(home_.get());
  for (auto& c : copies_) mine.push_back(c.get());
  const int slot = opt.momentum_index() + first;
  for (ShardHome* h : mine) {
    const int v = h->version_of(step);
    if (v < 0 || !h->has_state(v)) continue;
    if (factor == 0) {
      h->commit(v, step, 0, false);  // no state: the next update starts afresh
      continue;
    }
    if (slot >= h->states()) continue;
    torch::from_blob(h->state(v, slot), {h->size()}, torch::kFloat32).mul_(factor);
  }
}

void AllReduceUpdate::release_state(optim::Optimizer& opt, int64_t step) {
  if (!shard_ || !home_ || gathered_everywhere_ == step || !opt.has_state() || opt.state()[0].numel() == home_->size())
    return;
  const int v = home_->version_of(step);
  if (v < 0 || !home_->has_state(v)) return;
  std::vector<torch::Tensor> views;
  for (int i = first_state_slot(); i < home_->states(); ++i)
    views.push_back(torch::from_blob(home_->state(v, i), {home_->size()}, torch::kFloat32));
  opt.set_state(std::move(views), home_->optimizer_steps(v));
}

void AllReduceUpdate::start(torch::Tensor& weights, torch::Tensor& buffers) {
  if (!group_) return;  // elastic training syncs in establish()
  group_->broadcast(weights, 0);
  broadcast_frozen();
  if (buffers.numel() > 0) {
    flat_.buffers_to_flat();
    group_->broadcast(buffers, 0);
    flat_.flat_to_buffers();
  }
}

// Frozen parameters too (a frozen layer left unseeded differs between
// members otherwise), as DDP does when it starts.
void AllReduceUpdate::broadcast_frozen() {
  for (const auto& f : flat_.frozen_parameters())
    if (f.scalar_type() == torch::kFloat32 && f.is_contiguous()) {
      torch::NoGradGuard no_grad;
      auto t = f;
      group_->broadcast(t, 0);
    }
}

void AllReduceUpdate::start_resumed(train::SyncTargets& s) {
  if (!group_) return;
  sync_state(*group_, s);  // from member 0: the newest step (ties: the lowest rank)
  broadcast_frozen();
}

// ISGD's extra passes: not bucketed, not overlapped, float32.
double AllReduceUpdate::reduce(torch::Tensor* grad, double loss) {
  torch::NoGradGuard no_grad;
  const double share = share_;
  if (grad) {
    grad->mul_(share);
    group_->allreduce_sum(*grad);
  }
  loss_buf_.fill_(loss * share);
  group_->allreduce_sum(loss_buf_);
  return loss_buf_.item<double>();
}

void AllReduceUpdate::sum(torch::Tensor& t, int key) {
  auto& enc = sum_encoders_[key];
  if (!enc && compression_ != comm::Compression::None) enc = std::make_unique<comm::Compressor>(compression_);
  last_payload_ = comm::sum_encoded(*group_, t, enc.get());
}

void AllReduceUpdate::sum_committed(int key) {
  const auto it = sum_encoders_.find(key);
  if (it != sum_encoders_.end() && it->second) it->second->commit();
}

// Each home's next version starts as a copy of the committed one (zeros
// before the first update, as the replicated outer_update_slice starts), and
// only its part of [lo, hi) is updated, in place, from those values: the
// replicated update's arithmetic, element for element.
bool AllReduceUpdate::update_fragment(torch::Tensor& w, const torch::Tensor& g, int64_t lo, int64_t hi, double lr,
                                      int64_t k, bool skip) {
  if (!shard_) return false;
  torch::NoGradGuard no_grad;
  const auto t_update = std::chrono::steady_clock::now();
  drop_retired();  // the sum came from every member: each finished the state sync
  ensure_home(k);
  std::vector<ShardHome*> homes{home_.get()};
  for (auto& c : copies_) homes.push_back(c.get());
  auto& opt = opt_->optimizer();
  const int states = home_->states();
  auto out = w.clone();  // every part but this member's is overwritten by the all-gather
  const int64_t steps = home_->optimizer_steps(home_->version_of(k)) + (skip ? 0 : 1);
  const bool has_state = home_->has_state(home_->version_of(k)) || (!skip && states > 0);
  for (ShardHome* x : homes) {
    const int cur = x->version_of(k), next = 1 - cur;
    x->begin(next);
    if (states > 0) {
      if (x->has_state(cur)) std::memcpy(x->state(next, 0), x->state(cur, 0), static_cast<size_t>(x->version_bytes()));
      else std::memset(x->state(next, 0), 0, static_cast<size_t>(x->version_bytes()));
    }
    const int64_t a = std::max(lo, x->lo()), e = std::min(hi, x->hi());
    if (!skip && e > a) {
      std::vector<const float*> in;
      std::vector<float*> st;
      for (int i = 0; i < states; ++i) {
        in.push_back(x->state(next, i) + (a - x->lo()));
        st.push_back(x->state(next, i) + (a - x->lo()));
      }
      opt.set_state({}, x->optimizer_steps(cur));
      opt.step_into(w.data_ptr<float>() + (a - lo), out.data_ptr<float>() + (a - lo), g.data_ptr<float>() + (a - lo),
                    in, st, e - a, lr);
    }
    x->commit(next, k + 1, steps, has_state);
  }
  std::vector<torch::Tensor> views;
  if (has_state)
    for (int i = 0; i < states; ++i)
      views.push_back(torch::from_blob(home_->state(home_->version_of(k + 1), i), {home_->size()}, torch::kFloat32));
  opt.set_state(std::move(views), steps);
  const auto t_gather = std::chrono::steady_clock::now();
  std::vector<int64_t> parts;
  for (int64_t b : bounds_) parts.push_back(std::clamp(b, lo, hi) - lo);
  group_->all_gather(out, parts);
  w.copy_(out);
  weights_step_ = k + 1;
  const auto t_end = std::chrono::steady_clock::now();
  update_seconds_ += std::chrono::duration<double>(t_gather - t_update).count();
  gather_seconds_ += std::chrono::duration<double>(t_end - t_gather).count();
  updates_ += 1;
  return true;
}

void AllReduceUpdate::backward_starts(train::StepContext& ctx) {
  share_ = ctx.global_batch > 0 ? static_cast<double>(ctx.batch_size) / ctx.global_batch : 0.0;
  reducer_.begin(group_, share_, ctx.loss, flag_source_);
}

train::StepResult AllReduceUpdate::apply(train::StepContext& ctx) {
  // Gradient, float buffers, loss and flag in one pass of buckets; the loss
  // and flag ride in the spare slots after the gradient (a separate tiny
  // all-reduce costs a full round trip).
  if (gather_error_) {  // a unit's gather failed in forward or backward: the step fails with it
    auto e = gather_error_;
    gather_error_ = nullptr;
    try {
      if (reducer_.finished())
        reducer_.take_finished();
      else if (reducer_.armed())  // the CLI's steps finish the reduction here: it ends (failing) with the step
        reducer_.finish(0.0);
    } catch (...) {
    }
    std::rethrow_exception(e);
  }
  if (reducer_.finished()) {
    reducer_.take_finished();  // at the end of backward (finish_in_backward): its failure, if any
  } else {
    if (!reducer_.armed()) backward_starts(ctx);
    reducer_.finish(flag_source_ ? flag_source_() : 0.0);
  }
  last_payload_ = reducer_.last_payload_bytes();
  auto& buf = ctx.grad_with_slot;
  const int64_t n = buf.numel() - optim::FlatParams::kSlots;
  const double global_loss = buf[n].item<double>();
  flag_sum_ = buf[n + 1].item<double>();
  publish_paces(ctx.iteration);
  if (shard_) {
    // The gradient's sum came from every member: each finished the state
    // sync before this step, so the homes kept for a retried sync can go.
    drop_retired();
    return apply_shard(ctx, global_loss);
  }
  if (!reducer_.finite()) return {global_loss, ctx.global_batch, /*skipped=*/true};
  if (ctx.before_update) ctx.before_update(global_loss);
  const auto t0 = std::chrono::steady_clock::now();
  opt_->apply(ctx.weights, ctx.grad, ctx.lr);
  update_seconds_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  updates_ += 1;
  return {global_loss, ctx.global_batch};
}

void AllReduceUpdate::publish_paces(int64_t step) {
  if (!paces_ || !group_ || !paces_->publishes(step)) return;
  auto mine = paces_->publication(group_->rank());
  auto sum = torch::from_blob(mine.data(), {static_cast<int64_t>(mine.size())}, torch::kFloat32);
  group_->allreduce_sum(sum);
  paces_->agreed(step, mine);
}

// The update of the shard of home `h` (this member's, or a copy) from
// committed step `step` into its other version, the gradient scaled by
// `coef`; its new weights go into the gradient's place (each element is
// read before it is written). False when a value came out non-finite.
bool AllReduceUpdate::update_into(ShardHome& h, int64_t step, float coef, train::StepContext& ctx) {
  const int cur = h.version_of(step), next = 1 - cur;
  auto g = ctx.grad.narrow(0, h.lo(), h.size());
  if (coef < 1.0f) g.mul_(coef);
  std::vector<const float*> in;
  std::vector<float*> out;
  for (int i = first_state_slot(); i < h.states(); ++i) {
    out.push_back(h.state(next, i));
    if (h.has_state(cur)) in.push_back(h.state(cur, i));
  }
  auto& opt = opt_->optimizer();
  opt.set_state({}, h.optimizer_steps(cur));
  // From the whole weights into the gradient's place (sharded weights
  // update their homes in place: apply_logged).
  return opt.step_into(ctx.weights.data_ptr<float>() + h.lo(), g.data_ptr<float>(), g.data_ptr<float>(), in, out,
                       h.size(), ctx.lr);
}

// This member's shard (and the copies it keeps): agree on finiteness and
// the norm (one small all-reduce), clip, update into the homes' other
// versions, commit them, all-gather the weights.
double AllReduceUpdate::own_shard_sum() const {
  if (!group_ || bounds_.empty()) return std::nan("");
  const int me = group_->rank();
  const int64_t lo = bounds_.at(me), hi = bounds_.at(me + 1);
  return hi > lo ? flat_.grad().narrow(0, lo, hi - lo).sum().item<double>() : 0.0;
}

train::StepResult AllReduceUpdate::apply_shard(train::StepContext& ctx, double global_loss) {
  torch::NoGradGuard no_grad;
  // Between a backward that reduced and the step, `.grad` holds the group's
  // sum only in this member's shard (reduce-scatter): a change made there
  // by hand (clipping, masking) would act on a part of the gradient, with a
  // factor that differs between members and between a shard and its copy.
  if (!std::isnan(shard_sum_)) {
    const double before = shard_sum_;
    shard_sum_ = std::nan("");
    const double now = own_shard_sum();
    if (!(now == before) && !(std::isnan(now) && std::isnan(before)))
      throw InvalidInput("the gradient changed between backward and the step (clipping by hand?) while the "
                         "optimizer state is sharded (limbo.Optimizer(shard_state=True)): `.grad` then holds "
                         "the group's gradient only in this member's shard; clip with limbo.Job(clip_grad_norm=), "
                         "or shard_state=False");
  }
  const int64_t k = ctx.iteration;
  ensure_home(k);
  ShardHome& h = *home_;
  std::vector<ShardHome*> homes{&h};
  for (auto& c : copies_) homes.push_back(c.get());
  const int cur = h.version_of(k);
  const int64_t m = h.size();
  auto& opt = opt_->optimizer();
  const int first = first_state_slot();
  const int states = h.states() - first;  // of the optimizer
  const bool clip = opt_->clip_norm() > 0;
  if (!full_)
    for (ShardHome* x : homes) x->begin(1 - x->version_of(k));
  // Clipping needs the global norm before the update: the shards' squared
  // norms are summed (a square that is not finite makes the sum so).
  // Without clipping the update runs first, into the next version (nothing
  // committed is touched), and reports whether its gradient was finite.
  float* st = stats_.data_ptr<float>();
  st[0] = st[1] = 0.0f;
  if (clip && m > 0) st[1] = static_cast<float>(ctx.grad.narrow(0, h.lo(), m).square().sum().item<double>());
  // Sharded weights are updated in place, after the logs: whether every
  // shard of the gradient is finite is agreed first (the norm's sum does it
  // when clipping).
  if (full_ && !clip && m > 0) st[1] = std::isfinite(own_shard_sum()) ? 0.0f : 1.0f;
  const auto t_update = std::chrono::steady_clock::now();
  float coef = 1.0f;
  if (full_ && !clip) {
    group_->allreduce_sum(stats_);
    if (st[1] != 0.0f) st[0] = 1.0f;
  }
  if (clip) {
    group_->allreduce_sum(stats_);
    const double norm = std::sqrt(static_cast<double>(st[1]));
    opt_->set_last_norm(norm);
    coef = static_cast<float>(opt_->clip_norm()) / (static_cast<float>(norm) + 1e-6f);
    if (!std::isfinite(norm)) st[0] = 1.0f;
  }
  bool finite = reducer_.finite() && st[0] == 0;
  if (full_) return apply_logged(ctx, global_loss, homes, coef, finite);
  if (finite) {
    bool mine = true;
    for (ShardHome* x : homes) mine = update_into(*x, k, coef, ctx) && mine;
    if (!clip) {  // every member's verdict on its own shard
      st[0] = mine ? 0.0f : 1.0f;
      group_->allreduce_sum(stats_);
      finite = st[0] == 0;
    }
  }
  auto views_of = [&](int v, bool has) {
    std::vector<torch::Tensor> views;
    if (has)
      for (int i = 0; i < states; ++i) views.push_back(torch::from_blob(h.state(v, i + first), {m}, torch::kFloat32));
    return views;
  };
  if (!finite) {  // skipped everywhere: the next versions repeat these
    for (ShardHome* x : homes) {
      const int c = x->version_of(k);
      if (x->states() > 0) std::memcpy(x->state(1 - c, 0), x->state(c, 0), static_cast<size_t>(x->version_bytes()));
      x->commit(1 - c, k + 1, x->optimizer_steps(c), x->has_state(c));
    }
    opt.set_state(views_of(1 - cur, h.has_state(cur)), h.optimizer_steps(cur));
    return {global_loss, ctx.global_batch, /*skipped=*/true};
  }
  if (ctx.before_update) ctx.before_update(global_loss);
  const int64_t steps = opt.steps();
  for (ShardHome* x : homes) x->commit(1 - x->version_of(k), k + 1, steps, states > 0);
  // The optimizer's state is this shard's (views of the home).
  opt.set_state(views_of(1 - cur, states > 0), steps);
  const auto t_gather = std::chrono::steady_clock::now();
  // The whole weights change only once every shard is here: until then a
  // failure leaves them at step k on this member.
  group_->all_gather(ctx.grad, bounds_);
  ctx.weights.copy_(ctx.grad);
  weights_step_ = k + 1;
  const auto t_end = std::chrono::steady_clock::now();
  update_seconds_ += std::chrono::duration<double>(t_gather - t_update).count();
  gather_seconds_ += std::chrono::duration<double>(t_end - t_gather).count();
  updates_ += 1;
  return {global_loss, ctx.global_batch};
}

void AllReduceUpdate::testing_drop_kept_state() {
  for (auto* h : kept_homes()) h->unlink();
}

void AllReduceUpdate::drop_retired() {
  for (auto& h : retired_) h->unlink();
  retired_.clear();
}

nlohmann::json AllReduceUpdate::summary() const {
  const auto& st = reducer_.stats();
  const double steps = std::max<int64_t>(st.steps, 1);
  nlohmann::json out = {{"buckets", reducer_.buckets().size()},
          {"overlap", reducer_.overlapped()},
          {"buckets_started_in_backward", st.buckets_started_in_backward},
          {"exposed_communication_ms_per_step", 1000.0 * st.exposed_seconds / steps}};
  // The optimizer's step (sharded: this member's shard, with its share of
  // clipping), and the weights' all-gather after it.
  if (updates_ > 0) out["update_ms_per_step"] = 1000.0 * update_seconds_ / updates_;
  if (shard_ && updates_ > 0) out["all_gather_ms_per_step"] = 1000.0 * gather_seconds_ / updates_;
  return out;
}

}  // namespace limbo::elastic
