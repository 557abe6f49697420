// What one call of Trainer::run() keeps between steps (trainer.cc, and
// DiLoCo's outer step in trainer_diloco.cc). Private to the trainer.
#pragma once

#include <memory>

#include "common/progress.h"
#include "train/trainer.h"

namespace limbo::train {

// Everything one call of run() keeps between steps.
struct Trainer::Run {
  Run(const TrainOptions& opt, Session& session) : t(opt), elastic(session.elastic()), s(session), run_dir(session.run_dir()) {}

  const TrainOptions& t;
  const bool elastic;
  Session& s;
  RunDir& run_dir;
  std::unique_ptr<data::BatchLoader> loader;
  std::unique_ptr<data::Sampler> log_sampler;
  std::unique_ptr<Progress> progress;
  int64_t n = 0, total_steps = 0, resumed_from = -1;
  Clock::time_point wall_start = Clock::now();
  bool left = false;

  // This step.
  data::Batch batch;
  optim::BatchSizePolicy::Step policy;
  double lr = 0, epoch_progress = 0;
  StepResult res;

  // Metrics.
  EvalResult last_eval;
  int64_t last_eval_step = -1, samples_this_run = 0;
  double train_seconds = 0, last_loss = NAN;
  // Forward and backward (with elastic.overlap, the bucket all-reduces run
  // meanwhile on the communication thread): the compute utilisation's
  // numerator, against train_seconds.
  double compute_seconds = 0;
  MetricsWindow window;
  double norm_sum = 0;  // pre-clip gradient norms in the window (clipping on)
  int64_t norm_n = 0;
  double isgd_extra_seconds = 0, plain_step_seconds = 0;
  int64_t plain_steps = 0;

  double epoch_now(const data::Cursor& c) const {
    return c.epoch + static_cast<double>(c.position) / n;
  }
};

}  // namespace limbo::train

namespace limbo::train {

// DiLoCo's outer step in progress on this member (trainer_diloco.cc).
struct Trainer::Outer {
  Outer(int64_t n, data::Order order, uint64_t seed) : sampler(n, order, seed) {}
  data::Sampler sampler;
  // The outer step whose inner work this member holds: begun at committed
  // step plan_step (-1: none), as member plan_rank of the plan's world
  // (-1: it joined an outer step others had done, with no share).
  int64_t plan_step = -1;
  int plan_rank = -1;
  OuterPlan plan;
  torch::Tensor global;  // the committed global weights the inner steps began from
  torch::Tensor delta;   // this member's pseudo-gradient, global - local (kept for a redo)
  std::vector<torch::Tensor> local_buffers;  // the buffers after its inner steps (kept for a redo)
  bool inner_done = false;
  bool redo = false;      // this outer step's sync is being redone after a re-formation
  int64_t consumed = 0;  // samples of its share processed
  double loss_sum = 0;   // their losses, each times its batch
  int64_t inner_steps = 0;   // inner steps of this outer step
  double inner_seconds = 0;  // forward and backward of this outer step's inner steps
  bool reformed = false;     // the group (re)formed since the last outer step began
  // The fastest member's seconds a sample of inner steps in the last outer
  // step (0: not known yet), which bounds the next one's wait.
  double fastest_per_sample = 0;
  int64_t stopped_early = 0;
  double inner_wall = 0;  // the inner steps' wall time in this outer step  // outer steps in which this member stopped before its share's end
  // Totals over the run.
  int64_t inner_steps_total = 0, inner_skipped = 0, outer_redone = 0;
  double compute_seconds = 0, wall_seconds = 0, sync_seconds = 0;
  int64_t payload_bytes = 0;  // pseudo-gradient bytes this member contributed to outer all-reduces
  Clock::time_point began = Clock::now();
};

}  // namespace limbo::train
