// limbo._core's Core: the elastic step of train/session.h for a training
// loop in Python (python/limbo/__init__.py wraps it; docs/python.md).
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
// The class is defined by concern, one file each, compiled as one unit:
//   settings.cc  the job's settings (limbo.Job's keywords) and its making
//   model.cc     the user's module as Limbo sees it, and changes to it
//   step.cc      the data plan, the step and its reduction, the commit
//   diloco.cc    sync="diloco": inner steps and the outer step
//   evaluate.cc  evaluation across the members
//   ending.cc    records, checkpoints, the final state and summary
//   module.cc    the Python bindings
#pragma once

#include <torch/extension.h>

#include <pybind11/functional.h>
#include <pybind11/stl.h>

#include <deque>
#include <map>
#include <optional>

#include "common/error.h"
#include "common/log.h"
#include "data/sampler.h"
#include "elastic/join.h"
#include "optim/batch_policy.h"
#include "optim/flat_params.h"
#include "optim/optimizer.h"
#include "train/outer_steps.h"
#include "train/session.h"
#include "train/step.h"
#include "train/update_rule.h"

namespace py = pybind11;

namespace limbo::python {

using Named = std::vector<std::pair<std::string, torch::Tensor>>;

// A torch::nn::Module tree that names the user's tensors as the Python
// module does ("block.0.weight": child "block", its child "0", parameter
// "weight"), holding the very same tensors: checkpoints then carry the
// usual dotted names, and loading one writes into the user's parameters.
std::shared_ptr<torch::nn::Module> module_tree(const Named& params, const Named& buffers);

template <typename T>
T get(const py::dict& d, const char* key, T fallback) {
  return d.contains(key) ? d[key].cast<T>() : fallback;
}

class Core {
 public:
  // The job from limbo.Job's settings `o` over the user's tensors; `pack`,
  // `unpack` carry the Python side's state (the user's optimizer, `state`,
  // schedulers) as bytes, `step` is the user's optimizer step.
  Core(const Named& params, const Named& buffers, const py::dict& o, py::function pack, py::function unpack,
       py::function step);

  // Resume, form the group, write the configuration. False: training
  // completed elsewhere before this member got in.
  bool start();
  bool complete() const {
    return state_.cursor.epoch >= epochs_ || (max_steps_ > 0 && state_.step >= max_steps_) || left_;
  }

  // The next batch of this member from `at` (the sampler's position), or
  // None past the end; the plan is queued for begin_step().
  // `first_step` is the committed step count when the sampler started and
  // `steps_ahead` the batches it planned since: the batch is step
  // first_step + steps_ahead + 1.
  py::object plan(int64_t epoch, int64_t position, int64_t first_step, int64_t steps_ahead);
  void clear_plans() { plans_.clear(); }

  // DiLoCo: the sampler's pass is this member's share of the outer step
  // (the first call begins it: after a re-formation the group agrees first,
  // a collective); None past its end, once the bounded wait is over, or
  // when the group re-formed meanwhile (the loop starts again).
  py::object plan_inner(int64_t epoch, int64_t position, int64_t k);

  // DiLoCo: the outer step after this member's inner steps. True: it
  // committed; false: the group re-formed (the loop starts again) or
  // training completed elsewhere (left()).
  bool outer_finish();
  bool diloco() const { return outer_steps_ != nullptr; }
  // The last committed outer step's samples (every member's processed
  // ones, in plan order) and their epoch.
  py::tuple committed_ids() const { return py::make_tuple(committed_epoch_, committed_); }

  // A batch of the loader arrived: its plan becomes the step's.
  void begin_step();

  // shard="full": the units (name, [(begin, end), ...] of the flat
  // weights), and a unit's weights gathered from the members' shards or
  // given back (collectives: every member calls them alike; no-ops when the
  // weights are not sharded, or already so).
  py::list units() const;
  // `forward`: before the unit's forward (else before its backward). The
  // next unit's gather is handed over at once, to run while this one
  // computes: in forward the one that came next in the last step's forward,
  // in backward the one before this in this step's forward. release_unit()
  // keeps the last unit of forward for backward, which begins with it.
  void gather_unit(int u, bool forward);
  void release_unit(int u);

  // job.no_sync(): backwards add to this member's gradient only.
  void no_sync(bool on) { rule().no_sync(on); }

  // Before each of the user's backwards of a step (`accumulate` of them:
  // micro-batches): before the first, the gradient is zeroed (and
  // re-attached where the user's zero_grad(set_to_none=True) dropped it);
  // before the last, the rule may start reducing buckets as backward fills
  // them. `loss` is the micro-batch's (already divided by `accumulate`, as
  // its gradient is): the step's loss is their sum.
  void backward_starts(double loss, double lr);
  void arm(double loss);

  // The step: the gradient reduced, the update (the user's optimizer
  // through set_external), the commit. False: a peer failed, the step did
  // not commit, the group re-formed (or training completed elsewhere:
  // left()); the loop redoes it from the committed cursor.
  // 1: committed; 0: did not commit (re-formed, or left()); 2: DiLoCo's
  // inner step, applied (or skipped) on this member alone.
  int step(double loss, double lr);

  // After the committed step (and the user's scheduler step): the metrics
  // line, then an agreed membership change. True: this member left.
  bool after_step();

  void checkpoint(const std::string& why);
  void log(const py::dict& metrics);
  void record(const std::string& kind, const py::dict& fields);

  // Training ended: the sharded state gathered, completion published, this
  // member off the coordinator's watch. False: completed elsewhere.
  bool end_training();

  // The final checkpoint and summary (with the user's fields), where this
  // member writes them. Returns the summary.
  std::string finish(const py::dict& fields);

  // The global batch of the current step (every member's ids, in order).
  std::vector<int64_t> global_ids();

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
  py::tuple eval_share(int64_t n) const;
  // The members' sums of `values` (each member's row in an agreement of
  // maxima, exact, then added in rank order: the same bits everywhere).
  // None: a member was lost, the group re-formed; evaluate again.
  // After training (`ended`: the group no longer re-forms) a failure gives
  // None too, and the caller evaluates the whole set itself.
  py::object eval_reduce(const std::vector<double>& values, bool ended);

  // Limbo's optimizer: its state by name (whole, gathered from the shards
  // when sharded: a collective, every member calls it alike) and its count.
  py::dict optimizer_state();
  // shard="full": the weights gathered whole on every member (a collective;
  // a member lost meanwhile re-forms the group and it is done again), until
  // the next step gives them back. A no-op otherwise.
  void gather_weights();

 private:
  train::UpdateRule& rule() { return session_->rule(); }
  const train::UpdateRule& rule() const { return const_cast<train::Session&>(*session_).rule(); }

  void need_step(const char* what) const;
  // A model changed after the job took it (a parameter's data replaced, a
  // layer resized): its tensors are no longer Limbo's views.
  void check_model() const;
  train::StepContext context(double loss);
  // The step's rate as the rule applies it: Limbo's optimizer's scheduled
  // rate times the batch policy's multiplier (a torch.optim optimizer:
  // the multiplier, which _optimizer_step applies to its groups).
  double rate() const { return own_ ? lr_ * policy_step_.multiplier : policy_step_.multiplier; }
  void log_step();

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
  // shard="full" (optim.shard_weights): the rule, and the units: their
  // names (unit 0, "": the parameters of no other unit), ranges of the flat
  // weights, and whether each is gathered now.
  std::shared_ptr<elastic::AllReduceUpdate> full_;
  std::vector<std::string> unit_names_;
  std::vector<std::vector<std::pair<int64_t, int64_t>>> unit_ranges_;
  std::vector<char> unit_gathered_;  // 0: not held, 1: its gather handed over (unit_ticket_), 2: held
  std::vector<int64_t> unit_ticket_;
  std::vector<int> unit_order_, last_unit_order_;  // the units in the order this and the last forward gathered them
  void issue_unit(int u);
  void wait_unit(int u);
  void units_between_steps();
  std::vector<int> unit_starts_;  // flat parameter indices that start a unit
  void plan_units(const std::vector<std::string>& names);
  // One process (no group), the user's optimizer, no clipping by Limbo:
  // nothing reads the flat gradient, so autograd's tensors stay the
  // parameters' `.grad` (no copy), as in a plain loop.
  bool grads_in_place_ = false;
  // Shares of the batch by pace (shares="pace"; none: equal slices).
  std::shared_ptr<data::PaceShares> paces_;
  double lr_ = 0;                           // Limbo's optimizer: this step's scheduled rate
  int64_t accumulate_ = 1, backwards_ = 0;  // micro-batches a step, and this step's so far
  double loss_sum_ = 0;
};

}  // namespace limbo::python
