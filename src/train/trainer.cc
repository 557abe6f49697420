#include "train/trainer.h"

#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <fstream>

#include "common/error.h"
#include "common/files.h"
#include "common/log.h"
#include "common/progress.h"
#include "train/evaluate.h"
#include "train/isgd_step.h"
#include "train/run_dir.h"

namespace limbo::train {
namespace {

using Clock = std::chrono::steady_clock;
double seconds_since(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

}  // namespace

models::InputSpec input_spec(const data::Dataset& d) {
  return {d.shape.channels, d.shape.height, d.shape.width, d.num_classes};
}

Trainer::Trainer(TrainerConfig cfg) : cfg_(std::move(cfg)) {
  threads_ = apply_thread_settings(cfg_.threads);
  splits_ = std::make_shared<data::DatasetSplits>(data::load_dataset(cfg_.source));
  if (splits_->train.size() == 0) throw InvalidInput("the training split is empty");
  norm_ = data::compute_normalization(splits_->train);
  torch::manual_seed(cfg_.train.seed);
  model_ = models::make_model(cfg_.model, input_spec(splits_->train));
  flat_ = std::make_unique<optim::FlatParams>(*model_, cfg_.model.channels_last);
  sgd_ = std::make_shared<optim::Sgd>(cfg_.sgd);
  schedule_ = std::make_unique<optim::LrSchedule>(cfg_.lr);
  rule_ = std::make_shared<LocalUpdate>(sgd_);
  batch_policy_ = std::make_unique<optim::BatchSizePolicy>(cfg_.batch_policy);
  state_.config_toml = cfg_.config_toml;
  if (cfg_.algorithm == "isgd") {
    const int64_t global = cfg_.loader.batch_size * cfg_.loader.world;
    isgd_ = std::make_unique<optim::IsgdController>(
        cfg_.isgd, data::batches_per_epoch(splits_->train.size(), global, cfg_.loader.drop_last));
  } else if (cfg_.algorithm != "sgd") {
    throw InvalidInput("unknown optim.algorithm '" + cfg_.algorithm + "'; allowed: sgd, isgd");
  }
  if (!cfg_.run_dir.empty()) checkpoint_path_ = cfg_.run_dir + "/checkpoint.pt";
}

void Trainer::checkpoint(const std::string& why) {
  if (checkpoint_path_.empty() || !writer_) return;
  if (isgd_) state_.extra["isgd"] = isgd_->state();
  state_.extra["batch_policy"] = batch_policy_->state();
  save_checkpoint(checkpoint_path_, *model_, *sgd_, state_);
  log_debug("checkpoint (" + why + ") at step " + std::to_string(state_.step));
}

nlohmann::json Trainer::run() {
  const auto& t = cfg_.train;
  const auto wall_start = Clock::now();
  int64_t resumed_from = -1;
  const bool elastic = membership_ != nullptr;
  if (!elastic && !checkpoint_path_.empty() && file_exists(checkpoint_path_) && !t.resume)
    throw InvalidInput("run directory '" + cfg_.run_dir +
                       "' already holds a checkpoint; pass --resume to continue that run, or "
                       "choose another --run-dir");
  if (t.resume) {
    if (checkpoint_path_.empty() || !file_exists(checkpoint_path_))
      throw InvalidInput("--resume: no checkpoint at '" + checkpoint_path_ + "'");
    state_ = load_checkpoint(checkpoint_path_, *model_, sgd_.get());
    state_.config_toml = cfg_.config_toml;
    if (auto bp = state_.extra.find("batch_policy"); bp != state_.extra.end())
      batch_policy_->load_state(bp->second);
    if (isgd_) {
      auto it = state_.extra.find("isgd");
      if (it == state_.extra.end())
        throw InvalidInput("--resume: checkpoint '" + checkpoint_path_ +
                           "' was written without ISGD state (optim.algorithm differs?)");
      isgd_->load_state(it->second);
    }
    resumed_from = state_.step;
    log_info("resumed from step " + std::to_string(state_.step) + " (epoch " +
             std::to_string(state_.cursor.epoch) + ", position " +
             std::to_string(state_.cursor.position) + ")");
  }
  RunDir run_dir(cfg_.run_dir, t.resume || elastic);

  const auto& train_set = splits_->train;
  const int64_t n = train_set.size();
  auto loader_opt = cfg_.loader;
  loader_opt.seed = t.seed;
  data::BatchLoader loader(std::shared_ptr<const data::Dataset>(splits_, &splits_->train), norm_,
                           loader_opt, state_.cursor);
  const int64_t global_batch = loader_opt.batch_size * loader_opt.world;
  const int64_t per_epoch = data::batches_per_epoch(n, global_batch, loader_opt.drop_last);
  int64_t total_steps = t.epochs * per_epoch;
  if (t.max_steps > 0) total_steps = std::min(total_steps, t.max_steps);

  log_info("training " + cfg_.model.name + " (" + std::to_string(models::parameter_count(*model_)) +
           " parameters) on " + train_set.name + " (" + std::to_string(n) + " samples), batch " +
           std::to_string(global_batch) + ", " + std::to_string(t.epochs) + " epochs, " +
           std::to_string(threads_.intra_op) + " threads, BLAS " + threads_.blas_library);

  int world = loader_opt.world;
  SyncTargets targets{flat_->data(), *sgd_, state_, *batch_policy_, isgd_.get()};
  int64_t membership_changes = 0;
  nlohmann::json recoveries = nlohmann::json::array();
  nlohmann::json pending_event;  // a change whose first completed step is still to come
  Clock::time_point pending_since;
  bool left = false;
  // (Re)joins the group: new world/rank, newest state everywhere, loader moved.
  auto reform = [&](const std::string& reason, Clock::time_point detected, double detection) {
    auto est = membership_->establish(targets, reason);
    world = est.world;
    writer_ = est.rank == 0;
    run_dir.set_writer(writer_);
    loader.restart(state_.cursor, world, est.rank);
    pending_event = est.event;
    pending_event["detection_seconds"] = detection;
    pending_since = detected;
    log_info("membership round " + std::to_string(est.event["round"].get<int64_t>()) + ": " +
             std::to_string(world) + " workers, rank " + std::to_string(est.rank) + " (" + reason +
             ")");
  };
  if (elastic) reform("start", Clock::now(), 0.0);
  else rule_->start(flat_->data());
  run_dir.write_config(cfg_.config_toml);
  data::Sampler log_sampler(n, loader_opt.order, loader_opt.seed);
  Progress progress("train", total_steps, stderr);
  model_->train();
  EvalResult last_eval;
  int64_t last_eval_step = -1;
  double train_seconds = 0, window_loss = 0, last_loss = NAN;
  int64_t window_steps = 0, window_samples = 0, samples_this_run = 0;
  double isgd_extra_seconds = 0, plain_step_seconds = 0;
  int64_t plain_steps = 0;
  auto window_start = Clock::now();

  auto do_eval = [&] {
    auto e0 = Clock::now();
    last_eval = evaluate(*model_, splits_->test, norm_);
    last_eval_step = state_.step;
    double epoch = state_.cursor.epoch + static_cast<double>(state_.cursor.position) / n;
    run_dir.append_metrics({{"kind", "eval"}, {"step", state_.step}, {"epoch", epoch},
                            {"test_loss", last_eval.loss}, {"test_accuracy", last_eval.accuracy},
                            {"train_seconds", train_seconds}, {"eval_seconds", seconds_since(e0)}});
    char buf[160];
    std::snprintf(buf, sizeof buf, "epoch %.2f step %ld: test loss %.4f, test accuracy %.2f%%",
                  epoch, static_cast<long>(state_.step), last_eval.loss, 100 * last_eval.accuracy);
    if (t.progress) log_info(buf);
  };

  for (;;) {
    if (state_.cursor.epoch >= t.epochs) break;
    if (t.max_steps > 0 && state_.step >= t.max_steps) break;
    auto step_start = Clock::now();
    data::Batch batch = loader.next();
    if (!(batch.plan.begin == state_.cursor) && batch.plan.begin.position != 0)
      throw Error("internal: loader out of step with the training cursor");
    const double epoch_progress =
        batch.plan.begin.epoch + static_cast<double>(batch.plan.begin.position) / n;
    // The policy sees the nominal global batch (b * workers), not the smaller
    // last batch of an epoch, so only membership changes move it.
    auto policy = batch_policy_->step(state_.step, loader_opt.batch_size * world);
    if (policy.changed && policy.momentum_factor != 1.0) sgd_->scale_buffer(policy.momentum_factor);
    const double lr = schedule_->lr(epoch_progress, state_.step) * policy.multiplier;

    flat_->zero_grad();
    if (cfg_.model.channels_last) batch.x = batch.x.contiguous(at::MemoryFormat::ChannelsLast);
    auto logits = model_->forward(batch.x);
    auto loss = torch::nn::functional::cross_entropy(logits, batch.y);
    loss.backward();
    StepContext ctx{flat_->data(), flat_->grad(), flat_->grad_with_slot(), loss.item<double>(),
                    static_cast<int64_t>(batch.plan.ids.size()), batch.plan.global_size, lr,
                    state_.step, {}};
    optim::IsgdController::Decision decision;
    torch::Tensor anchor;
    if (isgd_) {
      ctx.before_update = [&](double global_loss) {
        decision = isgd_->observe(global_loss);
        // The anchor is copied only for batches that trigger (known before the update).
        if (decision.triggered && isgd_->options().anchor == optim::IsgdAnchor::BeforeUpdate)
          anchor = flat_->data().clone();
      };
    }
    StepResult res;
    auto apply_start = Clock::now();
    try {
      res = rule_->apply(ctx);
    } catch (const Error& e) {
      const bool recoverable = dynamic_cast<const PeerFailure*>(&e) || dynamic_cast<const Timeout*>(&e);
      if (!elastic || !recoverable) throw;
      // The step did not commit here: re-form, take the newest state, redo.
      log_warn(std::string("step ") + std::to_string(state_.step + 1) + " failed: " + e.what());
      reform(std::string("failure: ") + e.what(), apply_start, seconds_since(apply_start));
      continue;
    }
    // Commit: from here this step counts (state sync takes the newest step).
    state_.step += 1;
    state_.samples += res.global_batch;
    state_.cursor = batch.plan.end;
    if (t.sample_log && !cfg_.run_dir.empty()) {
      // Every member logs each step it commits (a step may commit on several
      // members; readers de-duplicate by step number).
      const auto& order = log_sampler.epoch_order(batch.plan.begin.epoch);
      std::string line = std::to_string(state_.step) + " " + std::to_string(batch.plan.begin.epoch);
      for (int64_t i = 0; i < batch.plan.global_size; ++i)
        line += " " + std::to_string(order[batch.plan.begin.position + i]);
      std::ofstream(cfg_.run_dir + "/samples-" + std::to_string(::getpid()) + ".txt", std::ios::app)
          << line << "\n";
    }
    if (!pending_event.is_null()) {
      pending_event["first_step_seconds"] = seconds_since(pending_since);
      if (pending_event["reason"] != "start") {
        membership_changes += 1;
        recoveries.push_back(pending_event["first_step_seconds"]);
      }
      run_dir.append_metrics(pending_event);
      pending_event = nullptr;
    }
    if (decision.triggered) {
      auto x0 = Clock::now();
      if (!anchor.defined()) anchor = flat_->data().clone();  // anchor after the update
      auto r = isgd_extra_updates(*model_, *flat_, batch.x, batch.y, *rule_, *sgd_,
                                  isgd_->options(), decision.limit, anchor, lr);
      isgd_->record_extra(r.iterations);
      isgd_extra_seconds += seconds_since(x0);
      run_dir.append_metrics({{"kind", "isgd_batch"}, {"step", state_.step},
                              {"epoch", epoch_progress}, {"psi", res.loss},
                              {"limit", decision.limit}, {"loss_before", r.loss_before},
                              {"loss_after", r.loss_after}, {"iterations", r.iterations}});
    } else if (isgd_) {
      plain_step_seconds += seconds_since(step_start);
      plain_steps += 1;
    }

    samples_this_run += res.global_batch;
    last_loss = res.loss;
    window_loss += res.loss;
    window_steps += 1;
    window_samples += res.global_batch;
    train_seconds += seconds_since(step_start);

    if (window_steps >= t.log_every || batch.plan.last_in_epoch) {
      double secs = seconds_since(window_start);
      double epoch_now = state_.cursor.epoch + static_cast<double>(state_.cursor.position) / n;
      run_dir.append_metrics({{"kind", "train"}, {"step", state_.step}, {"epoch", epoch_now},
                              {"loss", window_loss / window_steps}, {"lr", lr},
                              {"lr_multiplier", policy.multiplier},
                              {"batch_size", res.global_batch},
                              {"samples_per_second", secs > 0 ? window_samples / secs : 0.0}});
      window_loss = 0;
      window_steps = 0;
      window_samples = 0;
      window_start = Clock::now();
    }
    if (t.progress) {
      char buf[96];
      std::snprintf(buf, sizeof buf, "epoch %ld loss %.4f lr %.4g",
                    static_cast<long>(state_.cursor.epoch), last_loss, lr);
      progress.update(state_.step - std::max<int64_t>(resumed_from, 0), buf);
    }
    if (batch.plan.last_in_epoch && isgd_) {
      auto es = isgd_->end_epoch();
      auto num = [](double v) { return std::isnan(v) ? nlohmann::json() : nlohmann::json(v); };
      run_dir.append_metrics({{"kind", "isgd_epoch"}, {"epoch", state_.cursor.epoch},
                              {"triggered", es.triggered}, {"extra_iterations", es.extra_iterations},
                              {"limit", num(es.limit)}, {"mean", num(es.mean)}, {"std", num(es.std)}});
    }
    if (batch.plan.last_in_epoch) {
      const int64_t done = state_.cursor.epoch;
      if (t.eval_every_epochs > 0 && done % t.eval_every_epochs == 0) do_eval();
      if (t.checkpoint_every_epochs > 0 && done % t.checkpoint_every_epochs == 0)
        checkpoint("epoch " + std::to_string(done));
      window_start = Clock::now();  // exclude eval/checkpoint time from throughput
    }
    if (t.eval_every_steps > 0 && state_.step % t.eval_every_steps == 0 &&
        last_eval_step != state_.step) {
      do_eval();
      window_start = Clock::now();
    }
    if (t.checkpoint_every_steps > 0 && state_.step % t.checkpoint_every_steps == 0)
      checkpoint("step " + std::to_string(state_.step));
    if (elastic && writer_ && (state_.step % 10 == 0 || batch.plan.last_in_epoch))
      membership_->publish_progress(state_.cursor.epoch +
                                    static_cast<double>(state_.cursor.position) / n);
    if (elastic && membership_->change_agreed()) {
      if (membership_->leaving()) {
        membership_->leave();
        left = true;
        log_info("leaving the job after step " + std::to_string(state_.step));
        break;
      }
      reform("membership change agreed after step " + std::to_string(state_.step), Clock::now(), 0.0);
    }
    if (t.pause_at_step > 0 && state_.step == t.pause_at_step) {
      std::fprintf(stderr, "paused at step %ld\n", static_cast<long>(state_.step));
      std::fflush(stderr);
      for (;;) ::pause();
    }
  }
  if (left) {
    nlohmann::json s = {{"left", true}, {"steps", state_.step}};
    return s;
  }
  if (elastic) membership_->leave();  // done: not a failure for the coordinator
  if (t.sample_log && !cfg_.run_dir.empty()) {
    // Testing aid: every member records a fingerprint of its final weights.
    std::ofstream(cfg_.run_dir + "/final-" + std::to_string(::getpid()) + ".txt")
        << state_.step << " " << flat_->data().sum().item<double>() << " "
        << flat_->data().pow(2).sum().item<double>() << "\n";
  }
  if (last_eval_step != state_.step) do_eval();
  checkpoint("final");
  if (t.progress) {
    char buf[96];
    std::snprintf(buf, sizeof buf, "test accuracy %.2f%%", 100 * last_eval.accuracy);
    progress.finish(buf);
  }

  nlohmann::json summary = {
      {"test_accuracy", last_eval.accuracy},
      {"test_loss", last_eval.loss},
      {"train_loss", std::isnan(last_loss) ? nlohmann::json() : nlohmann::json(last_loss)},
      {"epochs", state_.cursor.epoch + static_cast<double>(state_.cursor.position) / n},
      {"steps", state_.step},
      {"samples", state_.samples},
      {"wall_seconds", seconds_since(wall_start)},
      {"train_seconds", train_seconds},
      {"samples_per_second", train_seconds > 0 ? samples_this_run / train_seconds : 0.0},
      {"model", cfg_.model.name},
      {"parameters", models::parameter_count(*model_)},
      {"dataset", cfg_.source.dataset},
      {"update_rule", rule_->name()},
      {"threads", threads_.intra_op},
      {"blas_threads", threads_.blas},
      {"blas", threads_.blas_library},
      {"resumed_from_step", resumed_from >= 0 ? nlohmann::json(resumed_from) : nlohmann::json()}};
  if (isgd_) {
    summary["isgd_triggered_batches"] = isgd_->total_triggered();
    summary["isgd_extra_iterations"] = isgd_->total_extra();
    summary["isgd_extra_seconds"] = isgd_extra_seconds;
    summary["isgd_plain_step_seconds_mean"] =
        plain_steps > 0 ? nlohmann::json(plain_step_seconds / plain_steps) : nlohmann::json();
  }
  summary["algorithm"] = cfg_.algorithm;
  if (elastic) {
    summary["membership_changes"] = membership_changes;
    summary["recovery_seconds"] = recoveries;
    summary["workers"] = world;
  }
  run_dir.write_summary(summary);
  return summary;
}

}  // namespace limbo::train
