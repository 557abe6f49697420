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
#pragma once

#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include <functional>
#include <optional>
#include <vector>

#include "common/timing.h"
#include "data/sampler.h"
#include "optim/flat_params.h"
#include "train/diloco.h"
#include "train/session.h"
#include "train/update_rule.h"

namespace limbo::train {

class OuterSteps {
 public:
  struct Options {
    DilocoOptions diloco;
    int64_t batch = 1;    // samples an inner step (data.batch_size)
    int64_t samples = 0;  // an epoch's samples
    data::Order order = data::Order::Shuffle;
    uint64_t seed = 1;
  };
  OuterSteps(Session& session, optim::FlatParams& flat, std::shared_ptr<UpdateRule> rule, Options opt);

  // The Session (re)formed the group (its on_reform).
  void reformed() { reformed_ = true; }

  struct Work {
    int64_t epoch = 0;
    std::vector<std::vector<int64_t>> batches;  // sample ids of each inner step (empty: no inner work)
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
  // After an inner step: its samples, its loss, whether its update was
  // applied (false: its gradient or loss was not finite), and the seconds
  // its forward and backward took.
  void inner_step_done(int64_t samples, double loss, bool applied, double compute_seconds);

  struct Committed {
    StepResult res;              // the group's mean inner loss and the samples committed
    OuterSettled settled;        // the cursor, what is owed, the positions committed
    int64_t epoch = 0;           // the epoch they are of
    double sync_seconds = 0;     // the agreement and the outer all-reduce and update
    double delta_norm = 0;       // this member's pseudo-gradient norm
    int64_t inner_steps = 0;     // this member's inner steps in this outer step
    double compute_seconds = 0;  // their forward and backward
    double wall_seconds = 0;     // the outer step's wall time on this member
  };
  // Step 3. nullopt: the group re-formed (call begin() again).
  // `before_all_reduce` (may be empty) runs after the agreement (a testing
  // aid of the trainer's).
  std::optional<Committed> finish(const std::function<void(bool redo)>& before_all_reduce = {});

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

 private:
  // After a (re)formation: whether some member redoes an outer step.
  bool agree_on_redo();
  void plan_new();
  // Work of the current committed step as plan rank `plan_rank`, its inner
  // steps `done` already (a member with no share) or still to run.
  void start_work(int plan_rank, bool done);

  Session& s_;
  optim::FlatParams& flat_;
  std::shared_ptr<UpdateRule> rule_;
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
  torch::Tensor delta_;   // this member's pseudo-gradient, global - local (kept for a redo)
  std::vector<torch::Tensor> local_buffers_;  // the buffers after its inner steps (kept for a redo)
  bool inner_done_ = false;
  bool redo_ = false;
  int64_t consumed_ = 0;  // samples of its share processed
  double loss_sum_ = 0;   // their losses, each times its batch
  int64_t inner_steps_ = 0;
  double inner_compute_ = 0;  // forward and backward of this outer step's inner steps
  double inner_wall_ = 0;     // the inner steps' wall time
  // The fastest member's seconds a sample of inner steps in the last outer
  // step (0: not known yet), which bounds the next one's wait.
  double fastest_per_sample_ = 0;
  double bound_ = -1;  // this outer step's bounded wait in seconds (-1: none)
  Clock::time_point began_ = Clock::now(), inner_start_ = Clock::now();
};

}  // namespace limbo::train
