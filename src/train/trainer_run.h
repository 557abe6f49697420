// What one call of Trainer::run() keeps between steps (trainer.cc, and
// DiLoCo's outer step in trainer_diloco.cc). Private to the trainer.
#pragma once

#include <memory>

#include "common/progress.h"
#include "train/trainer.h"

namespace limbo::train {

// Testing aid (train.testing_die_with_host): sends `sig` to every other
// process of this network namespace, a virtual host of the tests
// (InvalidInput outside one).
void kill_this_host(int sig);

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
  // meanwhile on the communication thread): the compute share's
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

