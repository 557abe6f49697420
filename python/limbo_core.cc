// limbo._core: the elastic step of train/session.h for a training loop in
// Python (python/limbo/__init__.py wraps it; docs/python.md).
//
// The user's nn.Module is seen through its parameters and buffers, shared
// with Python without a copy (the same tensors): FlatParams re-points them
// into Limbo's flat buffers, so the gradient is all-reduced in buckets as
// backward produces it (post-hooks on the parameters' gradient
// accumulators) and the user's torch.optim optimizer, called back at the
// update, steps the views in place. Everything else (the group, state sync
// with the user's optimizer state as bytes, the commit, checkpoints, the
// run directory, the ending) is the Session the CLI's trainer drives.
//
// Long calls release the GIL; callbacks into Python take it back.
#include <torch/extension.h>

#include <pybind11/functional.h>
#include <pybind11/stl.h>

#include <csignal>
#include <deque>
#include <limits>
#include <map>

#include "cli/schema.h"
#include "comm/auth.h"
#include "comm/compression.h"
#include "common/error.h"
#include "common/files.h"
#include "common/log.h"
#include "data/sampler.h"
#include "elastic/join.h"
#include "optim/batch_policy.h"
#include "optim/flat_params.h"
#include "optim/optimizer.h"
#include "train/checkpoint.h"
#include "train/outer_steps.h"
#include "train/session.h"
#include "train/step.h"
#include "train/update_rule.h"

namespace py = pybind11;

namespace limbo::python {
namespace {

using Named = std::vector<std::pair<std::string, torch::Tensor>>;

// A torch::nn::Module tree that names the user's tensors as the Python
// module does ("block.0.weight": child "block", its child "0", parameter
// "weight"), holding the very same tensors: checkpoints then carry the
// usual dotted names, and loading one writes into the user's parameters.
std::shared_ptr<torch::nn::Module> module_tree(const Named& params, const Named& buffers) {
  auto root = std::make_shared<torch::nn::Module>("Model");
  auto place = [&](const std::string& name) -> std::pair<torch::nn::Module*, std::string> {
    torch::nn::Module* m = root.get();
    size_t at = 0;
    for (size_t dot; (dot = name.find('.', at)) != std::string::npos; at = dot + 1) {
      const std::string part = name.substr(at, dot - at);
      if (part.empty()) throw InvalidInput("the model names a tensor '" + name + "' with an empty part");
      auto children = m->named_children();
      if (auto* c = children.find(part)) {
        m = c->get();
      } else {
        m = m->register_module(part, std::make_shared<torch::nn::Module>(part)).get();
      }
    }
    return {m, name.substr(at)};
  };
  for (const auto& [name, t] : params) {
    auto [m, leaf] = place(name);
    m->register_parameter(leaf, t, t.requires_grad());
  }
  for (const auto& [name, t] : buffers) {
    auto [m, leaf] = place(name);
    m->register_buffer(leaf, t);
  }
  return root;
}

template <typename T>
T get(const py::dict& d, const char* key, T fallback) {
  return d.contains(key) ? d[key].cast<T>() : fallback;
}

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
  Config cfg(cli::train_schema());
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

class Core {
 public:
  Core(const Named& params, const Named& buffers, const py::dict& o, py::function pack, py::function unpack,
       py::function step)
      : pack_(std::move(pack)), unpack_(std::move(unpack)), step_(std::move(step)) {
    check_ranges(o);
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
    model_ = module_tree(params, buffers);
    // A model moved to channels-last (model.to(memory_format=torch.channels_last),
    // as PyTorch's CPU convolutions run fastest) keeps that layout in the flat
    // buffers: a contiguous view would make oneDNN reorder the weights at
    // every forward and backward (measured: LeNet's forward 1.9x slower).
    bool channels_last = false;
    for (const auto& [name, t] : params)
      if (t.requires_grad() && t.dim() == 4 && !t.is_contiguous() &&
          t.is_contiguous(at::MemoryFormat::ChannelsLast))
        channels_last = true;
    flat_ = std::make_unique<optim::FlatParams>(*model_, channels_last);
    if (flat_->numel() == 0) throw InvalidInput("the model has no trainable parameters");
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
      shard_state_ = get<bool>(lo, "shard_state", false);
    }
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
    if (rdzv.empty()) {
      rule = std::make_shared<train::LocalUpdate>(rule_opt);
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
      // `.grad` is the group's when the user's backward returns, as with
      // DDP: clipping or reading it by hand sees the reduced gradient.
      jo.reduce.finish_in_backward = true;
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
                              get<int64_t>(o, "max_nonfinite_steps", 10), {}, {}};
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
    resume_ = get<bool>(o, "resume", false);
    const std::string run_dir = get<std::string>(o, "run_dir", "");
    if (membership == nullptr && rank == 0 && !run_dir.empty() && !resume_ && file_exists(run_dir + "/checkpoint.pt"))
      throw InvalidInput("run directory '" + run_dir + "' already holds a checkpoint; pass resume=True (or "
                         "`limbo launch --resume`) to continue that run, or choose another run directory");
    std::string dir = run_dir;
    if (membership == nullptr && rank != 0) dir.clear();  // a static job's member 0 writes the run directory
    parts.run_dir = dir;
    session_ = std::make_unique<train::Session>(std::move(parts), rule, std::move(membership), resume_,
                                                rdzv.empty() || elastic ? 1 : world, rdzv.empty() || elastic ? 0 : rank);
    session_->set_on_reform([this](const train::Membership::Established&) {
      generation_ += 1;
      plans_.clear();
      if (outer_steps_) outer_steps_->reformed();
    });
    if (outer_) {
      train::OuterSteps::Options oo;
      oo.diloco = diloco_;
      oo.batch = batch_size_;
      oo.samples = dataset_size_;
      oo.order = data::parse_order(get<std::string>(o, "order", "shuffle"));
      oo.seed = get<uint64_t>(o, "seed", 1);
      outer_steps_ = std::make_unique<train::OuterSteps>(*session_, *flat_, rule, outer_, oo);
    }
    if (!rdzv.empty() && !elastic) static_rank_ = rank;
  }

  // Resume, form the group, write the configuration. False: training
  // completed elsewhere before this member got in.
  bool start() {
    py::gil_scoped_release no_gil;
    if (resume_) session_->resume();
    try {
      session_->start();
    } catch (const train::CompletedElsewhere& e) {
      log_warn(std::string(e.what()) + "; nothing left to train");
      left_ = true;
      return false;
    }
    session_->run_dir().write_config(state_.config_toml);
    window_.reset();
    wall_start_ = Clock::now();
    return true;
  }

  bool complete() const {
    return state_.cursor.epoch >= epochs_ || (max_steps_ > 0 && state_.step >= max_steps_) || left_;
  }

  // The next batch of this member from `at` (the sampler's position), or
  // None past the end; the plan is queued for begin_step().
  // `first_step` is the committed step count when the sampler started and
  // `steps_ahead` the batches it planned since: the batch is step
  // first_step + steps_ahead + 1.
  py::object plan(int64_t epoch, int64_t position, int64_t first_step, int64_t steps_ahead) {
    if (outer_steps_) return plan_inner(epoch, position, steps_ahead);
    if (epoch >= epochs_ || (max_steps_ > 0 && first_step + steps_ahead >= max_steps_)) return py::none();
    auto p = data::plan_batch(*sampler_, {epoch, position}, batch_size_, world(), rank(), drop_last_);
    py::list ids;
    for (int64_t id : p.ids) ids.append(id);
    plans_.push_back(std::move(p));
    return py::make_tuple(ids, plans_.back().end.epoch, plans_.back().end.position);
  }
  void clear_plans() { plans_.clear(); }


  // DiLoCo: the sampler's pass is this member's share of the outer step
  // (the first call begins it: after a re-formation the group agrees first,
  // a collective); None past its end, once the bounded wait is over, or
  // when the group re-formed meanwhile (the loop starts again).
  py::object plan_inner(int64_t epoch, int64_t position, int64_t k) {
    if (complete()) return py::none();
    if (k == 0) {
      py::gil_scoped_release no_gil;
      work_.reset();
      try {
        work_ = outer_steps_->begin();
      } catch (const train::CompletedElsewhere& e) {
        log_warn(std::string(e.what()) + "; this member ends");
        left_ = true;
      }
    }
    if (!work_ || k >= static_cast<int64_t>(work_->batches.size()) || !outer_steps_->keep_going()) return py::none();
    data::BatchPlan p;
    p.ids = work_->batches[static_cast<size_t>(k)];
    p.begin = p.end = state_.cursor;
    p.global_size = static_cast<int64_t>(p.ids.size());
    py::list ids;
    for (int64_t id : p.ids) ids.append(id);
    plans_.push_back(std::move(p));
    inner_index_ = k;
    return py::make_tuple(ids, epoch, position);
  }

  // DiLoCo: the outer step after this member's inner steps. True: it
  // committed; false: the group re-formed (the loop starts again) or
  // training completed elsewhere (left()).
  bool outer_finish() {
    std::optional<train::OuterSteps::Committed> c;
    {
      py::gil_scoped_release no_gil;
      try {
        c = outer_steps_->finish();
      } catch (const train::CompletedElsewhere& e) {
        log_warn(std::string(e.what()) + " (at outer step " + std::to_string(state_.step) + "); this member ends");
        left_ = true;
        return false;
      }
    }
    work_.reset();
    if (!c) return false;
    const auto& order = outer_steps_->epoch_order(c->epoch);
    committed_epoch_ = c->epoch;
    committed_.clear();
    for (int64_t pos : c->settled.committed) committed_.push_back(order[pos]);
    last_loss_ = c->res.loss;
    last_global_ = c->res.global_batch;
    samples_this_run_ += c->res.global_batch;
    window_.add(c->res.loss, c->res.global_batch);
    train_seconds_ += c->wall_seconds;
    plan_.last_in_epoch = c->settled.last_in_epoch;
    session_->run_dir().append_metrics(outer_steps_->record(*c, epoch(), world()));
    return true;
  }
  bool diloco() const { return outer_steps_ != nullptr; }
  // The last committed outer step's samples (every member's processed
  // ones, in plan order) and their epoch.
  py::tuple committed_ids() const { return py::make_tuple(committed_epoch_, committed_); }

  // A batch of the loader arrived: its plan becomes the step's.
  void begin_step() {
    if (plans_.empty()) throw Error("internal: a batch arrived that no plan of this member's sampler made");
    if (in_step_) throw InvalidInput("the previous batch's step was not taken: call job.step() once for every batch");
    plan_ = std::move(plans_.front());
    plans_.pop_front();
    if (!(plan_.begin == state_.cursor) && plan_.begin.position != 0)
      throw Error("internal: the batch does not start at the committed cursor");
    check_model();
    if (outer_steps_) {  // an inner step: no batch policy, nothing to restore
      in_step_ = true;
      step_start_ = Clock::now();
      backward_started_ = false;
      backwards_ = 0;
      return;
    }
    in_step_ = true;
    step_start_ = Clock::now();
    backward_started_ = false;
    backwards_ = 0;
    buffers_before_.clear();
    if (!flat_->buffer_entries().empty()) buffers_before_ = flat_->save_buffers();
    policy_step_ = policy_->step(state_.step, batch_size_ * world());
    if (own_) {
      // Limbo's optimizer: the momentum at a batch change (elastic.momentum)
      // and the square-root rule's betas, as the CLI's steps do.
      auto& opt = opt_->optimizer();
      if (policy_step_.changed && policy_step_.momentum_factor != 1.0)
        rule().scale_momentum(opt, policy_step_.momentum_factor, state_.step);
      opt.set_batch_scale(policy_->options().rule == optim::ScalingRule::Sqrt ? policy_step_.kappa : 1.0);
    }
    // One backward a step: the reduction is armed before forward, so a
    // plain loss.backward() reduces during backward as job.backward() does
    // (the loss, unknown until job.backward() tells it, rides as 0).
    if (accumulate_ == 1) arm(0.0);
  }

  // job.no_sync(): backwards add to this member's gradient only.
  void no_sync(bool on) { rule().no_sync(on); }

  // Before each of the user's backwards of a step (`accumulate` of them:
  // micro-batches): before the first, the gradient is zeroed (and
  // re-attached where the user's zero_grad(set_to_none=True) dropped it);
  // before the last, the rule may start reducing buckets as backward fills
  // them. `loss` is the micro-batch's (already divided by `accumulate`, as
  // its gradient is): the step's loss is their sum.
  void backward_starts(double loss, double lr) {
    lr_ = lr;
    need_step("job.backward()");
    if (backwards_ >= accumulate_)
      throw InvalidInput("job.backward() was called " + std::to_string(backwards_ + 1) + " times in one step; "
                         "the job takes " + std::to_string(accumulate_) + " (limbo.Job(accumulate=K) for K "
                         "micro-batches a step)");
    if (backwards_ == 0) {
      attach_grads(/*keep=*/false);
      flat_->zero_grad();
      loss_sum_ = 0;
    }
    backwards_ += 1;
    loss_sum_ += loss;
    if (backward_started_) {  // armed before forward: the loss is known now
      ctx_->loss = loss_sum_;
      rule().set_step_loss(loss_sum_);
      return;
    }
    if (backwards_ < accumulate_ || outer_steps_) return;  // DiLoCo's inner steps reduce nothing
    arm(loss_sum_);
  }

  void arm(double loss) {
    backward_started_ = true;
    ctx_ = std::make_unique<train::StepContext>(context(loss));
    rule().backward_starts(*ctx_);
  }

  // The step: the gradient reduced, the update (the user's optimizer
  // through set_external), the commit. False: a peer failed, the step did
  // not commit, the group re-formed (or training completed elsewhere:
  // left()); the loop redoes it from the committed cursor.
  // 1: committed; 0: did not commit (re-formed, or left()); 2: DiLoCo's
  // inner step, applied (or skipped) on this member alone.
  int step(double loss, double lr) {
    need_step("job.step()");
    lr_ = lr;
    if (backwards_ > 0 && backwards_ < accumulate_)
      throw InvalidInput("job.step() after " + std::to_string(backwards_) + " of the step's " +
                         std::to_string(accumulate_) + " job.backward() calls (accumulate=" +
                         std::to_string(accumulate_) + ")");
    in_step_ = false;
    if (outer_steps_) {
      attach_grads(/*keep=*/backwards_ == 0);
      const bool finite = train::finite_step(flat_->grad(), loss);
      if (finite) {
        py::gil_scoped_release no_gil;  // the user's optimizer takes the GIL back
        opt_->apply(flat_->data(), flat_->grad(), own_ ? lr_ : 1.0);
      }
      outer_steps_->inner_step_done(static_cast<int64_t>(plan_.ids.size()), loss, finite, seconds_since(step_start_));
      return 2;
    }
    // The user's own loss.backward() (no job.backward()): the loss is not
    // known; the gradient and the step are as with job.backward().
    const bool loss_known = backwards_ > 0;
    if (!loss_known) loss = 0.0;
    // A gradient autograd put elsewhere (zero_grad(set_to_none=True), with
    // no reduction in backward: alone, or not armed) is taken from there; a
    // reduction finished in backward already left every `.grad` the view.
    attach_grads(/*keep=*/true);
    if (!backward_started_) ctx_ = std::make_unique<train::StepContext>(context(loss));
    ctx_->lr = rate();  // armed before forward: this step's rate is known now
    std::optional<train::StepResult> res;
    {
      py::gil_scoped_release no_gil;
      try {
        res = session_->apply(*ctx_, buffers_before_);
      } catch (const train::CompletedElsewhere& e) {
        log_warn(std::string(e.what()) + " (at step " + std::to_string(state_.step) + "); this member ends");
        left_ = true;
        return 0;
      }
    }
    ctx_.reset();
    if (!res) return 0;
    session_->commit(*res, plan_.end, buffers_before_);
    if (!loss_known) res->loss = NAN;
    last_loss_ = res->loss;
    last_global_ = res->global_batch;
    samples_this_run_ += res->global_batch;
    window_.add(res->loss, res->global_batch);
    train_seconds_ += seconds_since(step_start_);  // from the batch's arrival: forward, backward, update
    return 1;
  }

  // After the committed step (and the user's scheduler step): the metrics
  // line, then an agreed membership change. True: this member left.
  bool after_step() {
    log_step();
    py::gil_scoped_release no_gil;
    try {
      if (session_->after_step(epoch(), state_.step % 10 == 0 || plan_.last_in_epoch)) {
        left_ = true;
        elastic::restore_signals();  // it left: a second Ctrl-C acts as before the job
      }
    } catch (const train::CompletedElsewhere& e) {
      log_warn(std::string(e.what()) + "; this member ends");
      left_ = true;
    }
    return left_;
  }

  void checkpoint(const std::string& why) {
    py::gil_scoped_release no_gil;
    session_->checkpoint_now(why);
  }

  void log(const py::dict& metrics) {
    for (const auto& [k, v] : metrics) user_[py::str(k).cast<std::string>()] = py::float_(v.cast<py::object>()).cast<double>();
  }
  void record(const std::string& kind, const py::dict& fields) {
    nlohmann::json rec = {{"kind", kind}, {"step", state_.step}, {"epoch", epoch()}};
    for (const auto& [k, v] : fields) rec[py::str(k).cast<std::string>()] = py::float_(v.cast<py::object>()).cast<double>();
    session_->run_dir().append_metrics(rec);
  }

  // Training ended: the sharded state gathered, completion published, this
  // member off the coordinator's watch. False: completed elsewhere.
  bool end_training() {
    py::gil_scoped_release no_gil;
    if (!session_->gather_final(session_->writer())) {
      left_ = true;
      elastic::restore_signals();
      return false;
    }
    session_->training_done();
    // Training is over: Ctrl-C and SIGTERM act as they did before the job
    // (during evaluation or whatever the program does next).
    if (get_leave_) elastic::restore_signals();
    return true;
  }

  // The final checkpoint and summary (with the user's fields), where this
  // member writes them. Returns the summary.
  std::string finish(const py::dict& fields) {
    nlohmann::json s = {{"train_loss", std::isnan(last_loss_) ? nlohmann::json() : nlohmann::json(last_loss_)},
                        {"epochs", epoch()},
                        {"steps", state_.step},
                        {"samples", state_.samples},
                        {"skipped_steps", state_.skipped_steps},
                        {"wall_seconds", seconds_since(wall_start_)},
                        {"train_seconds", train_seconds_},
                        {"samples_per_second", train_seconds_ > 0 ? samples_this_run_ / train_seconds_ : 0.0},
                        {"front_end", "python"},
                        {"trainable_parameters", flat_->numel()},
                        {"parameters", flat_->numel() + flat_->frozen_numel()},
                        {"update_rule", rule().name()},
                        {"workers", world()}};
    if (session_->elastic()) {
      s["membership_changes"] = session_->membership_changes();
      s["recovery_seconds"] = session_->recoveries();
    }
    if (auto rs = rule().summary(); !rs.empty()) s["communication"] = rs;
    s["sync"] = outer_steps_ ? "diloco" : "step";
    if (outer_steps_) s.update(outer_steps_->summary());
    nlohmann::json eval = {{"kind", "eval"}, {"step", state_.step}, {"epoch", epoch()}, {"train_seconds", train_seconds_}};
    for (const auto& [k, v] : fields) {
      const std::string key = py::str(k).cast<std::string>();
      if (v.is_none()) s[key] = nullptr;
      else if (py::isinstance<py::str>(v)) s[key] = v.cast<std::string>();
      else s[key] = eval[key] = py::float_(v.cast<py::object>()).cast<double>();
    }
    py::gil_scoped_release no_gil;
    if (!session_->writes_final()) return s.dump();
    if (eval.size() > 4 || session_->took_over()) {
      if (session_->took_over()) eval["taken_over"] = true;
      session_->run_dir().append_metrics(eval);
    }
    session_->checkpoint("final");
    session_->run_dir().write_summary(s);
    session_->final_written();
    return s.dump();
  }

  // The global batch of the current step (every member's ids, in order).
  std::vector<int64_t> global_ids() {
    const auto& order = sampler_->epoch_order(plan_.begin.epoch);
    return {order.begin() + plan_.begin.position, order.begin() + plan_.begin.position + plan_.global_size};
  }

  int world() const { return session_->world(); }
  int rank() const { return static_rank_ >= 0 ? static_rank_ : session_->rank(); }
  int64_t generation() const { return generation_; }
  int64_t steps() const { return state_.step; }
  int64_t samples() const { return state_.samples; }
  py::tuple cursor() const { return py::make_tuple(state_.cursor.epoch, state_.cursor.position); }
  double epoch() const {
    return state_.cursor.epoch + static_cast<double>(state_.cursor.position) / static_cast<double>(dataset_size_);
  }
  double lr_multiplier() const { return policy_step_.multiplier; }
  int64_t global_batch() const { return plan_.global_size > 0 ? plan_.global_size : batch_size_ * world(); }
  bool writer() const { return session_->writer(); }
  bool left() const { return left_; }
  bool elastic() const { return session_->elastic(); }
  bool in_step() const { return in_step_; }
  double last_loss() const { return last_loss_; }
  std::string run_dir() const { return session_ ? const_cast<train::Session&>(*session_).run_dir().path() : ""; }
  const std::vector<int64_t>& batch_ids() const { return plan_.ids; }

  // An evaluation across the members: this member's share of `n`
  // samples (contiguous, by rank: every sample once across the group).
  py::tuple eval_share(int64_t n) const {
    const int w = world(), r = rank();
    return py::make_tuple(n * r / w, n * (r + 1) / w);
  }
  // The members' sums of `values` (each member's row in an agreement of
  // maxima, exact, then added in rank order: the same bits everywhere).
  // None: a member was lost, the group re-formed; evaluate again.
  // After training (`ended`: the group no longer re-forms) a failure gives
  // None too, and the caller evaluates the whole set itself.
  py::object eval_reduce(const std::vector<double>& values, bool ended) {
    const int64_t k = static_cast<int64_t>(values.size());
    auto rows = torch::full({world(), k}, -std::numeric_limits<double>::infinity(), torch::kFloat64);
    for (int64_t j = 0; j < k; ++j) rows[rank()][j] = values[static_cast<size_t>(j)];
    bool done = false;
    {
      py::gil_scoped_release no_gil;
      try {
        if (ended) {
          try {
            rule().agree_max(rows);
            done = true;
          } catch (const Error& e) {
            log_warn(std::string("evaluation after training: ") + e.what() + "; this member evaluates it all");
          }
        } else {
          done = session_->collective("evaluation", [&] { rule().agree_max(rows); });
        }
      } catch (const train::CompletedElsewhere& e) {
        log_warn(std::string(e.what()) + " (in an evaluation); this member ends");
        left_ = true;
      }
    }
    if (!done) return py::none();
    std::vector<double> sums(static_cast<size_t>(k), 0.0);
    auto a = rows.accessor<double, 2>();
    for (int64_t i = 0; i < rows.size(0); ++i)
      for (int64_t j = 0; j < k; ++j) sums[static_cast<size_t>(j)] += a[i][j];
    return py::cast(sums);
  }

  // Limbo's optimizer: its state by name (whole, gathered from the shards
  // when sharded: a collective, every member calls it alike) and its count.
  py::dict optimizer_state() {
    {
      py::gil_scoped_release no_gil;
      session_->gather_state("optimizer_state()", true);
    }
    auto& opt = opt_->optimizer();
    py::dict d;
    const auto names = opt.state_names();
    for (size_t i = 0; i < names.size() && opt.has_state(); ++i) d[py::str(names[i])] = opt.state()[i].clone();
    d["step"] = opt.steps();
    return d;
  }

 private:
  train::UpdateRule& rule() { return session_->rule(); }
  const train::UpdateRule& rule() const { return const_cast<train::Session&>(*session_).rule(); }

  void need_step(const char* what) const {
    if (!in_step_)
      throw InvalidInput(std::string(what) + " outside the training loop: call it for a batch of "
                         "`for batch in job.batches(loader)`, once a batch");
  }

  // A model changed after the job took it (a parameter's data replaced, a
  // layer resized): its tensors are no longer Limbo's views.
  void check_model() const {
    const auto& ps = flat_->parameters();
    const auto& es = flat_->entries();
    const float* base = flat_->data().data_ptr<float>();
    for (size_t i = 0; i < ps.size(); ++i) {
      if (ps[i].defined() && ps[i].scalar_type() != torch::kFloat32)
        throw InvalidInput("parameter '" + es[i].name + "' became " + std::string(c10::toString(ps[i].scalar_type())) +
                           " after limbo.Job took the model (model.half() or .to(dtype)?); Limbo trains float32 "
                           "parameters: keep the model in float32 and compute in bf16 under torch.autocast");
      if (!ps[i].defined() || ps[i].sizes().vec() != es[i].shape || ps[i].data_ptr<float>() != base + es[i].offset)
        throw InvalidInput("parameter '" + es[i].name + "' changed after limbo.Job took the model (its data was "
                           "replaced or resized); build the model completely before creating the job");
    }
  }

  // Each parameter's gradient back to its view of the flat gradient: a
  // gradient autograd or the user put elsewhere is copied in (keep), or
  // dropped (the step starts from zero).
  void attach_grads(bool keep) {
    torch::NoGradGuard no_grad;
    auto& ps = const_cast<std::vector<torch::Tensor>&>(flat_->parameters());
    for (size_t i = 0; i < ps.size(); ++i) {
      const auto& view = flat_->grad_views()[i];
      auto& g = ps[i].mutable_grad();
      if (g.defined() && g.data_ptr() == view.data_ptr() && g.sizes() == view.sizes() && g.strides() == view.strides())
        continue;
      if (keep) {
        if (g.defined()) view.copy_(g);
        else view.zero_();
      }
      g = view;
    }
  }

  train::StepContext context(double loss) {
    return {flat_->data(), flat_->grad(), flat_->grad_with_slot(), loss, plan_.samples(), plan_.global_size,
            rate(), state_.step, {}};
  }
  // The step's rate as the rule applies it: Limbo's optimizer's scheduled
  // rate times the batch policy's multiplier (a torch.optim optimizer:
  // the multiplier, which _optimizer_step applies to its groups).
  double rate() const { return own_ ? lr_ * policy_step_.multiplier : policy_step_.multiplier; }

  void log_step() {
    if (!((window_.steps() > 0 && state_.step % log_every_ == 0) || plan_.last_in_epoch)) return;
    train::StepRecord rec;
    rec.step = state_.step;
    rec.epoch = epoch();
    rec.samples = state_.samples;
    rec.lr_multiplier = policy_step_.multiplier;
    rec.batch_size = last_global_;
    rec.skipped_steps = state_.skipped_steps;
    rec.workers = world();
    if (opt_->clip_norm() > 0 && !std::isnan(opt_->last_norm())) rec.grad_norm = opt_->last_norm();
    auto j = train::step_record(rec, window_);
    for (const auto& [k, v] : user_) j[k] = v;
    session_->run_dir().append_metrics(j);
    window_.reset();
    user_.clear();  // job.log()'s numbers go on one line: the next one's are the next steps
  }

  py::function pack_, unpack_, step_;
  std::function<bool()> get_leave_;
  std::shared_ptr<torch::nn::Module> model_;
  std::unique_ptr<optim::FlatParams> flat_;
  std::shared_ptr<train::OptimizerStep> opt_;
  std::shared_ptr<train::OptimizerStep> outer_;  // DiLoCo's outer optimizer (null: sync="step")
  train::DilocoOptions diloco_;
  std::unique_ptr<train::OuterSteps> outer_steps_;
  std::optional<train::OuterSteps::Work> work_;  // this member's share of the outer step in progress
  int64_t inner_index_ = 0;
  std::vector<int64_t> committed_;
  int64_t committed_epoch_ = 0;
  std::unique_ptr<optim::BatchSizePolicy> policy_;
  std::unique_ptr<data::Sampler> sampler_;
  train::TrainState state_;
  std::unique_ptr<train::Session> session_;
  std::unique_ptr<train::StepContext> ctx_;
  std::deque<data::BatchPlan> plans_;
  data::BatchPlan plan_;
  optim::BatchSizePolicy::Step policy_step_;
  std::vector<torch::Tensor> buffers_before_;
  train::MetricsWindow window_;
  std::map<std::string, double> user_;
  Clock::time_point wall_start_ = Clock::now(), step_start_ = Clock::now();
  int64_t batch_size_ = 0, dataset_size_ = 0, epochs_ = 1, max_steps_ = 0, log_every_ = 50;
  int64_t generation_ = 0, samples_this_run_ = 0, last_global_ = 0;
  int static_rank_ = -1;  // a static job's rank (elastic: the session's)
  double train_seconds_ = 0, last_loss_ = NAN;
  bool drop_last_ = false, resume_ = false, in_step_ = false, backward_started_ = false, left_ = false;
  bool own_ = false, shard_state_ = false;  // Limbo's optimizer (limbo.Optimizer), its state sharded
  double lr_ = 0;                           // Limbo's optimizer: this step's scheduled rate
  int64_t accumulate_ = 1, backwards_ = 0;  // micro-batches a step, and this step's so far
  double loss_sum_ = 0;
};

}  // namespace
}  // namespace limbo::python

PYBIND11_MODULE(_core, m) {
  using limbo::python::Core;
  m.doc() = "Limbo's elastic step for a training loop in Python (use the `limbo` package)";
  static py::exception<limbo::InvalidInput> invalid(m, "InvalidInput", PyExc_ValueError);
  static py::exception<limbo::Error> error(m, "LimboError", PyExc_RuntimeError);
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const limbo::InvalidInput& e) {
      invalid(e.what());
    } catch (const limbo::train::Interrupted& e) {
      // Asked to stop (Ctrl-C, SIGTERM, Slurm's warning) while waiting for a
      // group: as Python would end on the signal.
      const int sig = limbo::elastic::leave_signal();
      if (sig == SIGINT) {
        PyErr_SetString(PyExc_KeyboardInterrupt, e.what());
      } else {
        py::object code = py::int_(limbo::elastic::exit_code_for(sig));
        PyErr_SetObject(PyExc_SystemExit, code.ptr());
      }
    } catch (const limbo::Error& e) {
      error(e.what());
    }
  });
  py::class_<Core>(m, "Core")
      .def(py::init<const limbo::python::Named&, const limbo::python::Named&, const py::dict&, py::function,
                    py::function, py::function>())
      .def("start", &Core::start)
      .def("complete", &Core::complete)
      .def("plan", &Core::plan)
      .def("clear_plans", &Core::clear_plans)
      .def("outer_finish", &Core::outer_finish)
      .def("committed_ids", &Core::committed_ids)
      .def_property_readonly("diloco", &Core::diloco)
      .def("begin_step", &Core::begin_step)
      .def("backward_starts", &Core::backward_starts)
      .def("no_sync", &Core::no_sync)
      .def("step", &Core::step)
      .def("after_step", &Core::after_step)
      .def("checkpoint", &Core::checkpoint)
      .def("log", &Core::log)
      .def("record", &Core::record)
      .def("end_training", &Core::end_training)
      .def("finish", &Core::finish)
      .def("global_ids", &Core::global_ids)
      .def("batch_ids", &Core::batch_ids)
      .def("optimizer_state", &Core::optimizer_state)
      .def("eval_share", &Core::eval_share)
      .def("eval_reduce", &Core::eval_reduce)
      .def_property_readonly("world", &Core::world)
      .def_property_readonly("rank", &Core::rank)
      .def_property_readonly("generation", &Core::generation)
      .def_property_readonly("steps", &Core::steps)
      .def_property_readonly("samples", &Core::samples)
      .def_property_readonly("cursor", &Core::cursor)
      .def_property_readonly("epoch", &Core::epoch)
      .def_property_readonly("lr_multiplier", &Core::lr_multiplier)
      .def_property_readonly("global_batch", &Core::global_batch)
      .def_property_readonly("writer", &Core::writer)
      .def_property_readonly("left", &Core::left)
      .def_property_readonly("elastic", &Core::elastic)
      .def_property_readonly("in_step", &Core::in_step)
      .def_property_readonly("last_loss", &Core::last_loss)
      .def_property_readonly("run_dir", &Core::run_dir);
}
