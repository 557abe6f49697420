#include "sim/elastic_sim.h"

#include <torch/torch.h>

#include <chrono>

#include "common/error.h"
#include "common/timing.h"
#include "common/log.h"
#include "data/loader.h"
#include "optim/batch_policy.h"
#include "optim/lr_schedule.h"
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

json run_elastic_sim(train::Trainer& t, const train::TrainerConfig& cfg, const ElasticSimOptions& opt) {
  if (opt.schedule.empty()) throw InvalidInput("elastic simulation needs sim.elastic_schedule, e.g. \"0:1,2:16\"");
  for (const auto& [e, w] : opt.schedule)
    if (w < 1) throw InvalidInput("sim.elastic_schedule: worker counts must be >= 1");
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
