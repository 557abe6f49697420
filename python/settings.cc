// limbo.Job's settings and the job they make (python/core.h).
#include "core.h"

#include <malloc.h>

#include "comm/auth.h"
#include "comm/compression.h"
#include "common/config.h"
#include "common/memory.h"
#include "common/files.h"
#include "train/schema.h"

namespace limbo::python {

namespace {

// Each numeric setting of limbo.Job has the range of the CLI key it
// stands for (docs/config.md): a value outside it is refused when the job
// is made, naming the setting, not found mid-training (log_every = 0 was
// a division by zero after the first step).
void check_ranges(const py::dict& o) {
  static const std::pair<const char*, const char*> keys[] = {
      {"epochs", "train.epochs"},
      {"max_steps", "train.max_steps"},
      {"seed", "train.seed"},
      {"log_every", "train.log_every"},
      {"accumulate", "train.accumulate"},
      {"checkpoint_every_epochs", "train.checkpoint_every_epochs"},
      {"checkpoint_every_steps", "train.checkpoint_every_steps"},
      {"max_nonfinite_steps", "train.max_nonfinite_steps"},
      {"clip_grad_norm", "optim.clip_grad_norm"},
      {"reference_batch", "elastic.reference_batch"},
      {"ramp_steps", "elastic.ramp_iterations"},
      {"bucket_mb", "elastic.bucket_mb"},
      {"collective_timeout", "elastic.collective_timeout"},
      {"round_timeout", "elastic.round_timeout"},
      {"inner_steps", "diloco.inner_steps"},
      {"outer_lr", "diloco.outer_lr"},
      {"outer_momentum", "diloco.outer_momentum"},
      {"max_wait", "diloco.max_wait"},
      {"fragments", "diloco.fragments"},
      {"mixing", "diloco.mixing"},
  };
  Config cfg(train::train_schema());
  for (const auto& [name, key] : keys) {
    if (!o.contains(name)) continue;
    const KeySpec* spec = cfg.schema().find(key);
    ConfigValue v;
    if (spec->type == ValueType::Int) v = o[name].cast<int64_t>();
    else v = o[name].cast<double>();
    try {
      cfg.set(key, v, std::string("limbo.Job's ") + name);
    } catch (const InvalidInput& e) {
      const std::string why = e.what();
      const auto allowed = why.find("allowed: ");
      throw InvalidInput(std::string(name) + "=" + py::str(o[name]).cast<std::string>() + " is out of range (" +
                         (allowed == std::string::npos ? why : why.substr(allowed)) + ", as the CLI's " + key + ")");
    }
  }
}

}  // namespace

Core::Core(const Named& params, const Named& buffers, const py::dict& o, py::function pack, py::function unpack,
           py::function step)
    : pack_(std::move(pack)), unpack_(std::move(unpack)), step_(std::move(step)) {
  check_ranges(o);
  // The heap settings of `limbo train` (common/memory.h), for a loop run
  // without `limbo launch` too (which sets them in its workers' environment).
  keep_freed_memory();
  batch_size_ = get<int64_t>(o, "batch_size", 0);
  dataset_size_ = get<int64_t>(o, "dataset_size", 0);
  epochs_ = get<int64_t>(o, "epochs", 1);
  max_steps_ = get<int64_t>(o, "max_steps", 0);
  log_every_ = get<int64_t>(o, "log_every", 50);
  accumulate_ = get<int64_t>(o, "accumulate", 1);
  if (accumulate_ < 1) throw InvalidInput("accumulate must be at least 1, got " + std::to_string(accumulate_));
  drop_last_ = get<bool>(o, "drop_last", false);
  if (batch_size_ < 1) throw InvalidInput("batch_size must be at least 1, got " + std::to_string(batch_size_));
  if (dataset_size_ < 1) throw InvalidInput("the data set is empty (dataset_size " + std::to_string(dataset_size_) + ")");
  if (epochs_ < 1) throw InvalidInput("epochs must be at least 1, got " + std::to_string(epochs_));
  sampler_ = std::make_unique<data::Sampler>(dataset_size_, data::parse_order(get<std::string>(o, "order", "shuffle")),
                                             get<uint64_t>(o, "seed", 1));
  for (const auto& [name, t] : params) {
    if (!t.device().is_cpu())
      throw InvalidInput("parameter '" + name + "' is on " + t.device().str() + "; Limbo trains on the CPU");
    if (t.requires_grad() && t.scalar_type() != torch::kFloat32)
      throw InvalidInput("parameter '" + name + "' is " + std::string(c10::toString(t.scalar_type())) +
                         "; Limbo trains float32 parameters (keep the model in float32; bf16 is for autocast)");
  }
  for (const auto& [name, t] : buffers)
    if (!t.device().is_cpu())
      throw InvalidInput("buffer '" + name + "' is on " + t.device().str() + "; Limbo trains on the CPU");
  // Frozen float32 parameters in the flat buffers (limbo.Job(frozen="may_train"),
  // the user's torch.optim, sync="step"): a loop that unfreezes a layer
  // later has its gradient reduced like the others' (docs/python.md).
  const bool frozen_in_flat = get<bool>(o, "frozen_in_flat", false) && !o.contains("limbo_optimizer") &&
                              get<std::string>(o, "sync", "step") == "step";
  model_ = module_tree(params, buffers);
  // A model moved to channels-last (model.to(memory_format=torch.channels_last),
  // as PyTorch's CPU convolutions run fastest) keeps that layout in the flat
  // buffers: a contiguous view would make oneDNN reorder the weights at
  // every forward and backward (measured: LeNet's forward 1.9x slower).
  bool channels_last = false;
  for (const auto& [name, t] : params)
    if ((t.requires_grad() || frozen_in_flat) && t.dim() == 4 && !t.is_contiguous() &&
        t.is_contiguous(at::MemoryFormat::ChannelsLast))
      channels_last = true;
  const bool shard_weights = get<bool>(o, "shard_weights", false);
  flat_ = std::make_unique<optim::FlatParams>(*model_, channels_last, frozen_in_flat, /*lazy=*/shard_weights);
  if (shard_weights) {
    plan_units(get<std::vector<std::string>>(o, "units", {}));
    // The model's own parameter tensors, copied into the flat buffers, were
    // freed into the heap, which keeps freed memory (keep_freed_memory): a
    // whole model's worth that a fully sharded member must not go on holding.
    ::malloc_trim(0);
  }
  if (std::none_of(params.begin(), params.end(), [](const auto& p) { return p.second.requires_grad(); }))
    throw InvalidInput("the model has no trainable parameters");
  // The user's torch.optim (called back at the update), or one of Limbo's
  // optimizers (limbo.Optimizer: its state lives in Limbo, sharded with
  // shard_state, and moves natively in state sync and checkpoints).
  optim::OptimizerOptions oo;
  own_ = o.contains("limbo_optimizer");
  if (own_) {
    const py::dict lo = o["limbo_optimizer"].cast<py::dict>();
    oo.algorithm = get<std::string>(lo, "algorithm", "sgd");
    oo.weight_decay = get<double>(lo, "weight_decay", 0.0);
    oo.momentum = get<double>(lo, "momentum", 0.0);
    oo.dampening = get<double>(lo, "dampening", 0.0);
    oo.nesterov = get<bool>(lo, "nesterov", false);
    oo.beta1 = get<double>(lo, "beta1", 0.9);
    oo.beta2 = get<double>(lo, "beta2", 0.999);
    oo.eps = get<double>(lo, "eps", 1e-8);
    shard_state_ = get<bool>(lo, "shard_state", false) || shard_weights;
  }
  if (shard_weights && !own_)
    throw InvalidInput("shard=\"full\" steps each member's shard of the weights with Limbo's optimizer: pass "
                       "limbo.Optimizer(...) (a torch.optim optimizer steps whole parameters)");
  opt_ = std::make_shared<train::OptimizerStep>(optim::make_optimizer(oo), get<double>(o, "clip_grad_norm", 0.0));
  if (!own_)
    opt_->set_external([this](double lr) {
      py::gil_scoped_acquire gil;
      step_(lr);
    });
  optim::BatchPolicyOptions bp;
  bp.kind = optim::parse_batch_policy(get<std::string>(o, "batch_policy", "dynamic"));
  bp.rule = optim::parse_scaling_rule(get<std::string>(o, "lr_scaling", "linear"), oo.algorithm);
  bp.reference_batch = get<int64_t>(o, "reference_batch", 0);
  bp.ramp_iterations = get<int64_t>(o, "ramp_steps", 200);
  policy_ = std::make_unique<optim::BatchSizePolicy>(bp);
  state_.config_toml = get<std::string>(o, "config_toml", "");
  // DiLoCo: the user's optimizer is the inner one, stepped locally; the
  // rule applies Limbo's outer SGD with Nesterov momentum.
  const std::string sync = get<std::string>(o, "sync", "step");
  if (sync != "step" && sync != "diloco") throw InvalidInput("sync must be \"step\" or \"diloco\", got '" + sync + "'");
  std::shared_ptr<train::OptimizerStep> rule_opt = opt_;
  if (sync == "diloco") {
    diloco_.inner_steps = get<int64_t>(o, "inner_steps", 500);
    diloco_.outer_lr = get<double>(o, "outer_lr", 0.7);
    diloco_.outer_momentum = get<double>(o, "outer_momentum", 0.9);
    diloco_.nesterov = get<bool>(o, "nesterov", true);
    diloco_.max_wait = get<double>(o, "max_wait", 1.0);
    diloco_.wire = get<std::string>(o, "compression", "none");
    diloco_.fragments = get<int64_t>(o, "fragments", 1);
    diloco_.mixing = get<double>(o, "mixing", 0.0);
    if (diloco_.inner_steps < 1) throw InvalidInput("inner_steps must be at least 1");
    // The inner steps are the user's loop: no overlap (docs/python.md).
    train::check_streaming(diloco_, [](const std::string& k) { return k; });
    if (diloco_.nesterov && diloco_.outer_momentum <= 0)
      throw InvalidInput("nesterov=True needs outer_momentum > 0");
    if (drop_last_) throw InvalidInput("sync=\"diloco\" deals every sample of an epoch; set drop_last=False");
    if (shard_state_)
      throw InvalidInput("sync=\"diloco\": the inner optimizer is each member's own and is not sharded "
                         "(limbo.Optimizer(shard_state=False))");
    optim::OptimizerOptions outer;
    outer.momentum = diloco_.outer_momentum;
    outer.nesterov = diloco_.nesterov;
    rule_opt = outer_ = std::make_shared<train::OptimizerStep>(optim::make_optimizer(outer), 0.0);
  }

  const std::string rdzv = get<std::string>(o, "rdzv", "");
  const bool elastic = get<bool>(o, "elastic", false);
  const int world = get<int>(o, "world", 1), rank = get<int>(o, "rank", 0);
  std::shared_ptr<train::UpdateRule> rule;
  std::unique_ptr<train::Membership> membership;
  const std::string shares = get<std::string>(o, "shares", "auto");
  if (shares != "auto" && shares != "equal" && shares != "pace")
    throw InvalidInput("shares must be \"auto\", \"equal\" or \"pace\", got '" + shares + "'");
  const int64_t read_ahead = get<int64_t>(o, "read_ahead", 15);
  if (read_ahead < 0 || read_ahead > 100000)
    throw InvalidInput("read_ahead must be in [0, 100000] (batches a loader may read ahead), got " +
                       std::to_string(read_ahead));
  diloco_.pace = shares != "equal";  // an outer step's shares by pace (sync="diloco"; "auto": pace)
  if (rdzv.empty()) {
    rule = std::make_shared<train::LocalUpdate>(rule_opt);
    grads_in_place_ = !own_ && !outer_ && opt_->clip_norm() <= 0;
  } else {
    elastic::JoinOptions jo;
    jo.rdzv = rdzv;
    const std::string token = get<std::string>(o, "token", "");
    if (!token.empty()) jo.token = comm::check_token(token, "LIMBO_JOB_TOKEN");
    jo.direct_allreduce = get<bool>(o, "direct_allreduce", true);
    jo.shared_memory = get<bool>(o, "shared_memory", true);
    jo.hierarchical = get<bool>(o, "hierarchical", true);
    jo.collective_timeout = get<double>(o, "collective_timeout", 10.0);
    jo.round_timeout = get<double>(o, "round_timeout", 120.0);
    jo.reduce.overlap = get<bool>(o, "overlap", true) && !outer_;
    jo.reduce.bucket_bytes = static_cast<int64_t>(get<double>(o, "bucket_mb", 4.0) * (1 << 20));
    jo.reduce.compression = comm::parse_compression(get<std::string>(o, "compression", "none"));
    jo.reduce.shard_state = shard_state_;
    jo.reduce.shard_weights = shard_weights;
    jo.reduce.unit_starts = unit_starts_;
    // `.grad` is the group's when the user's backward returns, as with
    // DDP: clipping or reading it by hand sees the reduced gradient.
    jo.reduce.finish_in_backward = true;
    if (shares == "pace" && !outer_) {
      // A batch's share must be agreed before a loader asks for it: the
      // shares a publication makes hold read_ahead + 1 steps later.
      data::PaceShares::Options po;
      po.lag = read_ahead + 1;
      jo.reduce.paces = paces_ = std::make_shared<data::PaceShares>(po);
    }
    if (elastic) {
      py::gil_scoped_release no_gil;
      auto joined = elastic::join_elastic(jo, rule_opt, *flat_,
                                          get_leave_ ? get_leave_
                                                     : (get_leave_ = elastic::leave_on_signals(
                                                            get<std::vector<int>>(o, "chain_signals", {}))));
      rule = joined.rule;
      membership = std::move(joined.membership);
    } else {
      if (world < 1 || rank < 0 || rank >= world)
        throw InvalidInput("rank " + std::to_string(rank) + " is not in [0, " + std::to_string(world) + ")");
      py::gil_scoped_release no_gil;
      rule = elastic::join_static(jo, rank, world, rule_opt, *flat_);
    }
  }
  train::SessionParts parts{*model_, *flat_, rule_opt, *policy_, nullptr, state_, get<std::string>(o, "run_dir", ""),
                            get<int64_t>(o, "max_nonfinite_steps", 10), {}, {}, false, {}, {}, {}};
  parts.pack_extra = [this]() {
    py::gil_scoped_acquire gil;
    // The packed bytes as a buffer (a memoryview of the pickle: no copy),
    // copied once into the tensor that travels.
    py::buffer b = pack_();
    const py::buffer_info info = b.request();
    const auto n = static_cast<int64_t>(info.size * info.itemsize);
    auto t = torch::empty({n}, torch::kUInt8);
    std::memcpy(t.data_ptr<uint8_t>(), info.ptr, static_cast<size_t>(n));
    return t;
  };
  parts.unpack_extra = [this](const torch::Tensor& t) {
    py::gil_scoped_acquire gil;
    unpack_(py::bytes(reinterpret_cast<const char*>(t.data_ptr<uint8_t>()), static_cast<size_t>(t.numel())));
  };
  // sync="step": every member that took part in each committed step holds
  // the same optimizer, scheduler and `state`; a re-formation moves them
  // only to a member that is behind or new. (DiLoCo's inner optimizers
  // differ by design: a re-formed group takes the state member's.)
  parts.extra_only_when_behind = !outer_;
  resume_ = get<bool>(o, "resume", false);
  const std::string run_dir = get<std::string>(o, "run_dir", "");
  if (membership == nullptr && rank == 0 && !run_dir.empty() && !resume_ && file_exists(run_dir + "/checkpoint.pt"))
    throw InvalidInput("run directory '" + run_dir + "' already holds a checkpoint; pass resume=True (or "
                       "`limbo launch --resume`) to continue that run, or choose another run directory");
  std::string dir = run_dir;
  if (membership == nullptr && rank != 0) dir.clear();  // a static job's member 0 writes the run directory
  parts.run_dir = dir;
  parts.shard_dir = run_dir;  // but each member writes its shards of a fully sharded checkpoint
  session_ = std::make_unique<train::Session>(std::move(parts), rule, std::move(membership), resume_,
                                              rdzv.empty() || elastic ? 1 : world, rdzv.empty() || elastic ? 0 : rank);
  session_->set_paces(paces_);
  if (shard_weights) full_ = std::dynamic_pointer_cast<elastic::AllReduceUpdate>(rule);
  session_->set_on_reform([this](const train::Membership::Established&) {
    generation_ += 1;
    plans_.clear();
    // shard="full": what one member remembers of the last forward decides
    // which unit it keeps for backward; a new group (a joiner remembers
    // nothing) starts from the same nothing on every member.
    unit_order_.clear();
    last_unit_order_.clear();
    if (outer_steps_) outer_steps_->reformed();
  });
  if (outer_) {
    train::OuterSteps::Options oo;
    oo.diloco = diloco_;
    oo.batch = batch_size_;
    oo.samples = dataset_size_;
    oo.order = data::parse_order(get<std::string>(o, "order", "shuffle"));
    oo.seed = get<uint64_t>(o, "seed", 1);
    oo.max_steps = max_steps_;
    outer_steps_ = std::make_unique<train::OuterSteps>(*session_, *flat_, rule, outer_, oo);
  }
  if (!rdzv.empty() && !elastic) static_rank_ = rank;
}

}  // namespace limbo::python
