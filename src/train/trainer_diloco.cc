// DiLoCo's outer step in the trainer (elastic.sync = "diloco"; the plan of
// samples and its settlement are train/diloco.h, the rules docs/diloco.md).
//
// One call of outer_step() is one outer step of this member:
//   1. after a (re)formation, the group agrees whether an outer step is
//      being redone (some member finished its inner steps and the sync
//      failed): then no member starts new inner work, and a member without
//      work of that step (a joiner, or one whose work is stale) takes part
//      with no samples;
//   2. otherwise it plans the outer step from the committed state and runs
//      its inner steps alone on its share (the inner optimizer, locally);
//   3. the members agree on what each processed (plan rank and samples:
//      one small all-reduce), then the update rule all-reduces the
//      pseudo-gradients weighted by those samples and applies the outer
//      optimizer to the global weights (Session::apply: a failure
//      re-forms, and the outer step is redone by the survivors);
//   4. the commit moves the cursor and leaves what no surviving member
//      processed owed to the next outer step.
#include <signal.h>
#include <unistd.h>

#include <cmath>
#include <cstdio>

#include "common/error.h"
#include "common/log.h"
#include "train/trainer_run.h"

namespace limbo::train {

namespace {

// The member whose testing aid says so dies here (train.testing_die_at_step
// counts outer steps under DiLoCo).
void die_for_test(const char* where, int rank, int64_t step, bool freeze) {
  std::fprintf(stderr, "testing: rank %d %s %s of outer step %ld\n", rank, freeze ? "freezes" : "dies", where,
               static_cast<long>(step + 1));
  std::fflush(stderr);
  ::kill(::getpid(), freeze ? SIGSTOP : SIGKILL);
}

}  // namespace

void Trainer::diloco_state_hooks(SessionParts& parts) {
  // The inner optimizer is each member's own: checkpoints keep the
  // writer's, and a resumed run gives it to every member; state sync does
  // not move it (a joiner's starts afresh).
  parts.save_local = [this](std::map<std::string, torch::Tensor>& extra) {
    auto& inner = opt_->optimizer();
    extra["diloco_inner/steps"] = torch::tensor({inner.steps()}, torch::kInt64);
    const auto names = inner.state_names();
    for (size_t i = 0; inner.has_state() && i < names.size(); ++i) extra["diloco_inner/" + names[i]] = inner.state()[i];
  };
  parts.load_local = [this](const std::map<std::string, torch::Tensor>& extra) {
    auto& inner = opt_->optimizer();
    const auto steps = extra.find("diloco_inner/steps");
    if (steps == extra.end()) return;
    std::vector<torch::Tensor> st;
    for (const auto& name : inner.state_names()) {
      const auto it = extra.find("diloco_inner/" + name);
      if (it == extra.end() || it->second.numel() != flat_->numel()) {
        st.clear();
        break;
      }
      st.push_back(it->second.to(torch::kFloat32).contiguous().clone());
    }
    inner.set_state(std::move(st), st.empty() ? 0 : steps->second.item<int64_t>());
  };
}

void Trainer::run_inner_steps(Run& r) {
  auto& o = *outer_run_;
  const auto& t = r.t;
  const auto& plan = o.plan;
  const auto& order = o.sampler.epoch_order(plan.epoch);
  const int64_t lo = plan.offsets[o.plan_rank], hi = plan.offsets[o.plan_rank + 1];
  const int64_t b = cfg_.loader.batch_size;
  const bool dies = t.die_at_step > 0 && state_.step == t.die_at_step && r.s.rank() == t.die_rank &&
                    r.s.world() > 1 && r.s.membership_changes() == t.die_after_changes;
  auto& inner = *opt_;
  // The bounded wait: what the fastest member took for a whole share, and
  // max_wait times that again (docs/diloco.md).
  const double bound = cfg_.diloco.max_wait > 0 && o.fastest_per_sample > 0
                           ? (1 + cfg_.diloco.max_wait) * o.fastest_per_sample *
                                 static_cast<double>(b * cfg_.diloco.inner_steps)
                           : -1;
  const auto start = Clock::now();
  int64_t i = 0;
  for (int64_t at = lo; at < hi; at += b, ++i) {
    if (bound > 0 && seconds_since(start) > bound) {
      log_info("outer step " + std::to_string(state_.step + 1) + ": stopped after " + std::to_string(at - lo) + " of " +
               std::to_string(hi - lo) + " samples (the bounded wait, " + std::to_string(bound) +
               " s); the rest are dealt again");
      o.stopped_early += 1;
      break;
    }
    if (dies && !t.die_in_outer && at >= lo + (hi - lo) / 2) die_for_test("halfway through the inner steps", r.s.rank(), state_.step, t.die_by_freezing);
    std::vector<int64_t> ids;
    for (int64_t k = at; k < std::min(at + b, hi); ++k) ids.push_back(order[plan.positions[k]]);
    auto batch = data::make_train_batch(splits_->train, norm_, ids, plan.epoch, cfg_.loader.augment);
    // The schedule by the samples the whole group has dealt so far.
    const double epoch = plan.epoch + static_cast<double>(std::min(state_.cursor.position, r.n) +
                                                          i * b * plan.world) / static_cast<double>(r.n);
    r.lr = schedule_->lr(epoch, state_.step * cfg_.diloco.inner_steps + i);
    const auto t0 = Clock::now();
    const double loss = step_->gradient(batch);
    o.inner_seconds += seconds_since(t0);  // forward and backward: the compute utilisation's numerator
    if (finite_step(flat_->grad(), loss)) {
      inner.apply(flat_->data(), flat_->grad(), r.lr);
      o.loss_sum += loss * static_cast<double>(ids.size());
    } else {
      o.inner_skipped += 1;  // the samples count as seen (as a skipped step's)
    }
    o.consumed += static_cast<int64_t>(ids.size());
    o.inner_steps += 1;
  }
  o.inner_wall = seconds_since(start);
}

bool Trainer::outer_step(Run& r) {
  auto& o = *outer_run_;
  const auto& t = r.t;
  auto redo_or_throw = [&](const Error& e, Clock::time_point since, const char* what) {
    if (!r.elastic || !recoverable(e)) throw;
    log_warn(std::string(what) + " of outer step " + std::to_string(state_.step + 1) + " failed: " + e.what());
    r.s.reform(std::string("failure: ") + e.what(), since, seconds_since(since));
  };
  // 1. After a (re)formation: is an outer step being redone?
  if (o.reformed) {
    o.reformed = false;
    const bool pending = o.inner_done && o.plan_step == state_.step;
    if (!pending) {  // none, or stale: its step committed elsewhere, or the state fell back
      o.inner_done = false;
      o.plan_step = -1;
    }
    auto any = torch::tensor({pending ? 1.0 : 0.0}, torch::kFloat64);
    const auto t0 = Clock::now();
    try {
      rule_->agree_max(any);
    } catch (const Error& e) {
      redo_or_throw(e, t0, "the agreement");
      return false;
    }
    if (pending) {
      o.outer_redone += 1;
      o.redo = true;
    } else if (any.item<double>() > 0) {
      // Others redo an outer step: this member takes part with no samples.
      o.plan_step = state_.step;
      o.plan_rank = -1;
      o.inner_done = true;
      o.redo = true;
      o.consumed = 0;
      o.loss_sum = 0;
      o.inner_steps = 0;
      o.inner_seconds = 0;
      o.delta = torch::zeros_like(flat_->data());
      o.local_buffers.clear();
      o.began = Clock::now();
    }
  }
  // 2. A new outer step: plan it, run the inner steps.
  if (o.plan_step != state_.step) {
    o.plan = plan_outer(state_.cursor, state_.owed, r.n, cfg_.loader.batch_size * cfg_.diloco.inner_steps, r.s.world());
    o.plan_step = state_.step;
    o.plan_rank = r.s.rank();
    o.inner_done = false;
    o.redo = false;
    o.consumed = 0;
    o.loss_sum = 0;
    o.inner_steps = 0;
    o.inner_seconds = 0;
    o.began = Clock::now();
    o.global = flat_->data().clone();
  }
  if (!o.inner_done) {
    run_inner_steps(r);
    o.delta = o.global - flat_->data();
    flat_->data().copy_(o.global);
    o.local_buffers.clear();
    if (!flat_->buffer_entries().empty()) o.local_buffers = flat_->save_buffers();
    o.inner_done = true;
  } else if (!o.local_buffers.empty()) {
    flat_->restore_buffers(o.local_buffers);  // a redo: this member's own buffers, not the state sync's
  }
  // 3. The agreement on what each member processed, then the outer update.
  const auto sync_start = Clock::now();
  const int W = r.s.world();
  // Each member's row (the others' stay at their floor, the maximum takes
  // the owner's): plan rank, samples processed, plan's world, their loss
  // sum, and minus its seconds a sample (so the maximum is the fastest).
  constexpr double kNone = -1e300;
  auto rows = torch::full({W, 5}, -1.0, torch::kFloat64);
  rows.select(1, 4).fill_(kNone);
  {
    auto a = rows.accessor<double, 2>();
    const int me = r.s.rank();
    a[me][0] = o.plan_rank;
    a[me][1] = static_cast<double>(o.consumed);
    a[me][2] = o.plan_rank >= 0 ? o.plan.world : -1;
    a[me][3] = o.loss_sum;
    if (o.consumed > 0 && !o.redo) a[me][4] = -o.inner_wall / static_cast<double>(o.consumed);
  }
  try {
    rule_->agree_max(rows);
  } catch (const Error& e) {
    redo_or_throw(e, sync_start, "the agreement");
    return false;
  }
  int plan_world = 0;
  int64_t total = 0;
  double loss_sum = 0;
  {
    auto a = rows.accessor<double, 2>();
    for (int m = 0; m < W; ++m) plan_world = std::max(plan_world, static_cast<int>(a[m][2]));
    if (plan_world <= 0) throw Error("internal: an outer step that no member planned");
    double fastest = kNone;
    for (int m = 0; m < W; ++m) fastest = std::max(fastest, a[m][4]);
    if (fastest > kNone) o.fastest_per_sample = -fastest;
  }
  const OuterPlan plan = plan_outer(state_.cursor, state_.owed, r.n, cfg_.loader.batch_size * cfg_.diloco.inner_steps, plan_world);
  std::vector<int64_t> consumed(static_cast<size_t>(plan_world), 0);
  {
    auto a = rows.accessor<double, 2>();
    for (int m = 0; m < W; ++m) {
      const int p = static_cast<int>(a[m][0]);
      if (p < 0 || p >= plan_world) continue;
      consumed[p] = static_cast<int64_t>(a[m][1]);
      total += consumed[p];
      loss_sum += a[m][3];
    }
  }
  if (total == 0) throw Error("internal: an outer step whose members processed no sample");
  if (t.die_at_step > 0 && t.die_in_outer && !o.redo && state_.step == t.die_at_step && r.s.rank() == t.die_rank &&
      r.s.world() > 1 && r.s.membership_changes() == t.die_after_changes)
    die_for_test("as the outer all-reduce starts", r.s.rank(), state_.step, t.die_by_freezing);
  const double delta_norm = o.delta.norm().item<double>();
  std::vector<torch::Tensor> buffers_before;
  if (!flat_->buffer_entries().empty()) buffers_before = flat_->save_buffers();
  flat_->grad().copy_(o.delta);
  const double my_loss = o.consumed > 0 ? o.loss_sum / static_cast<double>(o.consumed) : 0.0;
  StepContext ctx{flat_->data(), flat_->grad(), flat_->grad_with_slot(), my_loss, o.consumed, total,
                  cfg_.diloco.outer_lr, state_.step, {}};
  auto applied = r.s.apply(ctx, buffers_before);
  if (!applied) return false;  // re-formed: the outer step is redone (or was committed elsewhere)
  // 4. Commit: the cursor moves; what no surviving member processed is owed.
  r.res = *applied;
  r.res.loss = loss_sum / static_cast<double>(total);
  auto settled = settle_outer(plan, consumed, r.n);
  state_.owed = settled.owed;
  data::BatchPlan& bp = r.batch.plan;
  bp.begin = state_.cursor;
  bp.end = settled.cursor;
  bp.global_size = total;
  bp.last_in_epoch = settled.last_in_epoch;
  r.epoch_progress = r.epoch_now(state_.cursor);
  r.s.commit(r.res, settled.cursor, buffers_before);
  const double sync_seconds = seconds_since(sync_start);
  if (t.sample_log && !cfg_.run_dir.empty()) {
    std::vector<int64_t> ids;
    const auto& order = o.sampler.epoch_order(plan.epoch);
    for (int64_t pos : settled.committed) ids.push_back(order[pos]);
    log_committed_ids(cfg_.run_dir, state_.step, plan.epoch, ids);
  }
  o.inner_steps_total += o.inner_steps;
  o.compute_seconds += o.inner_seconds;
  o.sync_seconds += sync_seconds;
  o.wall_seconds += seconds_since(o.began);
  o.payload_bytes += payload_bytes(flat_->numel(), cfg_.diloco.wire);
  outer_record(r, r.res, sync_seconds, delta_norm, range_total(state_.owed));
  o.plan_step = -1;
  o.inner_done = false;
  r.samples_this_run += r.res.global_batch;
  r.last_loss = r.res.loss;
  r.window.add(r.res.loss, r.res.global_batch);
  r.train_seconds += seconds_since(o.began);
  return true;
}

// A record per outer step: what this member did and what the step cost it.
void Trainer::outer_record(Run& r, const StepResult& res, double sync_seconds, double delta_norm, int64_t owed) {
  auto& o = *outer_run_;
  const double wall = seconds_since(o.began);
  r.run_dir.append_metrics({{"kind", "outer"},
                            {"step", state_.step},
                            {"epoch", r.epoch_now(state_.cursor)},
                            {"samples", res.global_batch},
                            {"loss", res.loss},
                            {"skipped", res.skipped},
                            {"inner_steps", o.inner_steps},
                            {"owed", owed},
                            {"pseudo_gradient_norm", delta_norm},
                            {"compute_seconds", o.inner_seconds},
                            {"wall_seconds", wall},
                            {"sync_seconds", sync_seconds},
                            {"compute_utilisation", wall > 0 ? o.inner_seconds / wall : 0.0},
                            {"payload_bytes", payload_bytes(flat_->numel(), cfg_.diloco.wire)},
                            {"workers", r.s.world()}});
}

}  // namespace limbo::train
