#include "train/schema.h"

#include <filesystem>

#include <ctime>

#include "common/error.h"
#include "data/sampler.h"
#include "models/net.h"

namespace limbo::train {
namespace {

KeySpec S(std::string key, std::string def, std::vector<std::string> choices, std::string doc) {
  KeySpec k;
  k.key = std::move(key);
  k.type = ValueType::String;
  k.def = std::move(def);
  k.choices = std::move(choices);
  k.doc = std::move(doc);
  return k;
}
KeySpec I(std::string key, int64_t def, std::optional<double> min, std::optional<double> max,
          std::string doc) {
  KeySpec k;
  k.key = std::move(key);
  k.type = ValueType::Int;
  k.def = def;
  k.min = min;
  k.max = max;
  k.doc = std::move(doc);
  return k;
}
KeySpec F(std::string key, double def, std::optional<double> min, std::optional<double> max,
          std::string doc, bool min_open = false, bool max_open = false) {
  KeySpec k;
  k.key = std::move(key);
  k.type = ValueType::Float;
  k.def = def;
  k.min = min;
  k.max = max;
  k.min_open = min_open;
  k.max_open = max_open;
  k.doc = std::move(doc);
  return k;
}
KeySpec B(std::string key, bool def, std::string doc) {
  KeySpec k;
  k.key = std::move(key);
  k.type = ValueType::Bool;
  k.def = def;
  k.doc = std::move(doc);
  return k;
}

}  // namespace

std::shared_ptr<const Schema> train_schema() {
  static const std::shared_ptr<const Schema> schema = [] {
    auto s = std::make_shared<Schema>();
    s->add(S("model.name", "lenet", models::model_names(),
             "model architecture; torchscript = your own module saved with torch.jit.save "
             "(model.path)"));
    s->add(S("model.path", "", {}, "torchscript: the file written by torch.jit.save"));
    s->add(S("model.loss", "cross_entropy", {"cross_entropy", "mse", "module"},
             "cross_entropy: outputs [B, C, ...] against int labels [B, ...]; mse: outputs "
             "against float targets of the same shape; module: the TorchScript module's "
             "forward(x, y) returns the loss (accuracy from its predict(x), if any)"));
    s->add(I("model.width", 256, 1, 1 << 16, "mlp: hidden units per layer"));
    s->add(I("model.classes", 0, 0, 1 << 24,
             "outputs for class labels; 0 = the dataset's (tensors: 1 + the largest label, refused when a "
             "label below it never occurs in training: a stray label); a label outside is an error naming "
             "the file and sample"));
    s->add(I("model.depth", 2, 0, 64, "mlp: number of hidden layers"));
    s->add(B("model.channels_last", true,
             "keep convolution weights and inputs in channels-last memory order (faster oneDNN "
             "convolutions on CPU; same results up to rounding)"));

    s->add(S("data.dataset", "fashion-mnist", {"fashion-mnist", "mnist", "cifar10", "synthetic", "tensors", "tokens"},
             "dataset; tensors = your own arrays in data.path: train.safetensors and "
             "test.safetensors (tensors x, y), or train_x.npy, train_y.npy, test_x.npy, "
             "test_y.npy; tokens = language-model token streams in data.path: train.npy and val.npy "
             "(1-D integer ids; or .safetensors, or shards train-00000-of-0000N.npy ...), cut into "
             "windows of data.context tokens"));
    s->add(I("data.context", 0, 0, 1 << 20,
             "tokens: tokens per sample; sample x = s[o : o+T], targets y = s[o+1 : o+T+1]; training "
             "windows move with (train.seed, epoch), validation windows are fixed"));
    s->add(I("data.vocab", 0, 0, 1 << 30,
             "tokens: token ids lie in [0, vocab), one outside is an error naming the file and position; "
             "0 = model.classes, or 1 + the largest token when that is 0 too"));
    s->add(S("data.normalize", "auto", {"auto", "none", "standardize"},
             "input normalisation: standardize = per-channel mean/std of the training split; "
             "auto = standardize for the built-in image datasets, none for tensors"));
    s->add(S("data.path", "", {}, "folder with the dataset files; empty = the dataset's default "
                                  "(/usr/share/datasets/fashion-mnist for fashion-mnist)"));
    s->add(I("data.batch_size", 64, 1, 1 << 16, "mini-batch size (per worker)"));
    s->add(S("data.order", "auto", {"auto", "shuffle", "fixed-cycle", "sequential"},
             "sample order: reshuffle every epoch, one fixed shuffled cycle, or file order; "
             "auto = fixed-cycle for ISGD, shuffle otherwise"));
    s->add(B("data.drop_last", false, "skip the incomplete last batch of each epoch"));
    s->add(I("data.train_limit", 0, 0, std::nullopt,
             "use only the first N training samples (0 = all; for synthetic, the size)"));
    s->add(I("data.test_limit", 0, 0, std::nullopt, "use only the first N test samples (0 = all)"));
    s->add(I("data.prefetch", 4, 1, 64, "batches prepared ahead on the loader thread"));
    s->add(S("data.inputs", "auto", {"auto", "float", "ids"},
             "how integer samples x of a tensor dataset reach the model: ids = as int64 (token or "
             "item ids, for an embedding); float = as float32 (uint8 scaled by 1/255); auto = uint8 "
             "as float (images), other integer dtypes as ids for a TorchScript model and as float "
             "for a built-in one"));
    s->add(S("data.augment", "", {},
             "training-sample augmentation, in order (a list or comma-separated): random_crop:P "
             "(pad P zero pixels, crop back at a random offset), hflip (mirror with probability "
             "1/2); drawn from (train.seed, epoch, sample id); empty = none"));

    s->add(S("optim.algorithm", "sgd", {"sgd", "isgd", "adam", "adamw"},
             "sgd; ISGD (SGD plus extra conservative updates on under-trained batches); adam; or "
             "adamw (Adam with decoupled weight decay)"));
    s->add(F("optim.lr", 0.01, 0.0, 100.0, "base learning rate", true));
    s->add(F("optim.momentum", 0.9, 0.0, 1.0, "momentum coefficient", false, true));
    s->add(B("optim.nesterov", false, "Nesterov momentum"));
    s->add(F("optim.weight_decay", 0.0, 0.0, 1.0, "weight decay: L2 (sgd, adam) or decoupled (adamw)"));
    s->add(F("optim.beta1", 0.9, 0.0, 1.0, "adam/adamw: decay of the first moment (exp_avg)", false, true));
    s->add(F("optim.beta2", 0.999, 0.0, 1.0, "adam/adamw: decay of the second moment (exp_avg_sq)", false, true));
    s->add(F("optim.eps", 1e-8, 0.0, 1.0, "adam/adamw: added to the root of the second moment"));
    s->add(F("optim.clip_grad_norm", 0.0, 0.0, std::nullopt,
             "clip the gradient to this global L2 norm (as torch.nn.utils.clip_grad_norm_); 0 = off"));
    s->add(F("optim.dampening", 0.0, 0.0, 1.0, "momentum dampening", false, true));
    s->add(B("optim.shard_state", false,
             "data-parallel: each worker keeps and updates only its shard of the optimizer state "
             "(reduce-scattered gradient, all-gathered weights; ZeRO stage 1), kept in shared memory "
             "that outlives the worker, re-sharded when membership changes (docs/sharded_state.md)"));
    s->add(B("optim.shard_weights", false,
             "data-parallel, with optim.shard_state: the weights and the gradient sharded too (fully sharded, "
             "ZeRO stage 3): each worker keeps its shard, the weights are gathered whole for each step's "
             "forward and given back as backward reduces the gradient; checkpoints a shard a worker "
             "(docs/sharded_state.md)"));
    s->add(S("optim.schedule", "constant", {"constant", "step", "multistep", "cosine", "inv"},
             "learning-rate schedule"));
    s->add(F("optim.gamma", 0.1, 0.0, 1.0, "step/multistep decay factor", true));
    s->add(F("optim.step_epochs", 1.0, 0.0, std::nullopt, "step: epochs between decays", true));
    s->add(S("optim.milestones", "", {}, "multistep: comma-separated epochs, e.g. \"30,60\""));
    s->add(F("optim.cosine_epochs", 0.0, 0.0, std::nullopt,
             "cosine: horizon in epochs (0 = train.epochs)"));
    s->add(F("optim.min_lr", 0.0, 0.0, std::nullopt, "cosine: final learning rate"));
    s->add(F("optim.inv_gamma", 1e-4, 0.0, std::nullopt, "inv: gamma (per iteration)"));
    s->add(F("optim.inv_power", 0.75, 0.0, std::nullopt, "inv: power"));
    s->add(F("optim.warmup_epochs", 0.0, 0.0, std::nullopt, "linear warm-up length in epochs"));
    s->add(F("optim.warmup_start_factor", 0.1, 0.0, 1.0,
             "warm-up starts at this fraction of the scheduled rate"));

    s->add(F("isgd.k", 3.0, 0.0, std::nullopt,
             "control limit = mean + k * std of the loss window (inf = never trigger)"));
    s->add(I("isgd.window", 0, 0, std::nullopt, "losses in the control window; 0 = batches per epoch"));
    s->add(F("isgd.epsilon", 0.1, 0.0, std::nullopt, "weight of the conservative term"));
    s->add(I("isgd.stop", 5, 1, 1000, "cap on extra iterations per under-trained batch"));
    s->add(F("isgd.zeta", 0.0, 0.0, std::nullopt, "subproblem step size; 0 = the current learning rate"));
    s->add(S("isgd.anchor", "before", {"before", "after"},
             "conservative anchor: the weights before or after the batch's normal update"));
    s->add(S("isgd.momentum", "untouched", {"untouched", "shared"},
             "subproblem steps: plain steps leaving the momentum buffer untouched, or steps "
             "through the optimizer (shared momentum buffer and weight decay)"));

    s->add(S("elastic.batch_policy", "dynamic", {"none", "linear", "dynamic"},
             "learning rate when the global batch changes: keep it, scale it at once, or "
             "Dynamic SGD's ramp (up over elastic.ramp_iterations, down at once)"));
    s->add(I("elastic.reference_batch", 0, 0, std::nullopt,
             "global batch at which optim.lr was tuned; 0 = the global batch at the start"));
    s->add(I("elastic.ramp_iterations", 200, 0, std::nullopt,
             "dynamic: ramp length T in iterations"));
    s->add(B("elastic.ramp_down", false, "dynamic: ramp down as well instead of dropping at once"));
    s->add(S("elastic.momentum", "keep", {"keep", "reset", "rescale"},
             "momentum buffer at a batch change: keep, zero, or rescale by the multiplier jump"));
    s->add(S("elastic.scaling", "auto", {"auto", "linear", "sqrt"},
             "how the learning rate follows the global batch ratio kappa: linear (x kappa), or sqrt "
             "(x sqrt(kappa), with 1 - beta1, 1 - beta2 times kappa and eps / sqrt(kappa) for Adam); "
             "auto = linear for sgd, sqrt for adam and adamw"));

    s->add(S("elastic.sync", "step", {"step", "diloco"},
             "how members synchronise: step (the gradient all-reduced every step) or diloco (H inner "
             "steps alone, then the pseudo-gradients averaged by an outer optimizer; docs/diloco.md)"));
    s->add(I("diloco.inner_steps", 500, 1, std::nullopt,
             "diloco: inner steps H a member takes alone between outer steps (train.max_steps and "
             "train.checkpoint_every_steps count outer steps)"));
    s->add(F("diloco.outer_lr", 0.7, 0.0, 100.0, "diloco: the outer optimizer's learning rate", true));
    s->add(F("diloco.outer_momentum", 0.9, 0.0, 1.0, "diloco: the outer optimizer's momentum", false, true));
    s->add(B("diloco.nesterov", true, "diloco: Nesterov momentum in the outer optimizer"));
    s->add(F("diloco.max_wait", 1.0, 0.0, 1000.0,
             "diloco: a member stops its inner steps after (1 + max_wait) x the fastest member's time for a "
             "whole share in the previous outer step; the rest of its share is dealt again (0: no bound)"));
    s->add(I("diloco.fragments", 1, 1, std::nullopt,
             "diloco: streaming DiLoCo's fragments F (cut on parameter boundaries): one fragment is synchronised "
             "every inner_steps / F inner steps, in turn (1: plain DiLoCo)"));
    s->add(F("diloco.mixing", 0.0, 0.0, 1.0,
             "diloco, streaming: after a fragment's sync the local fragment becomes mixing x local + "
             "(1 - mixing) x global (0: the global fragment)"));
    s->add(I("diloco.overlap_steps", 0, 0, std::nullopt,
             "diloco, streaming: inner steps of the next unit that run while a fragment's all-reduce is on "
             "the wire (0: wait for it)"));
    s->add(B("elastic.direct_allreduce", true,
             "gradient all-reduce on a raw Gloo context on the training thread (false: through "
             "c10d's ProcessGroupGloo worker thread, in 8 MiB buckets)"));
    s->add(B("elastic.overlap", true,
             "all-reduce gradient buckets while backward still runs (on a communication "
             "thread; false: after backward, on the training thread)"));
    s->add(S("elastic.shares", "auto", {"auto", "equal", "pace"},
             "how the work is shared out: equal (a synchronous step's global batch in equal slices, an outer "
             "step's samples in equal shares) or pace (slices by each member's pace: samples a second of its "
             "own forward and backward over the last quarter of a second, agreed every step, in force "
             "data.prefetch + 2 steps later; with elastic.sync = "
             "diloco, each member's share of an outer step by its pace in the previous one), so that members "
             "of unequal speed do not wait for the slowest; auto: pace for diloco, equal for step"));
    s->add(F("elastic.bucket_mb", 4.0, 0.0, 4096.0,
             "gradient bucket size in MiB: buckets end on parameter boundaries, in backward "
             "order; 0 = the whole gradient in one bucket"));
    s->add(F("elastic.collective_timeout", 10.0, 0.1, 3600.0,
             "seconds a collective may wait for a peer before the peer counts as failed (a "
             "backstop: stopped workers are found by their heartbeats, launch --heartbeat-timeout)"));
    s->add(F("elastic.round_timeout", 120.0, 1.0, 86400.0,
             "seconds a worker waits for a membership round (e.g. below the minimum) before "
             "giving up"));

    s->add(B("comm.shared_memory", true,
             "workers of one host reduce through shared memory (false: Gloo over loopback, and "
             "one flat Gloo group across hosts)"));
    s->add(B("comm.hierarchical", true,
             "workers on several hosts: reduce within each host over shared memory, then between "
             "hosts over Gloo (false: one flat Gloo group)"));
    s->add(S("comm.compression", "none", {"none", "fp16", "bf16", "int8", "int4"},
             "gradients on the wire (the data-parallel all-reduce and parameter-server pushes): none "
             "(float32), fp16 or bf16 (half the bytes; sums in float32, error feedback keeps what "
             "rounding dropped; see docs/elastic.md); int8 or int4 (the all-reduce only, made for "
             "DiLoCo's pseudo-gradients: a float32 scale per 256 values, the codes all-gathered and "
             "summed in float32, error feedback; see docs/diloco.md)"));
    s->add(S("ps.pull_compression", "none", {"none", "fp16", "bf16"},
             "parameter server: weights pulled during training in 16 bits (the shards keep float32; "
             "final weights always come in float32)"));
    s->add(S("ps.protocol", "softsync", {"hardsync", "softsync"},
             "parameter server: hardsync (one gradient from every learner per update) or "
             "n-softsync (update every floor(learners / n) gradients)"));
    s->add(I("ps.softsync_n", 1, 1, 1 << 20, "parameter server: n of n-softsync"));
    s->add(S("ps.staleness", "inverse", {"constant", "inverse", "inverse_sqrt"},
             "parameter server: learning rate of a gradient of staleness tau: optim.lr, "
             "optim.lr / tau, or optim.lr / sqrt(tau) (optim.lr at tau = 0)"));
    s->add(S("ps.weight_decay_rate", "update", {"update", "base"},
             "parameter server: the rate weight decay runs at: each update's own (staleness-divided) rate, as "
             "a synchronous step decays at its rate, or the base rate optim.lr in every update"));
    s->add(I("ps.max_staleness", 0, 0, std::nullopt,
             "parameter server: staleness bound (0 = none); see ps.bound_action"));
    s->add(S("ps.bound_action", "drop", {"drop", "wait"},
             "parameter server: above ps.max_staleness, drop the gradient (counted) or hold "
             "updates until the slow learner catches up"));
    s->add(F("ps.heartbeat_timeout", 10.0, 0.1, 86400.0,
             "parameter server: seconds without a message before a learner is dropped"));
    s->add(F("ps.request_timeout", 60.0, 0.5, 86400.0,
             "learner: seconds without any answer from a shard before giving up"));
    s->add(I("ps.checkpoint_every", 500, 0, std::nullopt,
             "parameter server: shard checkpoint every N updates (0 = only at exit)"));
    s->add(I("ps.log_every", 100, 1, std::nullopt, "parameter server: updates per metrics line"));
    s->add(I("ps.max_message_mb", 1024, 1, 1 << 20,
             "parameter server: largest payload a shard accepts, in MiB"));
    s->add(F("ps.part_mb", 1.0, 0.0, 1024.0,
             "parameter server: pushes and weights go out in parts of this many MiB, so that "
             "the shard updates and the learner copies one part while the next is in transit "
             "(0 = one message per shard slice)"));

    s->add(S("sim.mode", "async", {"async", "elastic"},
             "simulator: asynchronous parameter-server training, or elastic synchronous training"));
    s->add(S("sim.elastic_schedule", "0:1", {},
             "simulator, elastic: worker count by epoch, e.g. \"0:1,2:16,4:4\""));
    s->add(I("sim.learners", 4, 1, 100000, "simulator: virtual learners (lambda)"));
    s->add(S("sim.compute", "constant", {"constant", "normal", "longtail", "mixed"},
             "simulator: compute time per mini-batch: constant, normal (sim.compute_cv), "
             "long-tail lognormal (sigma = sim.compute_cv), or mixed speeds (stragglers)"));
    s->add(F("sim.compute_mean", 0.1, 0.0, std::nullopt, "simulator: mean compute time per mini-batch, seconds", true));
    s->add(F("sim.compute_cv", 0.2, 0.0, 10.0, "simulator: spread of the compute time (see sim.compute)"));
    s->add(F("sim.straggler_fraction", 0.25, 0.0, 1.0, "simulator, mixed: share of slow learners"));
    s->add(F("sim.straggler_factor", 4.0, 1.0, 1000.0, "simulator, mixed: how many times slower they are"));
    s->add(F("sim.net_delay", 0.001, 0.0, 60.0, "simulator: one-way network delay, seconds"));
    s->add(I("sim.cores", 0, 0, 1 << 20,
             "simulator: cores the learners share, first come first served (0 = one per learner)"));

    s->add(I("train.epochs", 2, 1, 100000, "epochs to train"));
    s->add(I("train.max_steps", 0, 0, std::nullopt, "stop after this many steps (0 = no limit)"));
    s->add(I("train.seed", 1, 0, std::nullopt, "seed for initialisation and data order"));
    s->add(I("train.threads", 0, 0, 1024, "intra-op (OpenMP) threads; 0 = the cores this process may use (its CPU affinity, capped by a cgroup CPU quota)"));
    s->add(I("train.blas_threads", 0, 0, 1024,
             "BLAS threads; 0 = share the intra-op OpenMP pool (OpenBLAS-OpenMP)"));
    s->add(I("train.log_every", 50, 1, std::nullopt, "steps between metrics.jsonl lines"));
    s->add(I("train.eval_every_epochs", 1, 0, std::nullopt,
             "evaluate on the test split every N epochs (0 = only at the end)"));
    s->add(I("train.eval_every_steps", 0, 0, std::nullopt,
             "also evaluate every N steps (0 = off)"));
    s->add(I("train.checkpoint_every_steps", 0, 0, std::nullopt, "checkpoint every N steps (0 = off)"));
    s->add(I("train.checkpoint_every_epochs", 1, 0, std::nullopt,
             "checkpoint every N epochs (0 = off; a final checkpoint is always written)"));
    s->add(S("train.precision", "fp32", {"fp32", "bf16"},
             "compute precision: bf16 = forward and backward under CPU autocast to bfloat16 (matrix products "
             "and convolutions in bf16, as torch.autocast(\"cpu\")); weights, gradients, the all-reduce, "
             "the loss and optimizer state stay float32. Fast where the CPU has bf16 units (avx512_bf16, "
             "amx_bf16); elsewhere said once at the start, and slower than fp32"));
    s->add(I("train.accumulate", 1, 1, 4096,
             "micro-batches of data.batch_size per optimizer step: the step's batch is accumulate x "
             "data.batch_size a worker (gradient accumulation)"));
    s->add(I("train.max_nonfinite_steps", 10, 0, std::nullopt,
             "stop the run as diverged after this many steps in a row whose gradient or loss is "
             "not finite (each is skipped); 0 = never stop"));
    s->add(B("train.progress", true, "show a progress bar (terminal) or progress lines"));
    s->add(I("train.pause_at_step", 0, 0, std::nullopt,
             "testing aid: after step N, print 'paused at step N' and wait to be killed"));
    s->add(I("train.slow_step_ms", 0, 0, 600000,
             "testing aid: sleep N ms in every training step (a slow worker or learner)"));
    s->add(I("train.testing_slow_rank", -1, -1, 1 << 20,
             "testing aid: train.slow_step_ms applies only to the worker of this rank (-1: every worker)"));
    s->add(I("train.testing_pace_until_workers", 0, 0, 1 << 20,
             "testing aid: train.slow_step_ms applies only while the elastic job has fewer workers "
             "than N (0 = always)"));
    s->add(S("train.testing_writer_dies_at", "", {"", "last_step", "done", "eval", "checkpoint", "summary", "hang", "slow",
                                                        "slow_done"},
             "testing aid: the member writing the run directory kills itself (SIGKILL) at this point of "
             "the job's ending (hang: stops for ever before the final checkpoint; slow: waits 8 s there; slow_done: every "
             "member waits 3 s before it publishes that training completed)"));
    s->add(B("train.testing_die_in_isgd", false,
             "testing aid: the process kills itself (SIGKILL) when its group enters ISGD's extra "
             "iterations"));
    s->add(I("train.testing_die_at_step", 0, 0, std::nullopt,
             "testing aid: the worker of rank train.testing_die_rank kills itself (SIGKILL) as it starts "
             "step N + 1, before any collective of it, unless the group has changed since the start (0 = never)"));
    s->add(I("train.testing_die_rank", 1, 0, std::nullopt, "testing aid: see train.testing_die_at_step"));
    s->add(B("train.testing_die_in_outer", false,
             "testing aid (diloco, where train.testing_die_at_step counts outer steps): die as the outer "
             "all-reduce starts instead of halfway through the inner steps"));
    s->add(I("train.testing_die_after_changes", 0, 0, std::nullopt,
             "testing aid: train.testing_die_at_step applies after this many changes of the group, not at the "
             "start (a second loss after a first one)"));
    s->add(B("train.testing_die_without_home", false,
             "testing aid: the worker of train.testing_die_at_step first removes its shard homes (its "
             "optimizer state is lost with it)"));
    s->add(B("train.testing_die_with_host", false,
             "testing aid: the worker of train.testing_die_at_step first kills (SIGKILL) every other process "
             "of its network namespace, its launcher included: a whole host lost at once (refused outside a "
             "network namespace of its own)"));
    s->add(B("train.testing_die_in_gather", false,
             "testing aid: the worker of train.testing_die_at_step dies after that step committed, as the "
             "gather of the periodic checkpoint after it starts (between steps), instead of as the step starts"));
    s->add(B("train.testing_die_by_freezing", false,
             "testing aid: the worker of train.testing_die_at_step (and the writer of train.testing_writer_dies_at) "
             "stops itself (SIGSTOP) instead of dying: it stays frozen, its connections open (with "
             "train.testing_die_with_host, the whole host freezes)"));
    s->add(I("train.testing_die_in_bucket", 0, 0, std::nullopt,
             "testing aid: in its Nth step, the process kills itself (SIGKILL) as its "
             "communication thread starts the second gradient bucket (0 = never)"));
    s->add(B("train.sample_log", false,
             "testing aid: append every committed global batch's sample ids to samples.txt"));
    return std::shared_ptr<const Schema>(s);
  }();
  return schema;
}

std::string timestamped_run_dir(const std::string& name) {
  std::time_t t = std::time(nullptr);
  std::tm tm{};
  ::localtime_r(&t, &tm);
  char stamp[32];
  std::strftime(stamp, sizeof stamp, "%Y%m%d-%H%M%S", &tm);
  return "runs/" + name + "-" + stamp;
}

Config resolve_config(const std::string& config_file, const std::vector<std::string>& overrides) {
  Config cfg(train_schema());
  if (!config_file.empty()) cfg.load_toml_file(config_file);
  for (const auto& o : overrides) cfg.apply_override(o);
  // The user's files are stored with absolute paths (config.toml, checkpoints),
  // so `limbo eval` / `export` find them from any directory.
  for (const char* key : {"model.path", "data.path"}) {
    const std::string& v = cfg.get_string(key);
    if (!v.empty() && v[0] != '/')
      cfg.set_text(key, std::filesystem::absolute(v).lexically_normal().string(), "absolute path of " + v);
  }
  return cfg;
}

train::TrainerConfig trainer_config(const Config& c) {
  train::TrainerConfig t;
  t.source.dataset = c.get_string("data.dataset");
  t.source.path = c.get_string("data.path");
  t.source.train_limit = c.get_int("data.train_limit");
  t.source.test_limit = c.get_int("data.test_limit");
  t.source.seed = static_cast<uint64_t>(c.get_int("train.seed"));
  t.source.classes = c.get_int("model.classes");
  t.source.inputs = c.get_string("data.inputs");
  t.source.user_model = c.get_string("model.name") == "torchscript";
  t.source.context = c.get_int("data.context");
  t.source.vocab = c.get_int("data.vocab");

  t.loader.batch_size = c.get_int("data.batch_size");
  t.algorithm = c.get_string("optim.algorithm");
  t.shard_weights = c.get_bool("optim.shard_weights");
  const std::string& order = c.get_string("data.order");
  t.loader.order = data::parse_order(order != "auto" ? order
                                     : t.algorithm == "isgd" ? "fixed-cycle"
                                                             : "shuffle");
  t.loader.drop_last = c.get_bool("data.drop_last");
  t.loader.prefetch = static_cast<int>(c.get_int("data.prefetch"));
  t.loader.seed = static_cast<uint64_t>(c.get_int("train.seed"));
  t.loader.augment = data::Augmenter(c.get_string("data.augment"), t.loader.seed);

  t.model.name = c.get_string("model.name");
  t.model.width = c.get_int("model.width");
  t.model.depth = c.get_int("model.depth");
  t.model.channels_last = c.get_bool("model.channels_last");
  t.model.path = c.get_string("model.path");
  t.loss = train::parse_loss(c.get_string("model.loss"));
  t.normalize = c.get_string("data.normalize");

  auto& o = t.optimizer;
  o.algorithm = t.algorithm == "isgd" ? "sgd" : t.algorithm;
  o.momentum = c.get_float("optim.momentum");
  o.nesterov = c.get_bool("optim.nesterov");
  o.weight_decay = c.get_float("optim.weight_decay");
  o.dampening = c.get_float("optim.dampening");
  o.beta1 = c.get_float("optim.beta1");
  o.beta2 = c.get_float("optim.beta2");
  o.eps = c.get_float("optim.eps");
  t.clip_grad_norm = c.get_float("optim.clip_grad_norm");
  if (o.nesterov && o.algorithm != "sgd")
    throw InvalidInput("optim.nesterov = true is an SGD setting; optim.algorithm = \"" + o.algorithm + "\" has none");
  if (o.nesterov && o.momentum <= 0)
    throw InvalidInput("optim.nesterov = true needs optim.momentum > 0");
  if (o.nesterov && o.dampening != 0)
    throw InvalidInput("optim.nesterov = true needs optim.dampening = 0");

  t.lr.kind = c.get_string("optim.schedule");
  t.lr.base_lr = c.get_float("optim.lr");
  t.lr.gamma = c.get_float("optim.gamma");
  t.lr.step_epochs = c.get_float("optim.step_epochs");
  t.lr.milestones = optim::parse_milestones(c.get_string("optim.milestones"), "optim.milestones");
  if (t.lr.kind == "multistep" && t.lr.milestones.empty())
    throw InvalidInput("optim.schedule = \"multistep\" needs optim.milestones, e.g. \"30,60\"");
  double cos_epochs = c.get_float("optim.cosine_epochs");
  t.lr.cosine_epochs = cos_epochs > 0 ? cos_epochs : static_cast<double>(c.get_int("train.epochs"));
  t.lr.min_lr = c.get_float("optim.min_lr");
  t.lr.inv_gamma = c.get_float("optim.inv_gamma");
  t.lr.inv_power = c.get_float("optim.inv_power");
  t.lr.warmup_epochs = c.get_float("optim.warmup_epochs");
  t.lr.warmup_start_factor = c.get_float("optim.warmup_start_factor");

  t.isgd.k = c.get_float("isgd.k");
  t.isgd.window = c.get_int("isgd.window");
  t.isgd.epsilon = c.get_float("isgd.epsilon");
  t.isgd.stop = c.get_int("isgd.stop");
  t.isgd.zeta = c.get_float("isgd.zeta");
  t.isgd.anchor = optim::parse_anchor(c.get_string("isgd.anchor"));
  t.isgd.momentum = optim::parse_isgd_momentum(c.get_string("isgd.momentum"));

  t.batch_policy.kind = optim::parse_batch_policy(c.get_string("elastic.batch_policy"));
  t.batch_policy.reference_batch = c.get_int("elastic.reference_batch");
  t.batch_policy.ramp_iterations = c.get_int("elastic.ramp_iterations");
  t.batch_policy.ramp_down = c.get_bool("elastic.ramp_down");
  t.batch_policy.momentum = optim::parse_momentum_on_change(c.get_string("elastic.momentum"));
  t.batch_policy.rule = optim::parse_scaling_rule(c.get_string("elastic.scaling"), t.optimizer.algorithm);

  t.train.epochs = c.get_int("train.epochs");
  t.train.max_steps = c.get_int("train.max_steps");
  t.train.max_nonfinite_steps = c.get_int("train.max_nonfinite_steps");
  // A step takes accumulate micro-batches: the loader, the policies and the
  // records see the step's whole batch; TrainStep cuts it up.
  t.train.accumulate = c.get_int("train.accumulate");
  t.train.precision = c.get_string("train.precision");
  t.loader.batch_size = c.get_int("data.batch_size") * t.train.accumulate;
  t.train.seed = static_cast<uint64_t>(c.get_int("train.seed"));
  t.train.log_every = c.get_int("train.log_every");
  t.train.eval_every_epochs = c.get_int("train.eval_every_epochs");
  t.train.eval_every_steps = c.get_int("train.eval_every_steps");
  t.train.checkpoint_every_steps = c.get_int("train.checkpoint_every_steps");
  t.train.checkpoint_every_epochs = c.get_int("train.checkpoint_every_epochs");
  t.train.progress = c.get_bool("train.progress");
  t.train.pause_at_step = c.get_int("train.pause_at_step");
  t.train.sample_log = c.get_bool("train.sample_log");
  t.train.slow_step = std::chrono::milliseconds(c.get_int("train.slow_step_ms"));
  t.train.pace_until_workers = static_cast<int>(c.get_int("train.testing_pace_until_workers"));
  t.train.slow_rank = static_cast<int>(c.get_int("train.testing_slow_rank"));
  t.train.writer_dies_at = c.get_string("train.testing_writer_dies_at");
  t.train.die_in_isgd = c.get_bool("train.testing_die_in_isgd");
  t.train.die_at_step = c.get_int("train.testing_die_at_step");
  t.train.die_rank = static_cast<int>(c.get_int("train.testing_die_rank"));
  t.train.die_after_changes = c.get_int("train.testing_die_after_changes");
  t.train.die_without_home = c.get_bool("train.testing_die_without_home");
  t.train.die_with_host = c.get_bool("train.testing_die_with_host");
  t.train.die_by_freezing = c.get_bool("train.testing_die_by_freezing");
  t.train.die_in_outer = c.get_bool("train.testing_die_in_outer");
  t.train.die_in_gather = c.get_bool("train.testing_die_in_gather");
  t.sync = c.get_string("elastic.sync");
  t.diloco.inner_steps = c.get_int("diloco.inner_steps");
  t.diloco.outer_lr = c.get_float("diloco.outer_lr");
  t.diloco.outer_momentum = c.get_float("diloco.outer_momentum");
  t.diloco.nesterov = c.get_bool("diloco.nesterov");
  t.diloco.max_wait = c.get_float("diloco.max_wait");
  t.diloco.pace = c.get_string("elastic.shares") != "equal";  // auto: pace
  t.diloco.fragments = c.get_int("diloco.fragments");
  t.diloco.mixing = c.get_float("diloco.mixing");
  t.diloco.overlap_steps = c.get_int("diloco.overlap_steps");
  t.diloco.wire = c.get_string("comm.compression");

  t.threads.intra_op = static_cast<int>(c.get_int("train.threads"));
  t.threads.blas = static_cast<int>(c.get_int("train.blas_threads"));
  t.config_toml = c.to_toml();
  return t;
}

}  // namespace limbo::train
