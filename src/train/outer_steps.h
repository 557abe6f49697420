// DiLoCo's outer step (elastic.sync = "diloco"), as every front end drives
// it: the CLI's Trainer (train/trainer_diloco.cc) and the Python module. The
// plan of samples and its settlement are train/diloco.h; the rules are
// docs/diloco.md.
//
// One outer step of this member:
//   1. begin(): after a (re)formation the group first agrees whether an
//      outer step is being redone (some member finished its inner steps and
//      the sync failed); then no member starts new inner work, and a member
//      without work of that step (a joiner, or one whose work is stale)
//      takes part with no samples. Otherwise the outer step is planned from
//      the committed state and this member gets its share, as inner batches
//      of sample ids;
//   2. the front end runs the inner steps alone (its inner optimizer,
//      locally), asking keep_going() before each (the bounded wait) and
//      reporting each with inner_step_done();
//   3. finish(): the members agree on what each processed (plan rank and
//      samples: one small all-reduce), then the update rule all-reduces the
//      pseudo-gradients weighted by those samples and applies the outer
//      optimizer to the global weights (Session::apply: a failure re-forms,
//      and the outer step is redone by the survivors); the commit moves the
//      cursor and leaves what no surviving member processed owed.
// Every collective of an outer step is one of the Session's group, so a
// failure anywhere re-forms the group and begin() is called again.
//
// Streaming DiLoCo (diloco.fragments = F > 1): the outer step is a unit of
// H / F inner steps that syncs one fragment of the parameters, fragment
// (committed step mod F), with the pseudo-gradient it accumulated since its
// last sync (H inner steps), each member weighted by its samples since
// then; the outer optimizer updates that fragment of the global weights,
// and the member's local fragment becomes alpha x local + (1 - alpha) x
// global. Between units the Session's weights are the global ones (what
// checkpoints and state sync carry); each member keeps its local weights
// aside and trains on them. With diloco.overlap_steps = tau the fragment's
// all-reduce runs on a thread while the front end runs the next unit's
// first tau inner steps (finish()'s run_ahead), planned from this unit's
// agreement; if the all-reduce fails they are undone (local weights and
// inner optimizer back as before them) and the unit is redone, and if the
// next unit's plan turns out different (the group re-formed) they are
// undone the same way. Never across an epoch's end or a membership change
// the agreement announced. Module buffers (BatchNorm statistics) ride in
// every unit's agreement, each member's row with its own, and are averaged
// (weighted by the unit's samples; integer ones take the maximum) when the
// unit commits.
#pragma once

#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include <functional>
#include <memory>
#include <optional>
#include <vector>

#include "common/timing.h"
#include "data/sampler.h"
#include "optim/flat_params.h"
#include "train/diloco.h"
#include "train/session.h"
#include "train/update_rule.h"

namespace limbo::train {

// Streaming's F contiguous fragments [lo, hi) of the flat parameters, cut
// on parameter boundaries near multiples of numel / F (one: the whole);
// InvalidInput when F exceeds the parameter tensors.
std::vector<std::pair<int64_t, int64_t>> cut_fragments(const optim::FlatParams& flat, int64_t F);
// The outer optimizer's update of w[lo, hi) by the gradient g (hi - lo
// values, contiguous), its state allocated whole (zeros) at the first.
void outer_update_slice(optim::Optimizer& opt, torch::Tensor& w, const torch::Tensor& g, int64_t lo, int64_t hi,
                        double lr);

// Streaming's module buffers (BatchNorm statistics): every buffer's values
// as one flat float64 row, in FlatParams' buffer order.
torch::Tensor buffer_row(const optim::FlatParams& flat);
// The members' rows [W, buffer values] averaged in rank order: floating
// buffers weighted by `weights` (the samples each member processed in the
// unit; they sum to more than 0), integer and bool buffers (BatchNorm's
// batch count) their maximum. In the buffers' shapes and types.
std::vector<torch::Tensor> average_buffers(const optim::FlatParams& flat, const torch::Tensor& rows,
                                           const std::vector<double>& weights);
// Puts the average in, keeping what this member's buffers moved since
// `agreed` (its row's buffers; inner steps run ahead of the sync since):
// buffer = average + (buffer - agreed); a bool buffer takes the average.
void take_buffer_average(optim::FlatParams& flat, const std::vector<torch::Tensor>& average,
                         const std::vector<torch::Tensor>& agreed);

class OuterSteps {
 public:
  struct Options {
    DilocoOptions diloco;
    int64_t batch = 1;    // samples an inner step (data.batch_size)
    int64_t samples = 0;  // an epoch's samples
    data::Order order = data::Order::Shuffle;
    uint64_t seed = 1;
    int64_t max_steps = 0;  // the run stops after this outer step (train.max_steps; 0: none)
  };
  // `outer`: the outer optimizer (the one the rule applies), which
  // streaming updates a fragment at a time.
  OuterSteps(Session& session, optim::FlatParams& flat, std::shared_ptr<UpdateRule> rule,
             std::shared_ptr<OptimizerStep> outer, Options opt);

  // The Session (re)formed the group (its on_reform): shares by pace start
  // equal again (a new group has not measured itself).
  void reformed() {
    reformed_ = true;
    pace_shares_.clear();
    per_sample_.clear();
  }

  struct Work {
    int64_t epoch = 0;
    std::vector<std::vector<int64_t>> batches;  // sample ids of each inner step (empty: no inner work)
    int64_t first = 0;  // the unit's index of batches[0] (inner steps run ahead of it came first)
  };
  // Step 1. nullopt: the group re-formed while agreeing; call begin() again.
  std::optional<Work> begin();
  // Before each inner step: false once the bounded wait is over (this
  // member stops; the rest of its share is dealt again). Never before the
  // first inner step.
  bool keep_going();
  // Where inner step i's learning rate is read in the schedule: the epoch
  // by the samples the whole group has dealt so far, and the iteration.
  double inner_epoch(int64_t i) const;
  int64_t inner_iteration(int64_t i) const;
  // After an inner step: its sample ids, its loss, whether its update was
  // applied (false: its gradient or loss was not finite), and the seconds
  // its forward and backward took.
  void inner_step_done(const std::vector<int64_t>& ids, double loss, bool applied, double compute_seconds);

  struct Committed {
    StepResult res;              // the group's mean inner loss and the samples committed
    OuterSettled settled;        // the cursor, what is owed, the positions committed
    int64_t epoch = 0;           // the epoch they are of
    double sync_seconds = 0;     // the agreement and the outer all-reduce and update
    double delta_norm = 0;       // this member's pseudo-gradient norm
    int64_t inner_steps = 0;     // this member's inner steps in this outer step
    double compute_seconds = 0;  // their forward and backward
    double wall_seconds = 0;     // the outer step's wall time on this member
    int fragment = 0;            // the fragment it synced (streaming; 0 otherwise)
    std::vector<double> shares;  // shares by pace: each plan rank's fraction of the step's samples (else empty)
    int64_t payload_bytes = 0;   // pseudo-gradient bytes this member sent into its all-reduce
    // The sample ids this member's inner steps that count in it trained
    // (those run ahead of the last sync and kept included), in order.
    std::vector<int64_t> trained;
  };
  // Step 3. nullopt: the group re-formed (call begin() again).
  // `before_all_reduce` (may be empty) runs after the agreement (a testing
  // aid of the trainer's).
  std::optional<Committed> finish(const std::function<void(bool redo)>& before_all_reduce = {},
                                  const std::function<void(const Work&)>& run_ahead = {});
  // The inner optimizer (the front end's), which overlapped inner steps
  // undo with the weights; may be null (then no overlap).
  void set_inner(optim::Optimizer* inner) { inner_opt_ = inner; }
  // The fragments [lo, hi) of the flat parameters (one: the whole).
  const std::vector<std::pair<int64_t, int64_t>>& fragments() const { return fragments_; }
  // The inner optimizer's state as of the last commit: inner steps run
  // ahead of it are not committed, so a checkpoint keeps the state before
  // them (null: none ran ahead; the optimizer's own state is it).
  const optim::Optimizer::Snapshot* inner_before_ahead() const { return ahead_ ? &ahead_->inner_before : nullptr; }

  const std::vector<int64_t>& epoch_order(int64_t epoch) { return sampler_.epoch_order(epoch); }
  // The metrics record of a committed outer step (kind "outer"), at
  // `epoch` with `workers` members, and the run's figures for summary.json:
  // the same fields from every front end.
  nlohmann::json record(const Committed& c, double epoch, int workers) const;
  nlohmann::json summary() const;
  // This member's rank in the outer step's plan (-1: no share).
  int plan_rank() const { return plan_rank_; }
  bool redo() const { return redo_; }

  // Totals over the run (this member's).
  int64_t inner_steps_total = 0, inner_skipped = 0, outer_redone = 0, stopped_early = 0;
  double compute_seconds = 0, wall_seconds = 0, sync_seconds = 0;
  int64_t payload_bytes = 0;  // pseudo-gradient bytes this member contributed to outer all-reduces
  int64_t overlapped_steps = 0, ahead_undone = 0;  // inner steps run ahead of a sync, and those undone

 private:
  // After a (re)formation: whether some member redoes an outer step.
  bool agree_on_redo();
  void plan_new();
  // The plan of the outer step after `cursor` with `owed` for `world`
  // members: by the shares by pace in force (equal without); `this_step`:
  // the step being synced, whose redo may carry its agreed offsets.
  OuterPlan plan_for(data::Cursor cursor, const PositionRanges& owed, int world, bool this_step) const;
  // Shares by pace: the next plans' shares from an agreement in which every
  // member of the group measured its pace (otherwise they stay).
  void take_paces(const std::vector<double>& per_sample, int plan_world);
  // Work of the current committed step as plan rank `plan_rank`, its inner
  // steps `done` already (a member with no share) or still to run.
  void start_work(int plan_rank, bool done);

  bool streaming() const { return fragments_.size() > 1; }
  // The totals and the step's figures once it committed.
  Committed committed(Committed c, Clock::time_point sync_start);
  int64_t measured_payload(int64_t n) const;
  // Streaming's sync of fragment f: nullopt when the group re-formed.
  std::optional<Committed> finish_fragment(const std::function<void(bool)>& before_all_reduce,
                                           const std::function<void(const Work&)>& run_ahead);
  // The agreement's row of this member, its all-reduce, and what it says.
  struct Agreed {
    int plan_world = 0;
    int64_t total = 0;       // samples processed in this outer step
    double loss_sum = 0;
    std::vector<int64_t> consumed;  // by plan rank
    double flag = 0;         // the membership-change flags' sum
    double weight_total = 0;  // streaming: the members' samples since the fragment's last sync
    std::vector<double> per_sample;  // each member's (group rank's) seconds a sample of inner steps (0: none)
    // Streaming with buffers: the members' buffers averaged (empty: none).
    std::vector<torch::Tensor> buffers;
  };
  std::optional<Agreed> agree(double weight);
  // Work of `plan` for plan rank `p`, from inner batch `from` on.
  Work work_of(const OuterPlan& plan, int p, int64_t from) const;
  // Puts the local weights in / the global ones back (streaming).
  void swap_in_local();
  // Inner steps run ahead of a sync that are not to count: the local
  // weights and the inner optimizer back as before them.
  void undo_ahead();
  // The committed state is no longer the one the local weights grew from
  // (a fallback to a checkpoint, or a newer state taken from the group):
  // local weights, inner steps run ahead and samples since each
  // fragment's sync are forgotten, nothing restored over what the state
  // sync or the checkpoint put in.
  void forget_local();

  Session& s_;
  optim::FlatParams& flat_;
  std::shared_ptr<UpdateRule> rule_;
  std::shared_ptr<OptimizerStep> outer_;
  optim::Optimizer* inner_opt_ = nullptr;
  std::vector<std::pair<int64_t, int64_t>> fragments_;
  std::vector<int64_t> since_sync_;  // this member's samples since each fragment's last sync
  torch::Tensor local_;              // streaming: this member's local weights (undefined: the global ones)
  int64_t local_step_ = -1;          // the committed step they (and since_sync_, ahead_) follow
  // Overlap: the unit planned ahead and its inner steps already run (as
  // plan rank ahead_rank_ of ahead_plan_), and the state to undo them to.
  struct Ahead {
    OuterPlan plan;
    int rank = -1;
    int64_t step = -1;  // the committed step it follows
    int64_t batches = 0;
    int64_t consumed = 0, inner_steps = 0;
    double loss_sum = 0, compute = 0, wall = 0;
    int64_t skipped = 0;
    std::vector<int64_t> ids;              // the samples they trained
    int64_t cursor_position = 0;           // the cursor it was planned from
    torch::Tensor local_before;            // local weights before them (the synced fragment mixed in)
    std::vector<torch::Tensor> buffers_before;  // the module's buffers before them (the average put in)
    optim::Optimizer::Snapshot inner_before;
  };
  std::optional<Ahead> ahead_;
  bool running_ahead_ = false;
  Options opt_;
  data::Sampler sampler_;
  bool reformed_ = false;
  // The outer step whose inner work this member holds: begun at committed
  // step plan_step_ (-1: none), as member plan_rank_ of the plan's world
  // (-1: it joined an outer step others had done, with no share).
  int64_t plan_step_ = -1;
  int plan_rank_ = -1;
  OuterPlan plan_;
  torch::Tensor global_;  // the committed global weights the inner steps began from
  std::vector<torch::Tensor> unit_buffers_;  // plain: the committed buffers the inner steps began from
  torch::Tensor delta_;   // this member's pseudo-gradient, global - local (kept for a redo)
  std::vector<torch::Tensor> local_buffers_;  // the buffers after its inner steps (kept for a redo)
  std::vector<torch::Tensor> agreed_buffers_;  // streaming: the buffers this member's row carried
  bool inner_done_ = false;
  bool redo_ = false;
  int64_t consumed_ = 0;  // samples of its share processed
  std::vector<int64_t> trained_;  // their ids
  double loss_sum_ = 0;   // their losses, each times its batch
  int64_t inner_steps_ = 0;
  double inner_compute_ = 0;  // forward and backward of this outer step's inner steps
  double inner_wall_ = 0;     // the inner steps' wall time
  // The fastest member's seconds a sample of inner steps in the last outer
  // step (0: not known yet), which bounds the next one's wait.
  double fastest_per_sample_ = 0;
  double bound_ = -1;  // this outer step's bounded wait in seconds (-1: none)
  // Shares by pace (opt_.diloco.pace): the fractions the next plans use, by
  // group rank (empty: equal), the members' seconds a sample in the last
  // agreement, and a redone step's offsets as its planners agreed them
  // (empty: none), which a member that did not plan it deals by.
  std::vector<double> pace_shares_;
  std::vector<double> per_sample_;
  std::vector<int64_t> redo_offsets_;
  Clock::time_point began_ = Clock::now(), inner_start_ = Clock::now();
};

}  // namespace limbo::train
