#include "train/trainer.h"

#include <dirent.h>
#include <signal.h>
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <fstream>
#include <thread>

#include "common/error.h"
#include "common/files.h"
#include "common/log.h"
#include "common/progress.h"
#include "train/isgd_step.h"
#include "data/tensor_dataset.h"
#include "train/run_dir.h"
#include "train/trainer_run.h"

namespace limbo::train {

models::InputSpec input_spec(const data::Dataset& d) {
  return {d.shape.channels, d.shape.height, d.shape.width, d.num_classes};
}

namespace {

std::string net_namespace(const std::string& pid) {
  char buf[128] = {0};
  const ssize_t n = ::readlink(("/proc/" + pid + "/ns/net").c_str(), buf, sizeof buf - 1);
  return n > 0 ? std::string(buf, static_cast<size_t>(n)) : "";
}

// The file that holds the samples, for messages.
std::string sample_origin(const data::Dataset& d) {
  return d.tensors ? d.tensors->x.origin : d.stream ? d.stream->tokens.origin : d.name;
}

// Said once a process: bf16 autocast without bf16 units still trains, on
// bf16 arithmetic emulated in float32 units.
void warn_no_bf16_once() {
  static bool said = false;
  if (said) return;
  said = true;
  log_warn("train.precision = bf16: this CPU has no bf16 units (neither avx512_bf16 nor amx_bf16 in "
           "/proc/cpuinfo); autocast still runs, on bf16 arithmetic emulated in float32 units, at about "
           "half the speed of fp32 (docs/precision.md); train.precision = fp32 is the faster choice here");
}

data::Normalization choose_normalization(const std::string& mode, const data::Dataset& train) {
  if (mode == "standardize" && train.x_ids)
    throw InvalidInput("data.normalize = \"standardize\" cannot apply to ids: '" + sample_origin(train) +
                       "' reaches the model as int64 ids (data.inputs, or token streams); use "
                       "data.normalize = \"none\", or data.inputs = \"float\"");
  if (mode == "standardize" || (mode == "auto" && !train.tensors && !train.stream))
    return data::compute_normalization(train);
  if (mode == "none" || mode == "auto") return {};
  throw InvalidInput("unknown data.normalize '" + mode + "'; allowed: auto, none, standardize");
}

}  // namespace

// Testing aid (train.testing_die_with_host): SIGKILLs every other process
// of this network namespace, a virtual host of the tests.
void kill_this_host(int sig) {
  const std::string mine = net_namespace("self");
  if (mine.empty() || mine == net_namespace("1"))
    throw InvalidInput("train.testing_die_with_host needs a network namespace of its own (a virtual host)");
  DIR* d = ::opendir("/proc");
  if (!d) return;
  while (dirent* e = ::readdir(d)) {
    const std::string name = e->d_name;
    if (name.empty() || name.find_first_not_of("0123456789") != std::string::npos) continue;
    const pid_t pid = static_cast<pid_t>(std::stol(name));
    if (pid != ::getpid() && net_namespace(name) == mine) ::kill(pid, sig);
  }
  ::closedir(d);
}

Trainer::Trainer(TrainerConfig cfg) : cfg_(std::move(cfg)) {
  threads_ = apply_thread_settings(cfg_.threads);
  splits_ = std::make_shared<data::DatasetSplits>(data::load_dataset(cfg_.source));
  if (splits_->train.size() == 0) throw InvalidInput("the training split is empty");
  norm_ = choose_normalization(cfg_.normalize, splits_->train);
  {
    const auto& tr = splits_->train;
    if (tr.x_ids && !cfg_.loader.augment.empty())
      throw InvalidInput("data.augment crops and mirrors images, but '" + sample_origin(tr) +
                         "' reaches the model as int64 ids (data.inputs, or token streams); remove data.augment");
    cfg_.loader.augment.check_sample_shape(data::sample_shape(tr));
  }
  torch::manual_seed(cfg_.train.seed);
  if (cfg_.model.name != "torchscript" && !data::has_labels(splits_->train))
    throw InvalidInput("model '" + cfg_.model.name + "' is a classifier and needs integer labels; "
                       "float targets need a TorchScript model (model.name = \"torchscript\")");
  model_ = models::make_model(cfg_.model, input_spec(splits_->train));
  flat_ = std::make_unique<optim::FlatParams>(*model_, cfg_.model.channels_last, /*include_frozen=*/false,
                                              /*lazy=*/cfg_.shard_weights);
  step_ = std::make_unique<TrainStep>(*model_, *flat_, cfg_.loss, cfg_.model.channels_last);
  step_->set_testing_delay(cfg_.train.slow_step);
  step_->set_micro_batches(cfg_.train.accumulate);
  if (cfg_.train.precision != "fp32" && cfg_.train.precision != "bf16")
    throw InvalidInput("unknown train.precision '" + cfg_.train.precision + "'; allowed: fp32, bf16");
  step_->set_bf16(cfg_.train.precision == "bf16");
  if (step_->bf16() && !cpu_has_bf16()) warn_no_bf16_once();
  step_->check_data(*splits_, norm_);
  if (cfg_.algorithm != "isgd" && cfg_.algorithm != "sgd" && cfg_.algorithm != "adam" && cfg_.algorithm != "adamw")
    throw InvalidInput("unknown optim.algorithm '" + cfg_.algorithm + "'; allowed: sgd, isgd, adam, adamw" +
                       (cfg_.algorithm.find("isgd") != std::string::npos
                            ? " (ISGD runs on SGD: its extra updates are SGD steps; it is not combined with Adam)"
                            : ""));
  auto opt = cfg_.optimizer;
  opt.algorithm = cfg_.algorithm == "isgd" ? "sgd" : cfg_.algorithm;
  opt_ = std::make_shared<OptimizerStep>(optim::make_optimizer(opt), cfg_.clip_grad_norm);
  schedule_ = std::make_unique<optim::LrSchedule>(cfg_.lr);
  rule_ = std::make_shared<LocalUpdate>(opt_);
  if (cfg_.sync != "step" && cfg_.sync != "diloco")
    throw InvalidInput("unknown elastic.sync '" + cfg_.sync + "'; allowed: step, diloco");
  if (cfg_.sync == "diloco") {
    if (cfg_.algorithm == "isgd")
      throw InvalidInput("elastic.sync = \"diloco\" does not run with optim.algorithm = \"isgd\" (ISGD's extra "
                         "updates act on every synchronous step); use sgd, adam or adamw as the inner optimizer");
    if (cfg_.loader.drop_last)
      throw InvalidInput("elastic.sync = \"diloco\" deals every sample of an epoch (an outer step takes what is "
                         "left); set data.drop_last = false");
    const auto& d = cfg_.diloco;
    if (d.inner_steps < 1) throw InvalidInput("diloco.inner_steps must be at least 1");
    if (d.nesterov && d.outer_momentum <= 0)
      throw InvalidInput("diloco.nesterov = true needs diloco.outer_momentum > 0");
    check_streaming(d, [](const std::string& k) { return "diloco." + k; });
    optim::OptimizerOptions outer;
    outer.algorithm = "sgd";
    outer.momentum = d.outer_momentum;
    outer.nesterov = d.nesterov;
    outer_ = std::make_shared<OptimizerStep>(optim::make_optimizer(outer), 0.0);
    rule_ = std::make_shared<LocalUpdate>(outer_);
  }
  batch_policy_ = std::make_unique<optim::BatchSizePolicy>(cfg_.batch_policy);
  state_.config_toml = cfg_.config_toml;
  if (cfg_.algorithm == "isgd") {
    const int64_t global = cfg_.loader.batch_size * cfg_.loader.world;
    isgd_ = std::make_unique<optim::IsgdController>(
        cfg_.isgd, data::batches_per_epoch(splits_->train.size(), global, cfg_.loader.drop_last, cfg_.loader.world));
  }
}

Trainer::~Trainer() = default;

// Testing aid (train.testing_writer_dies_at): the run directory's writer
// dies at `point` of the job's ending.
void Trainer::writer_dies_at(const char* point) {
  if (cfg_.train.writer_dies_at != point || !session_ || !session_->elastic() || !session_->writer() ||
      session_->took_over())
    return;
  const bool freeze = cfg_.train.die_by_freezing;
  std::fprintf(stderr, "testing: the writer %s at '%s'%s\n", freeze ? "freezes" : "dies", point,
               cfg_.train.die_with_host ? " with its host" : "");
  std::fflush(stderr);
  if (cfg_.train.die_with_host) kill_this_host(freeze ? SIGSTOP : SIGKILL);
  ::kill(::getpid(), freeze ? SIGSTOP : SIGKILL);
}

// After every (re)formation: the loader moves to the new group (and the
// pace of a testing aid, ISGD's window).
void Trainer::reformed(Run& r, const Membership::Established& est) {
  if (cfg_.train.pace_until_workers > 0 || cfg_.train.slow_rank >= 0)
    step_->set_testing_delay((cfg_.train.pace_until_workers == 0 || est.world < cfg_.train.pace_until_workers) &&
                                     (cfg_.train.slow_rank < 0 || est.rank == cfg_.train.slow_rank)
                                 ? cfg_.train.slow_step
                                 : std::chrono::milliseconds(0));
  if (r.loader) r.loader->restart(state_.cursor, est.world, est.rank, paces_ ? state_.step : -1);
  if (outer_steps_) outer_steps_->reformed();
  if (isgd_)  // the control window holds one epoch of the new global batches
    isgd_->set_batches_per_epoch(data::batches_per_epoch(
        r.n, cfg_.loader.batch_size * est.world, cfg_.loader.drop_last, est.world));
}

void Trainer::eval_now(Run& r) {
  auto e0 = Clock::now();
  // Fully sharded: the weights whole on every member (a collective at the
  // same point everywhere; the next step gives them back).
  if (rule_->shards_weights()) r.s.gather_state("evaluation", false);
  r.last_eval = evaluate_test();
  r.last_eval_step = state_.step;
  const double epoch = r.epoch_now(state_.cursor);
  nlohmann::json rec = {{"kind", "eval"}, {"step", state_.step}, {"epoch", epoch},
                         {"train_seconds", r.train_seconds}, {"eval_seconds", seconds_since(e0)}};
  rec.update(eval_fields(r.last_eval));
  r.run_dir.append_metrics(rec);
  char buf[192];
  int n = std::snprintf(buf, sizeof buf, "epoch %.2f step %ld: test loss %.4f", epoch,
                        static_cast<long>(state_.step), r.last_eval.loss);
  if (r.last_eval.tokens)
    n += std::snprintf(buf + n, sizeof buf - n, ", perplexity %.3f", std::exp(r.last_eval.loss));
  if (!std::isnan(r.last_eval.accuracy))
    std::snprintf(buf + n, sizeof buf - n, ", test accuracy %.2f%%", 100 * r.last_eval.accuracy);
  if (r.t.progress) log_info(buf);
}

// One step: batch, gradient, update (through the rule), commit, ISGD's extra
// iterations. Returns false when a distributed rule failed and the group was
// re-formed: the step did not commit and is redone.
bool Trainer::train_step(Run& r) {
  const auto step_start = Clock::now();
  if (r.t.die_at_step > 0 && !r.t.die_in_gather && state_.step == r.t.die_at_step && r.s.rank() == r.t.die_rank &&
      r.s.world() > 1 && r.s.membership_changes() == r.t.die_after_changes) {
    const int sig = r.t.die_by_freezing ? SIGSTOP : SIGKILL;
    std::fprintf(stderr, "testing: rank %d %s starting step %ld\n", r.s.rank(), r.t.die_by_freezing ? "freezes" : "dies",
                 static_cast<long>(state_.step + 1));
    std::fflush(stderr);
    if (r.t.die_without_home) rule_->testing_drop_kept_state();
    if (r.t.die_with_host) kill_this_host(sig);
    ::kill(::getpid(), sig);
  }
  r.batch = r.loader->next();
  auto& batch = r.batch;
  if (!(batch.plan.begin == state_.cursor) && batch.plan.begin.position != 0)
    throw Error("internal: loader out of step with the training cursor");
  r.epoch_progress = r.epoch_now(batch.plan.begin);
  // The policy sees the nominal global batch (b * workers), not the smaller
  // last batch of an epoch, so only membership changes move it.
  auto ps = policy_step(*batch_policy_, *schedule_, optimizer(), r.epoch_progress, state_.step,
                        cfg_.loader.batch_size * r.s.world(),
                        [&](double factor) { rule_->scale_momentum(optimizer(), factor, state_.step); });
  r.policy = ps.policy;
  r.lr = ps.lr;

  // A step that fails in a distributed rule, or is skipped for a gradient
  // that is not finite, must leave no trace; forward moves the buffers
  // (BatchNorm statistics) and the all-reduce scales and sums them in place,
  // so they are kept aside first (they are small).
  std::vector<torch::Tensor> buffers_before;
  if (!flat_->buffer_entries().empty()) buffers_before = flat_->save_buffers();
  StepContext ctx{flat_->data(), flat_->grad(), flat_->grad_with_slot(), 0.0,
                  batch.plan.samples(), batch.plan.global_size, r.lr,
                  state_.step, {}};
  // Between forward and backward the rule may start reducing gradient
  // buckets as backward produces them (elastic.overlap).
  const auto compute_start = Clock::now();
  rule_->before_forward(state_.step);  // fully sharded: the weights gathered whole
  ctx.loss = step_->gradient(batch, [&](double loss) {
    ctx.loss = loss;
    rule_->backward_starts(ctx);
  });
  const double compute = seconds_since(compute_start);
  r.compute_seconds += compute;
  if (paces_) paces_->record(batch.plan.samples(), compute);
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
  auto applied = r.s.apply(ctx, buffers_before);
  if (!applied) return false;  // the group re-formed: the step is redone
  r.res = *applied;
  if (cfg_.train.writer_dies_at == "last_step" && r.s.writer() && r.elastic &&
      (batch.plan.end.epoch >= r.t.epochs || (r.t.max_steps > 0 && state_.step + 1 >= r.t.max_steps)))
    writer_dies_at("last_step");
  if (!r.res.skipped && opt_->clip_norm() > 0) {
    r.norm_sum += opt_->last_norm();
    r.norm_n += 1;
  }
  r.s.commit(r.res, batch.plan.end, buffers_before);
  if (r.t.sample_log && !cfg_.run_dir.empty())
    log_committed_batch(cfg_.run_dir, state_.step, batch.plan,
                        r.log_sampler->epoch_order(batch.plan.begin.epoch), r.s.world());
  if (decision.triggered) {
    auto x0 = Clock::now();
    if (!anchor.defined()) anchor = flat_->data().clone();  // anchor after the update
    IsgdExtraResult ir;
    if (r.t.die_in_isgd) ::kill(::getpid(), SIGKILL);
    try {
      ir = isgd_extra_updates(*step_, *flat_, batch.x, batch.y, *rule_, optimizer(),
                              isgd_->options(), decision.limit, anchor, r.lr);
    } catch (const Error& e) {
      if (!r.elastic || !recoverable(e)) throw;
      // The step itself committed; the extra iterations are a refinement.
      // Members may have applied different numbers of them, so the group
      // re-forms and takes one member's weights (state sync) and goes on.
      log_warn("ISGD's extra iterations after step " + std::to_string(state_.step) +
               " interrupted: " + e.what());
      r.s.reform(std::string("failure during ISGD extra iterations: ") + e.what(), x0, seconds_since(x0));
    }
    if (ir.not_finite)
      log_warn("ISGD's extra iterations after step " + std::to_string(state_.step) + " stopped after " +
               std::to_string(ir.iterations) + ": the batch loss or reduced gradient is not finite");
    isgd_->record_extra(ir.iterations);
    r.isgd_extra_seconds += seconds_since(x0);
    r.run_dir.append_metrics({{"kind", "isgd_batch"}, {"step", state_.step},
                              {"epoch", r.epoch_progress}, {"psi", r.res.loss},
                              {"limit", decision.limit}, {"loss_before", ir.loss_before},
                              {"loss_after", ir.loss_after}, {"iterations", ir.iterations}});
  } else if (isgd_) {
    r.plain_step_seconds += seconds_since(step_start);
    r.plain_steps += 1;
  }
  r.samples_this_run += r.res.global_batch;
  r.last_loss = r.res.loss;
  r.window.add(r.res.loss, r.res.global_batch);
  r.train_seconds += seconds_since(step_start);
  return true;
}

// The metrics line and the progress bar after a committed step.
void Trainer::log_step(Run& r) {
  // At fixed steps (not every log_every steps since the last line), so
  // every member of an elastic job records the same steps, also one that
  // joined mid-window (each host's copy of the records lines up).
  if ((r.window.steps() > 0 && state_.step % r.t.log_every == 0) || r.batch.plan.last_in_epoch) {
    StepRecord rec;
    rec.step = state_.step;
    rec.epoch = r.epoch_now(state_.cursor);
    rec.samples = state_.samples;
    rec.lr = r.lr;
    rec.lr_multiplier = r.policy.multiplier;
    rec.batch_size = r.res.global_batch;
    rec.skipped_steps = state_.skipped_steps;
    if (r.norm_n > 0) rec.grad_norm = r.norm_sum / static_cast<double>(r.norm_n);
    auto j = step_record(rec, r.window);
    r.s.add_pace_fields(j, state_.step);
    r.run_dir.append_metrics(j);
    r.window.reset();
    r.norm_sum = 0;
    r.norm_n = 0;
  }
  if (r.t.progress) {
    char buf[96];
    std::snprintf(buf, sizeof buf, "epoch %ld loss %.4f lr %.4g",
                  static_cast<long>(state_.cursor.epoch), r.last_loss, r.lr);
    r.progress->update(state_.step - std::max<int64_t>(r.resumed_from, 0), buf);
  }
}

// Epoch ends (ISGD statistics, evaluation, checkpoints), periodic work and
// membership changes after a committed step.
void Trainer::after_epoch_and_step(Run& r) {
  const auto& t = r.t;
  const bool last_in_epoch = r.batch.plan.last_in_epoch;
  if (last_in_epoch && isgd_) {
    auto es = isgd_->end_epoch();
    auto num = [](double v) { return std::isnan(v) ? nlohmann::json() : nlohmann::json(v); };
    r.run_dir.append_metrics({{"kind", "isgd_epoch"}, {"epoch", state_.cursor.epoch},
                              {"triggered", es.triggered}, {"extra_iterations", es.extra_iterations},
                              {"window", isgd_->window().capacity()},
                              {"limit", num(es.limit)}, {"mean", num(es.mean)}, {"std", num(es.std)}});
  }
  if (last_in_epoch) {
    const int64_t done = state_.cursor.epoch;
    if (t.eval_every_epochs > 0 && done % t.eval_every_epochs == 0) eval_now(r);
    if (t.checkpoint_every_epochs > 0 && done % t.checkpoint_every_epochs == 0) {
      r.s.checkpoint_now("epoch " + std::to_string(done));
    }
    r.window.reset();  // exclude eval/checkpoint time from throughput
  }
  if (t.eval_every_steps > 0 && state_.step % t.eval_every_steps == 0 &&
      r.last_eval_step != state_.step) {
    eval_now(r);
    r.window.reset();
  }
  if (t.checkpoint_every_steps > 0 && state_.step % t.checkpoint_every_steps == 0) {
    if (t.die_in_gather && t.die_at_step == state_.step && r.s.rank() == t.die_rank && r.s.world() > 1 &&
        r.s.membership_changes() == t.die_after_changes) {
      std::fprintf(stderr, "testing: rank %d dies as the checkpoint after step %ld is gathered\n", r.s.rank(),
                   static_cast<long>(state_.step));
      std::fflush(stderr);
      if (t.die_without_home) rule_->testing_drop_kept_state();
      ::kill(::getpid(), SIGKILL);
    }
    r.s.checkpoint_now("step " + std::to_string(state_.step));
  }
  if (r.s.after_step(r.epoch_now(state_.cursor), state_.step % 10 == 0 || last_in_epoch)) {
    r.left = true;
    return;
  }
  if (t.pause_at_step > 0 && state_.step == t.pause_at_step) {
    std::fprintf(stderr, "paused at step %ld\n", static_cast<long>(state_.step));
    std::fflush(stderr);
    for (;;) ::pause();
  }
}

nlohmann::json Trainer::summary(Run& r) {
  auto num = [](double v) { return std::isnan(v) ? nlohmann::json() : nlohmann::json(v); };
  nlohmann::json s = {
      {"train_loss", num(r.last_loss)},
      {"epochs", r.epoch_now(state_.cursor)},
      {"steps", state_.step},
      {"samples", state_.samples},
      {"skipped_steps", state_.skipped_steps},
      {"wall_seconds", seconds_since(r.wall_start)},
      {"train_seconds", r.train_seconds},
      {"samples_per_second", r.train_seconds > 0 ? r.samples_this_run / r.train_seconds : 0.0},
      {"model", cfg_.model.name},
      {"loss", loss_name(cfg_.loss)},
      {"parameters", models::parameter_count(*model_)},
      {"trainable_parameters", flat_->numel()},
      {"dataset", cfg_.source.dataset},
      {"update_rule", rule_->name()},
      {"threads", threads_.intra_op},
      {"blas_threads", threads_.blas},
      {"blas", threads_.blas_library},
      {"resumed_from_step", r.resumed_from >= 0 ? nlohmann::json(r.resumed_from) : nlohmann::json()}};
  s.update(eval_fields(r.last_eval));
  if (isgd_) {
    s["isgd_triggered_batches"] = isgd_->total_triggered();
    s["isgd_extra_iterations"] = isgd_->total_extra();
    s["isgd_extra_seconds"] = r.isgd_extra_seconds;
    s["isgd_plain_step_seconds_mean"] =
        r.plain_steps > 0 ? nlohmann::json(r.plain_step_seconds / r.plain_steps) : nlohmann::json();
  }
  s["algorithm"] = cfg_.algorithm;
  s["sync"] = cfg_.sync;
  if (!outer_steps_) {
    s["compute_seconds"] = r.compute_seconds;
    s["compute_share"] = r.train_seconds > 0 ? r.compute_seconds / r.train_seconds : 0.0;
  }
  if (outer_steps_) s.update(outer_steps_->summary());
  if (auto rs = rule_->summary(); !rs.empty()) s["communication"] = rs;
  if (r.elastic) {
    s["membership_changes"] = r.s.membership_changes();
    s["recovery_seconds"] = r.s.recoveries();
    s["workers"] = r.s.world();
  }
  return s;
}

namespace {
// FNV-1a over a tensor's bytes (contiguous, on the CPU), from `h`.
uint64_t bytes_hash(const torch::Tensor& t, uint64_t h = 1469598103934665603ULL) {
  const auto c = t.contiguous();
  const auto* p = static_cast<const unsigned char*>(c.data_ptr());
  const size_t n = static_cast<size_t>(c.numel()) * c.element_size();
  for (size_t i = 0; i < n; ++i) h = (h ^ p[i]) * 1099511628211ULL;
  return h;
}
}  // namespace

double Trainer::buffer_fingerprint() const {
  double sum = 0;
  for (const auto& b : flat_->buffer_entries()) sum += b.tensor.to(torch::kFloat64).sum().item<double>();
  return sum;
}

std::string Trainer::optimizer_fingerprint() {
  std::string out = std::to_string(rule_optimizer()->optimizer().steps());
  char buf[32];
  for (const auto& t : rule_optimizer()->optimizer().state()) {
    std::snprintf(buf, sizeof buf, " %.17g", t.to(torch::kFloat64).sum().item<double>());
    out += buf;
  }
  return out;
}

nlohmann::json Trainer::run() {
  const auto& t = cfg_.train;
  const bool elastic = membership_ != nullptr;
  const std::string ckpt = cfg_.run_dir.empty() ? "" : cfg_.run_dir + "/checkpoint.pt";
  if (!elastic && !ckpt.empty() && file_exists(ckpt) && !t.resume)
    throw InvalidInput("run directory '" + cfg_.run_dir +
                       "' already holds a checkpoint; pass --resume to continue that run, or "
                       "choose another --run-dir");
  SessionParts parts{*model_, *flat_, rule_optimizer(), *batch_policy_, isgd_.get(), state_, cfg_.run_dir,
                     t.max_nonfinite_steps, {}, {}, false, {}, {}, {}};
  if (outer_) diloco_state_hooks(parts);
  session_ = std::make_unique<Session>(std::move(parts), rule_, std::move(membership_), t.resume,
                                       static_cast<int>(cfg_.loader.world), static_cast<int>(cfg_.loader.rank));
  Session& session = *session_;
  int64_t resumed_from = -1;
  if (t.resume) {
    session.resume();
    resumed_from = state_.step;
  }
  Run r(t, session);
  r.resumed_from = resumed_from;
  const auto& train_set = splits_->train;
  r.n = train_set.size();
  auto loader_opt = cfg_.loader;
  loader_opt.seed = t.seed;
  if (!outer_)  // DiLoCo's inner steps build their batches from the outer step's plan
    r.loader = std::make_unique<data::BatchLoader>(
        std::shared_ptr<const data::Dataset>(splits_, &splits_->train), norm_, loader_opt,
        state_.cursor);
  const int64_t global_batch = loader_opt.batch_size * loader_opt.world;
  const int64_t per_epoch = outer_ ? data::batches_per_epoch(r.n, global_batch * cfg_.diloco.unit_steps(), false)
                                   : data::batches_per_epoch(r.n, global_batch, loader_opt.drop_last, loader_opt.world);
  r.total_steps = t.epochs * per_epoch;
  if (t.max_steps > 0) r.total_steps = std::min(r.total_steps, t.max_steps);
  session.set_on_reform([this, &r](const Membership::Established& est) { reformed(r, est); });
  if (paces_ && !outer_) {
    session.set_paces(paces_);
    r.loader->set_paces(paces_);
  }
  if (outer_) {
    OuterSteps::Options oo;
    oo.diloco = cfg_.diloco;
    oo.batch = cfg_.loader.batch_size;
    oo.samples = r.n;
    oo.order = cfg_.loader.order;
    oo.seed = cfg_.train.seed;
    oo.max_steps = t.max_steps;
    outer_steps_ = std::make_unique<OuterSteps>(session, *flat_, rule_, outer_, oo);
    outer_steps_->set_inner(&opt_->optimizer());
  }

  log_info("training " + cfg_.model.name + " (" + std::to_string(models::parameter_count(*model_)) +
           " parameters) on " + train_set.name + " (" + std::to_string(r.n) + " samples), batch " +
           std::to_string(global_batch) + ", " + std::to_string(t.epochs) + " epochs, " +
           std::to_string(threads_.intra_op) + " threads, BLAS " + threads_.blas_library +
           (outer_ ? ", DiLoCo: " + std::to_string(cfg_.diloco.inner_steps) + " inner steps an outer step" +
                         (cfg_.diloco.fragments > 1
                              ? " in " + std::to_string(cfg_.diloco.fragments) + " fragments (one synced every " +
                                    std::to_string(cfg_.diloco.unit_steps()) + ", overlapping " +
                                    std::to_string(cfg_.diloco.overlap_steps) + ")"
                              : "")
                   : ""));

  try {
    session.start();
  } catch (const CompletedElsewhere& e) {
    log_warn(std::string(e.what()) + "; nothing left to train");
    return {{"left", true}, {"completed_elsewhere", true}, {"steps", state_.step}};
  }
  r.run_dir.write_config(cfg_.config_toml);
  // A fixed group: the loader cuts its batches by the group's shares from
  // the first step (an elastic one restarts it at every formation), and a
  // resumed member other than 0 took member 0's cursor in start().
  if ((paces_ || t.resume) && !outer_ && !elastic)
    r.loader->restart(state_.cursor, session.world(), session.rank(), state_.step);
  if (t.resume) r.resumed_from = state_.step;
  r.log_sampler = std::make_unique<data::Sampler>(r.n, loader_opt.order, loader_opt.seed);
  r.progress = std::make_unique<Progress>("train", r.total_steps, stderr);
  model_->train();
  r.window.reset();

  for (;;) {
    if (state_.cursor.epoch >= t.epochs) break;
    if (t.max_steps > 0 && state_.step >= t.max_steps) break;
    try {
      if (!(outer_ ? outer_step(r) : train_step(r))) continue;
      log_step(r);
      after_epoch_and_step(r);
    } catch (const CompletedElsewhere& e) {
      // The members that completed write the final checkpoint and summary.
      // (It does not leave: it took no part in the ending.)
      log_warn(std::string(e.what()) + " (at step " + std::to_string(state_.step) +
               "); this member ends without redoing its step");
      return {{"left", true}, {"completed_elsewhere", true}, {"steps", state_.step}};
    }
    if (r.left) return {{"left", true}, {"steps", state_.step}};
  }
  // Sharded state: whole for the final checkpoint where it is written (and
  // everywhere for the sample log's fingerprints, a testing aid). A failure
  // there re-forms, and training may have completed elsewhere meanwhile.
  if (!session.gather_final((session.writer() && !ckpt.empty()) || t.sample_log))
    return {{"left", true}, {"completed_elsewhere", true}, {"steps", state_.step}};
  if (elastic) {
    if (cfg_.train.writer_dies_at == "slow_done") {
      std::fprintf(stderr, "testing: training ended; this member publishes it in 3 s\n");
      std::fflush(stderr);
      std::this_thread::sleep_for(std::chrono::seconds(3));
    }
    session.training_done();
    writer_dies_at("done");
  }
  if (t.sample_log && !cfg_.run_dir.empty()) {
    // Testing aid: every member records a fingerprint of its final weights.
    // The bits of the weights, the buffers and the optimizer state (a
    // hash of their bytes), then readable sums to full precision.
    uint64_t bits = bytes_hash(flat_->data());
    for (const auto& b : flat_->buffer_entries()) bits = bytes_hash(b.tensor, bits);
    for (const auto& st : rule_optimizer()->optimizer().state()) bits = bytes_hash(st, bits);
    char line[160];
    std::snprintf(line, sizeof line, "%ld %016llx %.17g %.17g %.17g ", static_cast<long>(state_.step),
                  static_cast<unsigned long long>(bits), flat_->data().sum().item<double>(),
                  flat_->data().pow(2).sum().item<double>(), buffer_fingerprint());
    std::ofstream(cfg_.run_dir + "/final-" + std::to_string(::getpid()) + ".txt")
        << line << optimizer_fingerprint() << "\n";
  }
  writer_dies_at("eval");
  if (r.last_eval_step != state_.step) eval_now(r);
  if (!session.writes_final()) return summary(r);
  if (session.took_over()) {
    nlohmann::json rec = {{"kind", "eval"}, {"step", state_.step}, {"epoch", r.epoch_now(state_.cursor)},
                          {"train_seconds", r.train_seconds}, {"taken_over", true}};
    rec.update(eval_fields(r.last_eval));
    r.run_dir.append_metrics(rec);
  }
  writer_dies_at("checkpoint");
  if (cfg_.train.writer_dies_at == "slow" && session.writer() && elastic) {
    std::fprintf(stderr, "testing: the writer takes 8 s before its final checkpoint\n");
    std::fflush(stderr);
    std::this_thread::sleep_for(std::chrono::seconds(8));
  }
  if (cfg_.train.writer_dies_at == "hang" && session.writer() && elastic) {
    std::fprintf(stderr, "testing: the writer hangs before its final checkpoint\n");
    std::fflush(stderr);
    for (;;) ::pause();
  }
  session.checkpoint("final");
  if (t.progress) {
    char buf[96];
    if (std::isnan(r.last_eval.accuracy)) std::snprintf(buf, sizeof buf, "test loss %.4f", r.last_eval.loss);
    else std::snprintf(buf, sizeof buf, "test accuracy %.2f%%", 100 * r.last_eval.accuracy);
    r.progress->finish(buf);
  }
  writer_dies_at("summary");
  auto s = summary(r);
  r.run_dir.write_summary(s);
  session.final_written();
  return s;
}

}  // namespace limbo::train
