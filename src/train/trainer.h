// The training loop (one loop for every mode).
//
// Trainer owns the data splits, the model (with flat parameters), the
// optimizer, the learning-rate schedule and the run directory. run() trains
// until `epochs` epochs or `max_steps` steps are complete, evaluating on the
// test split and checkpointing as configured, and returns the summary it also
// writes to summary.json. How a gradient becomes an update is the UpdateRule
// (local SGD by default; distributed modes install their own).
//
// Determinism: for a given seed and thread count, two runs produce the same
// weights; a run resumed from a checkpoint continues bit-for-bit where the
// uninterrupted run would be (the data order is a function of the cursor).
#pragma once

#include <nlohmann/json.hpp>

#include <memory>
#include <string>

#include "data/loader.h"
#include "data/registry.h"
#include "models/net.h"
#include "optim/batch_policy.h"
#include "optim/flat_params.h"
#include "optim/isgd.h"
#include "optim/lr_schedule.h"
#include "optim/optimizer.h"
#include "train/checkpoint.h"
#include "train/diloco.h"
#include "train/outer_steps.h"
#include "train/membership.h"
#include "train/session.h"
#include "train/step.h"
#include "train/threads.h"
#include "train/update_rule.h"

namespace limbo::train {

struct TrainOptions {
  int64_t epochs = 2;
  int64_t max_steps = 0;  // 0 = no step limit
  uint64_t seed = 1;
  int64_t log_every = 50;  // steps between metrics lines
  int64_t eval_every_epochs = 1;
  int64_t eval_every_steps = 0;  // 0 = off
  int64_t checkpoint_every_steps = 0;  // 0 = off
  int64_t checkpoint_every_epochs = 1;  // 0 = off (a final checkpoint is always written)
  bool resume = false;
  bool progress = true;
  // Testing aid: after completing this step (and its checkpoint, if any), the
  // process announces "paused at step N" on stderr and sleeps until killed.
  int64_t pause_at_step = 0;
  // Testing aid: every member appends "step epoch id id ..." (the global
  // batch) to <run_dir>/samples-<pid>.txt and "step epoch world id id ..."
  // (its own slice) to slices-<pid>.txt for every step it commits, and
  // writes a fingerprint of its final weights and buffers to final-<pid>.txt.
  bool sample_log = false;
  // Testing aid: every gradient computation also sleeps this long (a slow
  // worker or learner that is not dead).
  std::chrono::milliseconds slow_step{0};
  // Testing aid: slow_step applies only while an elastic job has fewer
  // workers than this (0: always), so that a test can give a joiner
  // seconds to get in without slowing the rest of the job.
  int pace_until_workers = 0;
  // Testing aid: slow_step applies only to the worker of this rank (-1:
  // every worker), a member slower than the others.
  int slow_rank = -1;
  // Testing aid: SIGKILL this process when its group enters ISGD's extra
  // iterations (the others then fail inside their all-reduces).
  bool die_in_isgd = false;
  // Testing aid: the member of rank die_rank SIGKILLs itself as it starts
  // step die_at_step + 1 (0 = never), before any collective of it.
  int64_t die_at_step = 0;
  int die_rank = 1;
  int64_t die_after_changes = 0;  // ... once the group has changed this many times
  bool die_without_home = false;  // ... and first removes its shard homes (both copies lost)
  // ... and first SIGKILLs every other process of its network namespace,
  // its launcher and the host's other workers: a whole (virtual) host lost.
  bool die_with_host = false;
  // ... by SIGSTOP instead (frozen: the process, its memory and its
  // connections stay; with die_with_host the whole host freezes).
  bool die_by_freezing = false;
  // Testing aid: the member that writes the run directory SIGKILLs itself
  // at this point of the job's ending: "last_step" (the last step's update
  // done, before it commits), "done" (training completed), "eval" (the
  // final evaluation), "checkpoint" (before the final checkpoint), "summary"
  // (before the summary); "hang": instead stops for ever before the final
  // checkpoint (a hung mount); "slow": waits 8 s there instead; "slow_done":
  // every member waits 3 s before it publishes the completion; "" never.
  std::string writer_dies_at;
  // Steps in a row whose gradient or loss is not finite (each skipped) after
  // which the run stops as diverged (0 = never).
  int64_t max_nonfinite_steps = 10;
  // Micro-batches per optimizer step (gradient accumulation); the loader's
  // batch_size is already the step's batch (accumulate x data.batch_size).
  int64_t accumulate = 1;
  // "fp32", or "bf16": forward (and so backward) under CPU autocast to
  // bfloat16 (TrainStep::set_bf16); weights, gradients, the all-reduce and
  // optimizer state stay float32.
  std::string precision = "fp32";
  // Testing aid (DiLoCo): with die_at_step (outer steps), the member dies
  // after the outer step's agreement, as the others enter the outer
  // all-reduce, instead of halfway through its inner steps.
  bool die_in_outer = false;
  // Testing aid: with die_at_step, the member dies after that step
  // committed, as the gather of its periodic checkpoint starts (between
  // steps), instead of as the step starts.
  bool die_in_gather = false;
};

struct TrainerConfig {
  data::DataSource source;
  data::LoaderOptions loader;
  // "auto": standardise built-in image datasets, leave tensor datasets as
  // they are; "none"; "standardize" (per-channel mean/std of the train split).
  std::string normalize = "auto";
  models::ModelOptions model;
  LossKind loss = LossKind::CrossEntropy;
  // optim.algorithm's optimizer (ISGD runs on SGD) and its settings.
  optim::OptimizerOptions optimizer;
  double clip_grad_norm = 0;  // optim.clip_grad_norm; 0 = off
  optim::LrScheduleOptions lr;
  optim::BatchPolicyOptions batch_policy;  // learning rate vs. global batch
  std::string algorithm = "sgd";  // "sgd" | "isgd" | "adam" | "adamw"
  // optim.shard_weights: the weights and the gradient sharded too (the flat
  // buffers lazy: pages only where a member writes).
  bool shard_weights = false;
  // elastic.sync: "step" (every step all-reduces the gradient) or "diloco"
  // (train/diloco.h: `optimizer` is the inner optimizer, the outer one is
  // SGD with diloco.outer_lr and Nesterov momentum).
  std::string sync = "step";
  DilocoOptions diloco;
  optim::IsgdOptions isgd;
  TrainOptions train;
  ThreadSettings threads;
  std::string run_dir;      // empty = no files written
  std::string config_toml;  // resolved config, stored in run dir and checkpoints
};

class Trainer {
 public:
  // Loads data, builds the model and checks that it fits the data; throws
  // InvalidInput (before anything is written).
  explicit Trainer(TrainerConfig cfg);
  ~Trainer();
  nlohmann::json run();

  models::Net& model() { return *model_; }
  TrainStep& step() { return *step_; }
  // Loss and accuracy of the current weights on the test split.
  EvalResult evaluate_test() { return step_->evaluate(splits_->test, norm_); }
  optim::FlatParams& params() { return *flat_; }
  optim::Optimizer& optimizer() { return opt_->optimizer(); }
  // The optimizer as the update rules apply it (clipping, then the update).
  std::shared_ptr<OptimizerStep> optimizer_step() { return opt_; }
  // The optimizer the update rule must apply: optimizer_step(), or with
  // elastic.sync = "diloco" the outer optimizer (the rule's gradient is
  // then the pseudo-gradient of an outer step).
  std::shared_ptr<OptimizerStep> rule_optimizer() { return outer_ ? outer_ : opt_; }
  bool diloco() const { return outer_ != nullptr; }
  const data::DatasetSplits& data() const { return *splits_; }
  const data::Normalization& normalization() const { return norm_; }
  const TrainState& state() const { return state_; }
  const optim::IsgdController* isgd() const { return isgd_.get(); }
  void set_update_rule(std::shared_ptr<UpdateRule> rule) { rule_ = std::move(rule); }
  // Elastic training: the rule must be the membership's all-reduce rule.
  void set_membership(std::unique_ptr<Membership> m) { membership_ = std::move(m); }
  // Shares of the batch by pace (elastic.shares = "pace"): the same object
  // as the rule's (elastic::ReduceOptions::paces).
  void set_paces(std::shared_ptr<data::PaceShares> paces) { paces_ = std::move(paces); }

 private:
  struct Run;  // the state of one run() (trainer.cc)
  void writer_dies_at(const char* point);
  void reformed(Run& r, const Membership::Established& est);
  bool train_step(Run& r);  // false when the step failed and the group re-formed
  // DiLoCo (trainer_diloco.cc): one outer step, its inner steps and the
  // outer all-reduce; false when it did not commit (the group re-formed).
  bool outer_step(Run& r);
  void diloco_state_hooks(SessionParts& parts);
  void log_step(Run& r);
  void after_epoch_and_step(Run& r);
  void eval_now(Run& r);
  double buffer_fingerprint() const;  // the sum of every buffer (sample_log)
  std::string optimizer_fingerprint();  // update count and each state tensor's sum (sample_log)
  nlohmann::json summary(Run& r);

  TrainerConfig cfg_;
  ThreadReport threads_;
  std::shared_ptr<data::DatasetSplits> splits_;
  data::Normalization norm_;
  models::NetPtr model_;
  std::unique_ptr<optim::FlatParams> flat_;
  std::unique_ptr<TrainStep> step_;
  std::shared_ptr<OptimizerStep> opt_;
  std::unique_ptr<optim::LrSchedule> schedule_;
  std::shared_ptr<UpdateRule> rule_;
  std::shared_ptr<data::PaceShares> paces_;
  std::unique_ptr<optim::IsgdController> isgd_;
  std::unique_ptr<optim::BatchSizePolicy> batch_policy_;
  std::unique_ptr<Membership> membership_;  // handed to the session at run()
  std::unique_ptr<Session> session_;
  TrainState state_;
  std::shared_ptr<OptimizerStep> outer_;  // DiLoCo's outer optimizer (null: elastic.sync = "step")
  std::unique_ptr<OuterSteps> outer_steps_;  // DiLoCo's outer steps of the run (made in run())
};

// Builds InputSpec from a dataset.
models::InputSpec input_spec(const data::Dataset& d);

}  // namespace limbo::train
