#include "train/outer_steps.h"

#include <algorithm>
#include <string>

#include "common/error.h"
#include "common/log.h"

namespace limbo::train {

OuterSteps::OuterSteps(Session& session, optim::FlatParams& flat, std::shared_ptr<UpdateRule> rule, Options opt)
    : s_(session), flat_(flat), rule_(std::move(rule)), opt_(std::move(opt)), sampler_(opt_.samples, opt_.order, opt_.seed) {}

bool OuterSteps::agree_on_redo() {
  const bool pending = inner_done_ && plan_step_ == s_.state().step;
  if (!pending) {  // none, or stale: its step committed elsewhere, or the state fell back
    inner_done_ = false;
    plan_step_ = -1;
  }
  auto any = torch::tensor({pending ? 1.0 : 0.0}, torch::kFloat64);
  rule_->agree_max(any);
  if (pending) {
    outer_redone += 1;
    redo_ = true;
  } else if (any.item<double>() > 0) {
    // Others redo an outer step: this member takes part with no samples.
    start_work(-1, /*done=*/true);
    redo_ = true;
    delta_ = torch::zeros_like(flat_.data());
    local_buffers_.clear();
  }
  return any.item<double>() > 0;
}

void OuterSteps::plan_new() {
  const auto& st = s_.state();
  plan_ = plan_outer(st.cursor, st.owed, opt_.samples, opt_.batch * opt_.diloco.inner_steps, s_.world());
  start_work(s_.rank(), /*done=*/false);
  redo_ = false;
  global_ = flat_.data().clone();
}

void OuterSteps::start_work(int plan_rank, bool done) {
  plan_step_ = s_.state().step;
  plan_rank_ = plan_rank;
  inner_done_ = done;
  consumed_ = 0;
  loss_sum_ = 0;
  inner_steps_ = 0;
  inner_compute_ = inner_wall_ = 0;
  began_ = Clock::now();
}

nlohmann::json OuterSteps::record(const Committed& c, double epoch, int workers) const {
  return {{"kind", "outer"},
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
          {"compute_utilisation", c.wall_seconds > 0 ? c.compute_seconds / c.wall_seconds : 0.0},
          {"payload_bytes", payload_bytes_of(flat_.numel(), opt_.diloco.wire)},
          {"workers", workers}};
}

nlohmann::json OuterSteps::summary() const {
  return {{"outer_steps", s_.state().step},
          {"inner_steps", inner_steps_total},
          {"inner_steps_skipped", inner_skipped},
          {"outer_steps_redone", outer_redone},
          {"outer_steps_stopped_early", stopped_early},
          {"compute_utilisation", wall_seconds > 0 ? compute_seconds / wall_seconds : 0.0},
          {"compute_seconds", compute_seconds},
          {"outer_sync_seconds", sync_seconds},
          {"pseudo_gradient_bytes", payload_bytes}};
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
  bound_ = opt_.diloco.max_wait > 0 && fastest_per_sample_ > 0
               ? (1 + opt_.diloco.max_wait) * fastest_per_sample_ *
                     static_cast<double>(opt_.batch * opt_.diloco.inner_steps)
               : -1;
  inner_start_ = Clock::now();
  w.epoch = plan_.epoch;
  const auto& order = sampler_.epoch_order(plan_.epoch);
  const int64_t lo = plan_.offsets[plan_rank_], hi = plan_.offsets[plan_rank_ + 1];
  for (int64_t at = lo; at < hi; at += opt_.batch) {
    std::vector<int64_t> ids;
    for (int64_t k = at; k < std::min(at + opt_.batch, hi); ++k) ids.push_back(order[plan_.positions[k]]);
    w.batches.push_back(std::move(ids));
  }
  return w;
}

bool OuterSteps::keep_going() {
  // At least one inner step a member (an outer step always has samples).
  if (bound_ <= 0 || consumed_ == 0 || seconds_since(inner_start_) <= bound_) return true;
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
  return static_cast<double>(plan_.epoch) +
         static_cast<double>(std::min(s_.state().cursor.position, n) + i * opt_.batch * plan_.world) /
             static_cast<double>(n);
}

int64_t OuterSteps::inner_iteration(int64_t i) const { return s_.state().step * opt_.diloco.inner_steps + i; }

void OuterSteps::inner_step_done(int64_t samples, double loss, bool applied, double compute) {
  if (applied) loss_sum_ += loss * static_cast<double>(samples);
  else inner_skipped += 1;  // the samples count as seen (as a skipped step's)
  consumed_ += samples;
  inner_steps_ += 1;
  inner_compute_ += compute;
}

std::optional<OuterSteps::Committed> OuterSteps::finish(const std::function<void(bool)>& before_all_reduce) {
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
  // The agreement: each member's row (the others stay at their floor; the
  // maximum takes the owner's): plan rank, samples processed, the plan's
  // world, their loss sum, and minus its seconds a sample (the maximum is
  // the fastest).
  const auto sync_start = Clock::now();
  const int W = s_.world();
  constexpr double kNone = -1e300;
  auto rows = torch::full({W, 5}, -1.0, torch::kFloat64);
  rows.select(1, 4).fill_(kNone);
  {
    auto a = rows.accessor<double, 2>();
    const int me = s_.rank();
    a[me][0] = plan_rank_;
    a[me][1] = static_cast<double>(consumed_);
    a[me][2] = plan_rank_ >= 0 ? plan_.world : -1;
    a[me][3] = loss_sum_;
    if (consumed_ > 0 && !redo_) a[me][4] = -inner_wall_ / static_cast<double>(consumed_);
  }
  try {
    rule_->agree_max(rows);
  } catch (const Error& e) {
    if (!s_.elastic() || !recoverable(e)) throw;
    log_warn("the agreement of outer step " + std::to_string(st.step + 1) + " failed: " + e.what());
    s_.reform(std::string("failure: ") + e.what(), sync_start, seconds_since(sync_start));
    return std::nullopt;
  }
  int plan_world = 0;
  int64_t total = 0;
  double loss_sum = 0, fastest = kNone;
  auto a = rows.accessor<double, 2>();
  for (int m = 0; m < W; ++m) {
    plan_world = std::max(plan_world, static_cast<int>(a[m][2]));
    fastest = std::max(fastest, a[m][4]);
  }
  if (plan_world <= 0) throw Error("internal: an outer step that no member planned");
  if (fastest > kNone) fastest_per_sample_ = -fastest;
  // Every member deals the plan alike from the committed state (a joiner
  // too), with the plan's world.
  const OuterPlan plan = plan_outer(st.cursor, st.owed, opt_.samples, opt_.batch * opt_.diloco.inner_steps, plan_world);
  std::vector<int64_t> consumed(static_cast<size_t>(plan_world), 0);
  for (int m = 0; m < W; ++m) {
    const int p = static_cast<int>(a[m][0]);
    if (p < 0 || p >= plan_world) continue;
    consumed[p] = static_cast<int64_t>(a[m][1]);
    total += consumed[p];
    loss_sum += a[m][3];
  }
  if (total == 0) throw Error("internal: an outer step whose members processed no sample");
  if (before_all_reduce) before_all_reduce(redo_);
  Committed c;
  c.delta_norm = delta_.norm().item<double>();
  std::vector<torch::Tensor> buffers_before;
  if (!flat_.buffer_entries().empty()) buffers_before = flat_.save_buffers();
  flat_.grad().copy_(delta_);
  const double my_loss = consumed_ > 0 ? loss_sum_ / static_cast<double>(consumed_) : 0.0;
  StepContext ctx{flat_.data(), flat_.grad(), flat_.grad_with_slot(), my_loss, consumed_, total,
                  opt_.diloco.outer_lr, st.step, {}};
  auto applied = s_.apply(ctx, buffers_before);
  if (!applied) return std::nullopt;  // re-formed: the outer step is redone (or was committed elsewhere)
  c.res = *applied;
  c.res.loss = loss_sum / static_cast<double>(total);
  c.settled = settle_outer(plan, consumed, opt_.samples);
  c.epoch = plan.epoch;
  s_.state().owed = c.settled.owed;
  s_.commit(c.res, c.settled.cursor, buffers_before);
  c.sync_seconds = seconds_since(sync_start);
  c.inner_steps = inner_steps_;
  c.compute_seconds = inner_compute_;
  c.wall_seconds = seconds_since(began_);
  inner_steps_total += inner_steps_;
  compute_seconds += inner_compute_;
  sync_seconds += c.sync_seconds;
  wall_seconds += c.wall_seconds;
  payload_bytes += payload_bytes_of(flat_.numel(), opt_.diloco.wire);
  plan_step_ = -1;
  inner_done_ = false;
  return c;
}

}  // namespace limbo::train
