#include "sim/elastic_sim.h"

#include <torch/torch.h>

#include <chrono>

#include "common/error.h"
#include "common/timing.h"
#include "common/log.h"
#include "data/loader.h"
#include "optim/batch_policy.h"
#include "optim/lr_schedule.h"
#include "train/diloco.h"
#include "train/outer_steps.h"
#include "train/run_dir.h"

namespace limbo::sim {
namespace {

using json = nlohmann::json;

int workers_at(const std::vector<std::pair<double, int>>& schedule, double epoch) {
  int r = schedule.front().second;
  for (const auto& [e, w] : schedule)
    if (e <= epoch + 1e-12) r = w;
  return r;
}

}  // namespace

namespace {

// DiLoCo's outer steps with R(t) virtual members, as the trainer runs them
// (train/trainer_diloco.cc): each member's inner steps on its share of the
// outer step from the global weights, with an inner optimizer of its own
// (a member that joins starts one afresh, as a real joiner does), then the
// pseudo-gradients weighted by the samples each processed, and the outer
// optimizer on the global weights. Every member processes its whole share.
json run_diloco_sim(train::Trainer& t, const train::TrainerConfig& cfg, const ElasticSimOptions& opt) {
  auto& flat = t.params();
  auto& model = t.model();
  auto& outer = *t.rule_optimizer();
  const auto& train_set = t.data().train;
  const int64_t n = train_set.size();
  // Streaming (diloco.fragments = F > 1): units of H / F inner steps, each
  // syncing one fragment from every member's local weights, which persist
  // across units (train/outer_steps.h); members weighted by their samples
  // since the fragment's last sync. With overlap (tau inner steps), each
  // member runs the next unit's first tau inner steps on its local weights
  // before the synced fragment is mixed in, as a real member does while the
  // fragment's all-reduce is on the wire; never across an epoch's end or a
  // change of the schedule. Module buffers: each member's own, averaged at
  // every unit (weighted by its samples in the unit; counts their maximum).
  // Plain DiLoCo: each member starts its inner steps from the committed
  // buffers, and the outer step averages them as the real all-reduce does
  // (float32 and narrower ones weighted by the members' shares, integer and
  // float64 ones the first member's); a skipped outer step leaves the
  // committed ones.
  const int64_t F = cfg.diloco.fragments, b = cfg.loader.batch_size, H = cfg.diloco.unit_steps();
  const int64_t tau = F > 1 ? cfg.diloco.overlap_steps : 0;
  const bool buffers = !flat.buffer_entries().empty();
  const auto fragments = train::cut_fragments(flat, F);
  std::vector<torch::Tensor> local;                   // per virtual member (undefined: the global weights)
  std::vector<std::vector<torch::Tensor>> bufs;       // per member: its buffers (empty: the global ones)
  std::vector<std::vector<int64_t>> since_sync;       // per member, per fragment
  std::vector<int64_t> ahead;                         // per member: the unit's inner steps run ahead of it
  std::vector<double> ahead_loss;                     // their losses times their samples
  std::vector<torch::Tensor> gbufs = buffers ? flat.save_buffers() : std::vector<torch::Tensor>{};
  optim::LrSchedule schedule(cfg.lr);
  data::Sampler sampler(n, cfg.loader.order, cfg.loader.seed);
  train::RunDir run(opt.run_dir, false);
  if (run.enabled()) run.write_config(cfg.config_toml);
  std::vector<std::unique_ptr<train::OptimizerStep>> inner;  // per virtual member
  data::Cursor cur;
  train::PositionRanges owed;
  int64_t step = 0, changes = 0, samples = 0, inner_steps = 0, overlapped = 0;
  int last_r = 0;
  double grad_seconds = 0, eval_seconds = 0, last_loss = 0;
  torch::Tensor global = flat.data().clone(), gsum = torch::zeros_like(flat.grad());
  train::EvalResult ev;
  auto wall0 = Clock::now();
  model.train();
  // Member k's inner steps [from, to) of `plan` (its share), the cursor
  // position it was planned from and the unit's index `unit`, on the
  // weights in `flat`: the sum of their losses times their samples.
  auto run_inner = [&](int k, const train::OuterPlan& plan, int64_t at, int64_t unit, int64_t from, int64_t to) {
    const auto& order = sampler.epoch_order(plan.epoch);
    const int64_t lo = plan.offsets[k], hi = plan.offsets[k + 1];
    double sum = 0;
    for (int64_t i = from; i < to && lo + i * b < hi; ++i) {
      std::vector<int64_t> ids;
      for (int64_t q = lo + i * b; q < std::min(lo + (i + 1) * b, hi); ++q) ids.push_back(order[plan.positions[q]]);
      auto batch = data::make_train_batch(train_set, t.normalization(), ids, plan.epoch, cfg.loader.augment);
      const double epoch = plan.epoch + static_cast<double>(std::min(at, n) + i * b * plan.world) / n;
      const double l = t.step().gradient(batch);
      if (train::finite_step(flat.grad(), l)) {
        inner[k]->apply(flat.data(), flat.grad(), schedule.lr(epoch, unit * H + i));
        sum += l * static_cast<double>(ids.size());
      }
      inner_steps += 1;
    }
    return sum;
  };
  // Member k's local weights and buffers into the model, and back out.
  auto load = [&](int k) {
    flat.data().copy_(F > 1 && local[k].defined() ? local[k] : global);
    if (buffers) flat.restore_buffers(bufs[k].empty() ? gbufs : bufs[k]);
  };
  auto keep = [&](int k) {
    local[k] = flat.data().clone();
    if (buffers) bufs[k] = flat.save_buffers();
  };
  while (cur.epoch < cfg.train.epochs && (cfg.train.max_steps <= 0 || step < cfg.train.max_steps)) {
    const double epoch_now = cur.epoch + static_cast<double>(cur.position) / n;
    const int r = workers_at(opt.schedule, epoch_now);
    if (last_r != 0 && r != last_r) {
      changes += 1;
      run.append_metrics({{"kind", "membership"}, {"step", step}, {"epoch", epoch_now}, {"world", r},
                          {"reason", "schedule"}});
    }
    last_r = r;
    inner.resize(static_cast<size_t>(r));
    local.resize(static_cast<size_t>(r));
    bufs.resize(static_cast<size_t>(r));
    ahead.resize(static_cast<size_t>(r), 0);
    ahead_loss.resize(static_cast<size_t>(r), 0.0);
    since_sync.resize(static_cast<size_t>(r), std::vector<int64_t>(fragments.size(), 0));
    for (auto& o : inner)
      if (!o) o = std::make_unique<train::OptimizerStep>(optim::make_optimizer(cfg.optimizer), cfg.clip_grad_norm);
    const auto plan = train::plan_outer(cur, owed, n, b * H, r);
    gsum.zero_();
    double loss_sum = 0;
    const int64_t total = static_cast<int64_t>(plan.positions.size());
    std::vector<int64_t> consumed;
    std::vector<torch::Tensor> rows;                  // buffers: each member's row
    std::vector<double> row_weights;                  // and its samples in the unit
    std::vector<std::vector<torch::Tensor>> agreed;   // and its buffers then
    auto g0 = Clock::now();
    for (int k = 0; k < r; ++k) {
      const int64_t lo = plan.offsets[k], hi = plan.offsets[k + 1];
      consumed.push_back(hi - lo);
      loss_sum += ahead_loss[k];
      if (hi == lo && F == 1) continue;
      load(k);
      loss_sum += run_inner(k, plan, cur.position, step, ahead[k], (hi - lo + b - 1) / b);
      // What the weighted all-reduce sums: the member's share times its
      // pseudo-gradient.
      torch::NoGradGuard ng;
      if (F > 1) keep(k);
      else gsum.add_(global - flat.data(), static_cast<double>(hi - lo) / static_cast<double>(total));
      if (buffers) {
        rows.push_back(train::buffer_row(flat));
        row_weights.push_back(static_cast<double>(hi - lo));
        if (F > 1) agreed.push_back(bufs[k]);
      }
    }
    std::fill(ahead.begin(), ahead.end(), 0);
    std::fill(ahead_loss.begin(), ahead_loss.end(), 0.0);
    auto settled = train::settle_outer(plan, consumed, n);
    if (F > 1) {
      const size_t f = static_cast<size_t>(step % F);
      const auto [flo, fhi] = fragments[f];
      double weight_total = 0;
      for (int k = 0; k < r; ++k) weight_total += static_cast<double>(since_sync[k][f] + consumed[k]);
      auto piece = torch::zeros({fhi - flo}, torch::kFloat32);
      for (int k = 0; k < r; ++k) {
        const double wk = static_cast<double>(since_sync[k][f] + consumed[k]) / weight_total;
        piece.add_((global.slice(0, flo, fhi) - local[k].slice(0, flo, fhi)) * static_cast<float>(wk));
      }
      // Overlap: the next unit's first tau inner steps, planned as the real
      // members plan them, run before the fragment is mixed in.
      const double next_epoch = settled.cursor.epoch + static_cast<double>(settled.cursor.position) / n;
      if (tau > 0 && !settled.last_in_epoch && workers_at(opt.schedule, next_epoch) == r &&
          (cfg.train.max_steps <= 0 || step + 1 < cfg.train.max_steps)) {
        const auto next = train::plan_outer(settled.cursor, settled.owed, n, b * H, r);
        for (int k = 0; k < r; ++k) {
          load(k);
          const int64_t before = inner_steps;
          ahead_loss[k] = run_inner(k, next, settled.cursor.position, step + 1, 0, tau);
          ahead[k] = inner_steps - before;
          overlapped += ahead[k];
          keep(k);
        }
      }
      torch::NoGradGuard ng;
      const bool finite = train::finite_step(piece, loss_sum);
      flat.data().copy_(global);
      if (finite) train::outer_update_slice(outer.optimizer(), flat.data(), piece, flo, fhi, cfg.diloco.outer_lr);
      const double alpha = finite ? cfg.diloco.mixing : 0.0;
      std::vector<torch::Tensor> average;
      if (buffers) {
        std::vector<double> weights(consumed.begin(), consumed.end());
        average = train::average_buffers(flat, torch::stack(rows), weights);
      }
      for (int k = 0; k < r; ++k) {
        local[k].slice(0, flo, fhi).mul_(alpha).add_(flat.data().slice(0, flo, fhi), 1.0 - alpha);
        for (auto& x : since_sync[k]) x += consumed[k];
        since_sync[k][f] = 0;
        if (buffers) {
          flat.restore_buffers(bufs[k]);
          train::take_buffer_average(flat, average, agreed[static_cast<size_t>(k)]);
          bufs[k] = flat.save_buffers();
        }
      }
      if (buffers) {
        gbufs = average;
        flat.restore_buffers(gbufs);  // what an evaluation reads
      }
    } else {
      flat.data().copy_(global);
      const bool finite = train::finite_step(gsum, loss_sum);
      if (finite) outer.apply(flat.data(), gsum, cfg.diloco.outer_lr);
      if (buffers) {
        if (finite && !rows.empty()) {
          const auto all = torch::stack(rows);
          gbufs = train::average_buffers(flat, all, row_weights);
          // Integer and float64 buffers (BatchNorm's count): the first
          // member's, as the all-reduce takes them from member 0.
          int64_t at = 0;
          const auto& e = flat.buffer_entries();
          for (size_t i = 0; i < e.size(); ++i) {
            const int64_t m = e[i].tensor.numel();
            if (!e[i].tensor.is_floating_point() || e[i].tensor.scalar_type() == torch::kFloat64)
              gbufs[i] = all[0].narrow(0, at, m).reshape(e[i].tensor.sizes()).to(e[i].tensor.scalar_type());
            at += m;
          }
        }
        flat.restore_buffers(gbufs);  // the next unit's members start from these; an evaluation reads them
      }
    }
    grad_seconds += seconds_since(g0);
    global.copy_(flat.data());
    cur = settled.cursor;
    owed = settled.owed;
    step += 1;
    samples += total;
    last_loss = loss_sum / static_cast<double>(total);
    run.append_metrics({{"kind", "outer"}, {"step", step}, {"epoch", cur.epoch + static_cast<double>(cur.position) / n},
                        {"samples", total}, {"loss", last_loss}, {"workers", r},
                        {"fragment", F > 1 ? (step - 1) % F : 0}});
    if (settled.last_in_epoch) {
      auto e0 = Clock::now();
      ev = t.evaluate_test();
      eval_seconds += seconds_since(e0);
      json rec = {{"kind", "eval"}, {"step", step}, {"epoch", static_cast<double>(cur.epoch)}};
      rec.update(train::eval_fields(ev));
      run.append_metrics(rec);
      log_info("epoch " + std::to_string(cur.epoch) + ": " + std::to_string(r) + " workers, test loss " +
               std::to_string(ev.loss));
    }
  }
  if (!(cur.position == 0 && step > 0 && ev.samples > 0)) ev = t.evaluate_test();  // a run cut by max_steps
  const double wall = seconds_since(wall0) - eval_seconds;
  json s = {{"mode", "sim-elastic"}, {"sync", "diloco"}, {"steps", step}, {"outer_steps", step},
            {"inner_steps", inner_steps}, {"samples", samples}, {"epochs", cur.epoch},
            {"fragments", static_cast<int64_t>(fragments.size())}, {"inner_steps_overlapped", overlapped},
            {"membership_changes", changes}, {"train_loss", last_loss}, {"batch_policy", "none"},
            {"wall_seconds", wall}, {"gradient_seconds", grad_seconds},
            {"overhead_fraction", grad_seconds > 0 ? (wall - grad_seconds) / grad_seconds : 0.0}};
  s.update(train::eval_fields(ev));
  if (run.enabled()) run.write_summary(s);
  return s;
}

}  // namespace

json run_elastic_sim(train::Trainer& t, const train::TrainerConfig& cfg, const ElasticSimOptions& opt) {
  if (opt.schedule.empty()) throw InvalidInput("elastic simulation needs sim.elastic_schedule, e.g. \"0:1,2:16\"");
  for (const auto& [e, w] : opt.schedule)
    if (w < 1) throw InvalidInput("sim.elastic_schedule: worker counts must be >= 1");
  if (t.diloco()) return run_diloco_sim(t, cfg, opt);
  auto& flat = t.params();
  auto& model = t.model();
  auto& update = *t.optimizer_step();  // clipping, then the optimizer
  const auto& train_set = t.data().train;
  const int64_t n = train_set.size();
  const int64_t b = cfg.loader.batch_size;
  optim::LrSchedule schedule(cfg.lr);
  optim::BatchSizePolicy policy(cfg.batch_policy);
  data::Sampler sampler(n, cfg.loader.order, cfg.loader.seed);
  train::RunDir run(opt.run_dir, false);
  if (run.enabled()) run.write_config(cfg.config_toml);

  data::Cursor cur;
  int64_t step = 0, changes = 0, samples = 0;
  int last_r = 0;
  double grad_seconds = 0, eval_seconds = 0, last_loss = 0;
  train::MetricsWindow window;
  torch::Tensor gsum = torch::zeros_like(flat.grad());
  train::EvalResult ev;
  auto wall0 = Clock::now();
  model.train();
  while (cur.epoch < cfg.train.epochs) {
    const double epoch_now = cur.epoch + static_cast<double>(cur.position) / n;
    const int r = workers_at(opt.schedule, epoch_now);
    if (last_r != 0 && r != last_r) {
      changes += 1;
      run.append_metrics({{"kind", "membership"}, {"step", step}, {"epoch", epoch_now}, {"world", r},
                          {"reason", "schedule"}});
    }
    last_r = r;
    auto head = data::plan_batch(sampler, cur, b, r, 0, cfg.loader.drop_last);
    gsum.zero_();
    double loss = 0;
    auto g0 = Clock::now();
    for (int k = 0; k < r; ++k) {
      auto plan = k == 0 ? head : data::plan_batch(sampler, cur, b, r, k, cfg.loader.drop_last);
      if (plan.ids.empty()) continue;
      auto batch = data::make_train_batch(train_set, t.normalization(), plan.ids, plan.begin.epoch, cfg.loader.augment);
      const double l = t.step().gradient(batch);
      const double share = static_cast<double>(plan.ids.size()) / head.global_size;
      torch::NoGradGuard ng;
      gsum.add_(flat.grad(), share);  // what the weighted all-reduce sums
      loss += share * l;
    }
    grad_seconds += seconds_since(g0);
    auto p = train::policy_step(policy, schedule, update.optimizer(), epoch_now, step, b * r);
    update.apply(flat.data(), gsum, p.lr);
    cur = head.end;
    step += 1;
    samples += head.global_size;
    window.add(loss, head.global_size);
    if (window.steps() >= opt.log_every || head.last_in_epoch) {
      last_loss = window.mean_loss();
      train::StepRecord rec;
      rec.step = step;
      rec.epoch = cur.epoch + static_cast<double>(cur.position) / n;
      rec.samples = samples;
      rec.lr = p.lr;
      rec.lr_multiplier = p.policy.multiplier;
      rec.batch_size = head.global_size;
      rec.workers = r;
      run.append_metrics(train::step_record(rec, window));
      window.reset();
    }
    if (head.last_in_epoch) {
      auto e0 = Clock::now();
      ev = t.evaluate_test();
      eval_seconds += seconds_since(e0);
      window.reset();  // evaluation time is not training throughput
      json rec = {{"kind", "eval"}, {"step", step}, {"epoch", static_cast<double>(cur.epoch)}};
      rec.update(train::eval_fields(ev));
      run.append_metrics(rec);
      log_info("epoch " + std::to_string(cur.epoch) + ": " + std::to_string(r) + " workers, test accuracy " +
               std::to_string(100 * ev.accuracy) + "%");
    }
  }
  const double wall = seconds_since(wall0) - eval_seconds;  // simulation time, evaluation excluded
  json s = {{"mode", "sim-elastic"}, {"steps", step}, {"samples", samples}, {"epochs", cur.epoch},
            {"membership_changes", changes}, {"train_loss", last_loss},
            {"batch_policy", cfg.batch_policy.kind == optim::BatchPolicyKind::None     ? "none"
                             : cfg.batch_policy.kind == optim::BatchPolicyKind::Linear ? "linear"
                                                                                       : "dynamic"},
            {"wall_seconds", wall}, {"gradient_seconds", grad_seconds},
            {"overhead_fraction", grad_seconds > 0 ? (wall - grad_seconds) / grad_seconds : 0.0}};
  s.update(train::eval_fields(ev));
  if (run.enabled()) run.write_summary(s);
  return s;
}

}  // namespace limbo::sim
