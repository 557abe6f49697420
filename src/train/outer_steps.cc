#include "train/outer_steps.h"

#include <algorithm>
#include <cmath>
#include <exception>
#include <thread>
#include <string>

#include "common/error.h"
#include "common/log.h"

namespace limbo::train {

namespace {

// Each plan rank's fraction of the plan's samples.
std::vector<double> fractions_of(const OuterPlan& p) {
  std::vector<double> out;
  const double total = static_cast<double>(std::max<int64_t>(1, p.offsets.back()));
  for (int r = 0; r < p.world; ++r) out.push_back(std::round(1e4 * static_cast<double>(p.share(r)) / total) / 1e4);
  return out;
}

}  // namespace

OuterSteps::OuterSteps(Session& session, optim::FlatParams& flat, std::shared_ptr<UpdateRule> rule,
                       std::shared_ptr<OptimizerStep> outer, Options opt)
    : s_(session),
      flat_(flat),
      rule_(std::move(rule)),
      outer_(std::move(outer)),
      opt_(std::move(opt)),
      sampler_(opt_.samples, opt_.order, opt_.seed) {
  fragments_ = cut_fragments(flat_, opt_.diloco.fragments);
  since_sync_.assign(fragments_.size(), 0);
  if (streaming() && !outer_) throw Error("internal: streaming DiLoCo without its outer optimizer");
}

bool OuterSteps::agree_on_redo() {
  const bool pending = inner_done_ && plan_step_ == s_.state().step;
  // Streaming's local weights hold work on top of committed step
  // local_step_; a state that fell back to a checkpoint (or moved on
  // without this member) is not the one they grew from.
  if (streaming() && !pending && s_.state().step != local_step_) forget_local();
  if (!pending) {  // none, or stale: its step committed elsewhere, or the state fell back
    inner_done_ = false;
    plan_step_ = -1;
  }
  auto any = torch::tensor({pending ? 1.0 : 0.0, pending ? static_cast<double>(plan_.world) : 0.0},
                          torch::kFloat64);
  rule_->agree_max(any);
  redo_offsets_.clear();
  if (opt_.diloco.pace && any[0].item<double>() > 0) {
    // A redone step keeps the shares its planners dealt: they travel to
    // every member (a joiner, one whose work was stale), which settle
    // the step by them.
    const auto world = static_cast<int64_t>(any[1].item<double>());
    auto offsets = torch::full({world + 1}, -1.0, torch::kFloat64);
    if (pending)
      for (int64_t r = 0; r <= world; ++r) offsets[r] = static_cast<double>(plan_.offsets[static_cast<size_t>(r)]);
    rule_->agree_max(offsets);
    for (int64_t r = 0; r <= world; ++r) redo_offsets_.push_back(static_cast<int64_t>(offsets[r].item<double>()));
  }
  if (pending) {
    outer_redone += 1;
    redo_ = true;
  } else if (any[0].item<double>() > 0) {
    // Others redo an outer step: this member takes part with no samples.
    start_work(-1, /*done=*/true);
    redo_ = true;
    delta_ = torch::Tensor();  // none: zeros of what is synced (finish)
    local_buffers_.clear();
  }
  return any[0].item<double>() > 0;
}

OuterPlan OuterSteps::plan_for(data::Cursor cursor, const PositionRanges& owed, int world, bool this_step) const {
  const bool paced = opt_.diloco.pace && static_cast<int>(pace_shares_.size()) == world;
  OuterPlan p = plan_outer(cursor, owed, opt_.samples, opt_.batch * opt_.diloco.unit_steps(), world,
                           paced ? share_weights(pace_shares_) : std::vector<int64_t>{});
  if (this_step && static_cast<int>(redo_offsets_.size()) == world + 1 &&
      redo_offsets_.back() == static_cast<int64_t>(p.positions.size()))
    p.offsets = redo_offsets_;
  return p;
}

void OuterSteps::take_paces(const std::vector<double>& per_sample, int plan_world) {
  if (!opt_.diloco.pace || plan_world != s_.world()) return;
  per_sample_ = per_sample;
  pace_shares_ = pace_shares(pace_shares_, per_sample);
}

void OuterSteps::plan_new() {
  const auto& st = s_.state();
  redo_offsets_.clear();
  plan_ = plan_for(st.cursor, st.owed, s_.world(), /*this_step=*/false);
  start_work(s_.rank(), /*done=*/false);
  redo_ = false;
  global_ = flat_.data().clone();
}

void OuterSteps::forget_local() {
  if (ahead_) {
    ahead_undone += ahead_->inner_steps;
    ahead_.reset();
  }
  local_ = torch::Tensor();
  since_sync_.assign(fragments_.size(), 0);
  local_step_ = s_.state().step;
}

void OuterSteps::start_work(int plan_rank, bool done) {
  plan_step_ = s_.state().step;
  // The committed buffers (as every member holds them before its inner
  // steps): where a plain outer step that is skipped leaves them.
  unit_buffers_.clear();
  if (!streaming() && !flat_.buffer_entries().empty()) unit_buffers_ = flat_.save_buffers();
  plan_rank_ = plan_rank;
  inner_done_ = done;
  consumed_ = 0;
  trained_.clear();
  loss_sum_ = 0;
  inner_steps_ = 0;
  inner_compute_ = inner_wall_ = 0;
  began_ = Clock::now();
}

nlohmann::json OuterSteps::record(const Committed& c, double epoch, int workers) const {
  nlohmann::json j = {{"kind", "outer"},
                      {"step", s_.state().step},
                      {"epoch", epoch},
                      {"samples", c.res.global_batch},
                      {"loss", c.res.loss},
                      {"skipped", c.res.skipped},
                      {"inner_steps", c.inner_steps},
                      {"owed", range_total(s_.state().owed)},
                      {"pseudo_gradient_norm", c.delta_norm},
                      {"compute_seconds", c.compute_seconds},
                      {"wall_seconds", c.wall_seconds},
                      {"sync_seconds", c.sync_seconds},
                      {"compute_share", c.wall_seconds > 0 ? c.compute_seconds / c.wall_seconds : 0.0},
                      {"payload_bytes", c.payload_bytes},
                      {"fragment", c.fragment},
                      {"workers", workers}};
  if (!c.shares.empty()) {
    j["shares"] = c.shares;
    nlohmann::json paces = nlohmann::json::array();  // samples a second, by group rank (0: not measured)
    for (double s : per_sample_) paces.push_back(s > 0 ? std::round(10.0 / s) / 10.0 : 0.0);
    j["paces"] = paces;
  }
  return j;
}

nlohmann::json OuterSteps::summary() const {
  return {{"outer_steps", s_.state().step},
          {"inner_steps", inner_steps_total},
          {"inner_steps_skipped", inner_skipped},
          {"outer_steps_redone", outer_redone},
          {"outer_steps_stopped_early", stopped_early},
          {"compute_share", wall_seconds > 0 ? compute_seconds / wall_seconds : 0.0},
          {"compute_seconds", compute_seconds},
          {"outer_sync_seconds", sync_seconds},
          {"pseudo_gradient_bytes", payload_bytes},
          {"fragments", static_cast<int64_t>(fragments_.size())},
          {"inner_steps_overlapped", overlapped_steps},
          {"inner_steps_undone", ahead_undone}};
}

std::optional<OuterSteps::Work> OuterSteps::begin() {
  if (reformed_) {
    reformed_ = false;
    const auto t0 = Clock::now();
    try {
      agree_on_redo();
    } catch (const Error& e) {
      if (!s_.elastic() || !recoverable(e)) throw;
      log_warn("agreeing on outer step " + std::to_string(s_.state().step + 1) + " failed: " + e.what());
      s_.reform(std::string("failure: ") + e.what(), t0, seconds_since(t0));
      return std::nullopt;
    }
  }
  Work w;
  if (plan_step_ != s_.state().step) plan_new();
  if (inner_done_) return w;  // a redo: straight to finish()
  // The bounded wait: what the fastest member took for a whole share, and
  // max_wait times that again (docs/diloco.md).
  // Alone, no member waits on it: no bound (a busy machine would cut a
  // lone member's share short against its own earlier pace).
  bound_ = opt_.diloco.max_wait > 0 && fastest_per_sample_ > 0 && s_.world() > 1
               ? (1 + opt_.diloco.max_wait) * fastest_per_sample_ *
                     static_cast<double>(opt_.batch * opt_.diloco.unit_steps())
               : -1;
  // With shares by pace every member is expected to end together: the
  // wait is bounded from the earliest expected end (its share at its pace).
  if (bound_ > 0 && static_cast<int>(per_sample_.size()) == plan_.world && plan_.world == s_.world() &&
      static_cast<int>(pace_shares_.size()) == plan_.world) {
    double earliest = -1;
    for (int p = 0; p < plan_.world; ++p) {
      const double t = per_sample_[static_cast<size_t>(p)] * static_cast<double>(plan_.share(p));
      if (t > 0 && (earliest < 0 || t < earliest)) earliest = t;
    }
    if (earliest > 0) bound_ = (1 + opt_.diloco.max_wait) * earliest;
  }
  inner_start_ = Clock::now();
  w = work_of(plan_, plan_rank_, 0);
  if (ahead_) {
    // Inner steps run ahead of the last sync count only when this is the
    // unit they were planned as.
    const Ahead& a = *ahead_;
    if (a.step == s_.state().step && a.rank == plan_rank_ && a.plan.world == plan_.world &&
        a.plan.positions == plan_.positions && a.plan.offsets == plan_.offsets) {
      consumed_ = a.consumed;
      trained_ = a.ids;
      loss_sum_ = a.loss_sum;
      inner_steps_ = a.inner_steps;
      inner_skipped += a.skipped;
      inner_start_ -= std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(a.wall));
      const int64_t k = std::min<int64_t>(a.batches, static_cast<int64_t>(w.batches.size()));
      w.batches.erase(w.batches.begin(), w.batches.begin() + k);
      w.first = k;
    } else {
      undo_ahead();
    }
    ahead_.reset();
  }
  if (streaming()) swap_in_local();
  return w;
}

OuterSteps::Work OuterSteps::work_of(const OuterPlan& plan, int p, int64_t from) const {
  Work w;
  w.epoch = plan.epoch;
  w.first = from;
  const auto& order = const_cast<data::Sampler&>(sampler_).epoch_order(plan.epoch);
  const int64_t lo = plan.offsets[p], hi = plan.offsets[p + 1];
  for (int64_t at = lo + from * opt_.batch; at < hi; at += opt_.batch) {
    std::vector<int64_t> ids;
    for (int64_t k = at; k < std::min(at + opt_.batch, hi); ++k) ids.push_back(order[plan.positions[k]]);
    w.batches.push_back(std::move(ids));
  }
  return w;
}

void OuterSteps::swap_in_local() {
  if (local_.defined()) flat_.data().copy_(local_);
}

void OuterSteps::undo_ahead() {
  if (!ahead_) return;
  local_ = ahead_->local_before;
  if (!ahead_->buffers_before.empty()) flat_.restore_buffers(ahead_->buffers_before);
  if (inner_opt_) inner_opt_->restore(ahead_->inner_before);
  ahead_undone += ahead_->inner_steps;
  ahead_.reset();
}

bool OuterSteps::keep_going() {
  // At least one inner step a member (an outer step always has samples).
  if (running_ahead_ || bound_ <= 0 || consumed_ == 0 || seconds_since(inner_start_) <= bound_) return true;
  const int64_t share = plan_rank_ >= 0 ? plan_.share(plan_rank_) : 0;
  if (consumed_ < share) {
    log_info("outer step " + std::to_string(s_.state().step + 1) + ": stopped after " + std::to_string(consumed_) +
             " of " + std::to_string(share) + " samples (the bounded wait, " + std::to_string(bound_) +
             " s); the rest are dealt again");
    stopped_early += 1;
  }
  bound_ = -1;  // said once; the front end stops here
  return false;
}

double OuterSteps::inner_epoch(int64_t i) const {
  const int64_t n = opt_.samples;
  const OuterPlan& plan = running_ahead_ ? ahead_->plan : plan_;
  const int64_t at = running_ahead_ ? ahead_->cursor_position : s_.state().cursor.position;
  return static_cast<double>(plan.epoch) +
         static_cast<double>(std::min(at, n) + i * opt_.batch * plan.world) / static_cast<double>(n);
}

int64_t OuterSteps::inner_iteration(int64_t i) const {
  return (s_.state().step + (running_ahead_ ? 1 : 0)) * opt_.diloco.unit_steps() + i;
}

void OuterSteps::inner_step_done(const std::vector<int64_t>& ids, double loss, bool applied, double compute) {
  const auto samples = static_cast<int64_t>(ids.size());
  if (running_ahead_) {  // the next unit's, counted when it begins as planned
    Ahead& a = *ahead_;
    a.ids.insert(a.ids.end(), ids.begin(), ids.end());
    if (applied) a.loss_sum += loss * static_cast<double>(samples);
    else a.skipped += 1;
    a.consumed += samples;
    a.inner_steps += 1;
    a.batches += 1;
    a.compute += compute;
    inner_compute_ += compute;  // computed during this unit's wall time
    overlapped_steps += 1;
    return;
  }
  if (applied) loss_sum_ += loss * static_cast<double>(samples);
  else inner_skipped += 1;  // the samples count as seen (as a skipped step's)
  consumed_ += samples;
  trained_.insert(trained_.end(), ids.begin(), ids.end());
  inner_steps_ += 1;
  inner_compute_ += compute;
}

std::optional<OuterSteps::Agreed> OuterSteps::agree(double weight) {
  // Each member's row (the others stay at their floor; the maximum takes
  // the owner's): plan rank, samples processed, the plan's world, their
  // loss sum, minus its seconds a sample (the maximum is the fastest), its
  // membership-change flag, and its weight in the fragment's average.
  const auto sync_start = Clock::now();
  const int W = s_.world();
  constexpr double kNone = -1e300;
  // Streaming with buffers: each member's buffers ride in its row too.
  const bool with_buffers = streaming() && !flat_.buffer_entries().empty();
  const torch::Tensor mine = with_buffers ? buffer_row(flat_) : torch::Tensor();
  const int64_t B = with_buffers ? mine.numel() : 0;
  auto rows = torch::full({W, 7 + B}, -1.0, torch::kFloat64);
  rows.select(1, 4).fill_(kNone);
  if (with_buffers) {
    rows.narrow(1, 7, B).fill_(kNone);
    rows[s_.rank()].narrow(0, 7, B).copy_(mine);
    agreed_buffers_ = flat_.save_buffers();
  }
  {
    auto a = rows.accessor<double, 2>();
    const int me = s_.rank();
    a[me][0] = plan_rank_;
    a[me][1] = static_cast<double>(consumed_);
    a[me][2] = plan_rank_ >= 0 ? plan_.world : -1;
    a[me][3] = loss_sum_;
    if (consumed_ > 0 && !redo_) a[me][4] = -inner_wall_ / static_cast<double>(consumed_);
    a[me][5] = streaming() ? rule_->change_flag() : 0.0;
    a[me][6] = weight;
  }
  try {
    rule_->agree_max(rows);
  } catch (const Error& e) {
    if (!s_.elastic() || !recoverable(e)) throw;
    log_warn("the agreement of outer step " + std::to_string(s_.state().step + 1) + " failed: " + e.what());
    s_.reform(std::string("failure: ") + e.what(), sync_start, seconds_since(sync_start));
    return std::nullopt;
  }
  Agreed g;
  double fastest = kNone;
  auto a = rows.accessor<double, 2>();
  for (int m = 0; m < W; ++m) {
    g.plan_world = std::max(g.plan_world, static_cast<int>(a[m][2]));
    fastest = std::max(fastest, a[m][4]);
    g.flag += std::max(0.0, a[m][5]);
    g.weight_total += std::max(0.0, a[m][6]);
  }
  if (g.plan_world <= 0) throw Error("internal: an outer step that no member planned");
  if (fastest > kNone) fastest_per_sample_ = -fastest;
  for (int m = 0; m < W; ++m) g.per_sample.push_back(a[m][4] > kNone ? -a[m][4] : 0.0);
  g.consumed.assign(static_cast<size_t>(g.plan_world), 0);
  for (int m = 0; m < W; ++m) {
    const int p = static_cast<int>(a[m][0]);
    if (p < 0 || p >= g.plan_world) continue;
    g.consumed[p] = static_cast<int64_t>(a[m][1]);
    g.total += g.consumed[p];
    g.loss_sum += a[m][3];
  }
  if (g.total == 0) throw Error("internal: an outer step whose members processed no sample");
  if (with_buffers) {
    std::vector<double> weights;
    for (int m = 0; m < W; ++m) weights.push_back(std::max(0.0, a[m][1]));
    g.buffers = average_buffers(flat_, rows.narrow(1, 7, B), weights);
  }
  if (streaming()) rule_->set_agreed_flag(g.flag);
  return g;
}

std::optional<OuterSteps::Committed> OuterSteps::finish(const std::function<void(bool)>& before_all_reduce,
                                                        const std::function<void(const Work&)>& run_ahead) {
  if (streaming()) return finish_fragment(before_all_reduce, run_ahead);
  const auto& st = s_.state();
  if (!inner_done_) {
    inner_wall_ = seconds_since(inner_start_);
    torch::NoGradGuard no_grad;
    delta_ = global_ - flat_.data();
    flat_.data().copy_(global_);
    local_buffers_.clear();
    if (!flat_.buffer_entries().empty()) local_buffers_ = flat_.save_buffers();
    inner_done_ = true;
  } else if (!local_buffers_.empty()) {
    flat_.restore_buffers(local_buffers_);  // a redo: this member's own buffers, not the state sync's
  }
  if (!delta_.defined()) delta_ = torch::zeros_like(flat_.data());
  const auto sync_start = Clock::now();
  const auto g = agree(static_cast<double>(consumed_));
  if (!g) return std::nullopt;
  // Every member deals the plan alike from the committed state (a joiner
  // too), with the plan's world.
  const OuterPlan plan = plan_for(st.cursor, st.owed, g->plan_world, /*this_step=*/true);
  take_paces(g->per_sample, g->plan_world);
  if (before_all_reduce) before_all_reduce(redo_);
  Committed c;
  if (opt_.diloco.pace) c.shares = fractions_of(plan);
  c.delta_norm = delta_.norm().item<double>();
  std::vector<torch::Tensor> buffers_before;
  if (!flat_.buffer_entries().empty()) buffers_before = flat_.save_buffers();
  flat_.grad().copy_(delta_);
  const double my_loss = consumed_ > 0 ? loss_sum_ / static_cast<double>(consumed_) : 0.0;
  StepContext ctx{flat_.data(), flat_.grad(), flat_.grad_with_slot(), my_loss, consumed_, g->total,
                  opt_.diloco.outer_lr, st.step, {}};
  auto applied = s_.apply(ctx, buffers_before);
  if (!applied) return std::nullopt;  // re-formed: the outer step is redone (or was committed elsewhere)
  c.res = *applied;
  c.res.loss = g->loss_sum / static_cast<double>(g->total);
  c.settled = settle_outer(plan, g->consumed, opt_.samples);
  c.epoch = plan.epoch;
  c.payload_bytes = measured_payload(flat_.numel());
  s_.state().owed = c.settled.owed;
  // A skipped outer step leaves the buffers as committed before it (as
  // every member held them), not each member's own after its inner steps.
  s_.commit(c.res, c.settled.cursor, unit_buffers_.empty() ? buffers_before : unit_buffers_);
  return committed(std::move(c), sync_start);
}

// What this member's last all-reduce put on the wire for the pseudo-gradient
// (UpdateRule::last_payload_bytes); with no group (one process), what it
// would have sent.
int64_t OuterSteps::measured_payload(int64_t n) const {
  const int64_t sent = rule_->last_payload_bytes();
  return sent >= 0 ? sent : payload_bytes_of(n, opt_.diloco.wire);
}

OuterSteps::Committed OuterSteps::committed(Committed c, Clock::time_point sync_start) {
  c.sync_seconds = seconds_since(sync_start);
  c.inner_steps = inner_steps_;
  c.trained = std::move(trained_);
  trained_.clear();
  c.compute_seconds = inner_compute_;
  c.wall_seconds = seconds_since(began_);
  inner_steps_total += inner_steps_;
  compute_seconds += inner_compute_;
  sync_seconds += c.sync_seconds;
  wall_seconds += c.wall_seconds;
  payload_bytes += c.payload_bytes;
  plan_step_ = -1;
  inner_done_ = false;
  local_step_ = s_.state().step;
  return c;
}

std::optional<OuterSteps::Committed> OuterSteps::finish_fragment(const std::function<void(bool)>& before_all_reduce,
                                                                 const std::function<void(const Work&)>& run_ahead) {
  torch::NoGradGuard no_grad;
  const auto& st = s_.state();
  const int f = static_cast<int>(st.step % static_cast<int64_t>(fragments_.size()));
  const auto [lo, hi] = fragments_[static_cast<size_t>(f)];
  auto& w = flat_.data();
  if (!inner_done_) {
    inner_wall_ = seconds_since(inner_start_);
    local_ = w.clone();
    w.copy_(global_);  // the Session's weights are the global ones again
    delta_ = (global_.slice(0, lo, hi) - local_.slice(0, lo, hi)).contiguous();
    local_buffers_.clear();
    if (!flat_.buffer_entries().empty()) local_buffers_ = flat_.save_buffers();
    inner_done_ = true;
  } else if (!local_buffers_.empty()) {
    flat_.restore_buffers(local_buffers_);  // a redo: this member's own buffers, not the state sync's
  }
  if (!delta_.defined()) delta_ = torch::zeros({hi - lo}, torch::kFloat32);  // no share (a redo's joiner)
  const auto sync_start = Clock::now();
  // This member's weight: its samples since the fragment's last sync.
  const double weight = static_cast<double>(since_sync_[static_cast<size_t>(f)] + consumed_);
  const auto g = agree(weight);
  if (!g) return std::nullopt;
  const OuterPlan plan = plan_for(st.cursor, st.owed, g->plan_world, /*this_step=*/true);
  take_paces(g->per_sample, g->plan_world);
  if (before_all_reduce) before_all_reduce(redo_);
  Committed c;
  if (opt_.diloco.pace) c.shares = fractions_of(plan);
  c.fragment = f;
  c.delta_norm = delta_.norm().item<double>();
  c.settled = settle_outer(plan, g->consumed, opt_.samples);
  c.epoch = plan.epoch;
  auto piece = delta_ * static_cast<float>(g->weight_total > 0 ? weight / g->weight_total : 0.0);
  // Overlap: the next unit's first inner steps run while the fragment's
  // all-reduce does; never across an epoch's end, after the run's last
  // unit (train.max_steps) or an agreed change of the group (its plan
  // would differ), nor without a share in this one.
  const int64_t tau = opt_.diloco.overlap_steps;
  const bool last_unit = opt_.max_steps > 0 && st.step + 1 >= opt_.max_steps;
  const bool overlap = tau > 0 && run_ahead && inner_opt_ && g->flag == 0 && !c.settled.last_in_epoch &&
                       !last_unit && plan_rank_ >= 0 && local_.defined();
  std::exception_ptr failed;
  // The sum, and where the rule shards the outer state, the sharded update
  // of the global fragment (a copy of it: the weights hold the local ones
  // while inner steps run ahead) and its all-gather, all on the wire while
  // those steps run.
  torch::Tensor fragment = rule_->shards_state() ? w.slice(0, lo, hi).clone() : torch::Tensor();
  bool skipped = false, sharded = false;
  auto sync = [&] {
    rule_->sum(piece, f);
    skipped = !std::isfinite(piece.sum().item<float>());
    if (fragment.defined())
      sharded = rule_->update_fragment(fragment, piece, lo, hi, opt_.diloco.outer_lr, st.step, skipped);
  };
  if (overlap) {
    Ahead a;
    a.plan = plan_for(c.settled.cursor, c.settled.owed, s_.world(), /*this_step=*/false);
    a.rank = s_.rank();
    a.step = st.step + 1;
    a.cursor_position = c.settled.cursor.position;
    a.local_before = local_.clone();
    if (!flat_.buffer_entries().empty()) a.buffers_before = flat_.save_buffers();
    a.inner_before = inner_opt_->snapshot();
    ahead_ = std::move(a);
    Work aw = work_of(ahead_->plan, ahead_->rank, 0);
    if (static_cast<int64_t>(aw.batches.size()) > tau) aw.batches.resize(static_cast<size_t>(tau));
    const auto ahead_start = Clock::now();
    std::thread comm([&] {
      try {
        torch::NoGradGuard no_grad;
        sync();
      } catch (...) {
        failed = std::current_exception();
      }
    });
    w.copy_(local_);  // the inner steps train the local weights
    running_ahead_ = true;
    try {
      torch::AutoGradMode grad_on(true);  // the inner steps' backward
      run_ahead(aw);
    } catch (...) {
      running_ahead_ = false;
      comm.join();
      throw;
    }
    running_ahead_ = false;
    comm.join();
    ahead_->wall = seconds_since(ahead_start);
    local_ = w.clone();
    w.copy_(global_);
    if (failed) undo_ahead();
  } else {
    try {
      sync();
    } catch (...) {
      failed = std::current_exception();
    }
  }
  if (failed) {
    try {
      std::rethrow_exception(failed);
    } catch (const Error& e) {
      if (!s_.elastic() || !recoverable(e)) throw;
      log_warn("the sync of fragment " + std::to_string(f) + " in outer step " + std::to_string(st.step + 1) +
               " failed: " + e.what());
      s_.reform(std::string("failure: ") + e.what(), sync_start, seconds_since(sync_start));
      return std::nullopt;
    }
  }
  c.res.global_batch = g->total;
  c.res.loss = g->loss_sum / static_cast<double>(g->total);
  c.res.skipped = skipped;
  auto gw = w.slice(0, lo, hi);
  if (sharded) gw.copy_(fragment);
  else if (!c.res.skipped) outer_update_slice(outer_->optimizer(), w, piece, lo, hi, opt_.diloco.outer_lr);
  // The local fragment moves to the global one by the mixing factor (a
  // step that was not finite: to the global one).
  const double alpha = c.res.skipped ? 0.0 : opt_.diloco.mixing;
  auto mix = [&](torch::Tensor& local) {
    if (!local.defined()) return;
    auto l = local.slice(0, lo, hi);
    l.mul_(alpha).add_(gw, 1.0 - alpha);
  };
  mix(local_);
  if (ahead_) mix(ahead_->local_before);
  // The buffers: the members' average, with what inner steps run ahead
  // since moved them (an average that is not finite leaves them).
  bool buffers_finite = true;
  for (const auto& b : g->buffers)
    if (b.is_floating_point()) buffers_finite = buffers_finite && std::isfinite(b.sum().item<double>());
  if (!g->buffers.empty() && buffers_finite) {
    take_buffer_average(flat_, g->buffers, agreed_buffers_);
    if (ahead_) ahead_->buffers_before = g->buffers;
  }
  s_.state().owed = c.settled.owed;
  s_.commit(c.res, c.settled.cursor, {});
  rule_->sum_committed(f);
  c.payload_bytes = measured_payload(hi - lo);
  for (auto& n : since_sync_) n += consumed_;
  since_sync_[static_cast<size_t>(f)] = 0;
  auto done = committed(std::move(c), sync_start);
  if (ahead_) {  // the inner steps run meanwhile computed; they are not the sync's wait
    done.sync_seconds = std::max(0.0, done.sync_seconds - ahead_->wall);
    sync_seconds -= std::min(sync_seconds, ahead_->wall);
  }
  return done;
}

}  // namespace limbo::train
