// The elastic step, as every front end drives it: the CLI's Trainer
// (train/trainer.h) and the Python module (python/core.h) call the
// same Session, so that a fix here is a fix in both.
//
// A Session owns what one run keeps about its group and its files:
//   - the membership: the group formed at the start, re-formed after a
//     failed collective and at agreed changes, every member then holding the
//     newest committed state (state sync; with the fallback to the run
//     directory's checkpoint when sharded state was lost);
//   - the step's outcome: apply() runs the update rule and re-forms on a
//     peer's failure (the step did not commit: the front end redoes it);
//     commit() counts it (or counts it as skipped when its gradient was not
//     finite, stopping the run as diverged after too many in a row);
//   - the sharded optimizer state gathered whole for checkpoints and changes;
//   - the run directory (one writer per storage, records mirrored to the
//     job's status pages), checkpoints and --resume, with the front end's
//     own state (pack_extra: a Python user's optimizer, scheduler and dict)
//     in both the checkpoint and the state sync;
//   - the job's ending: completion published, the final files written once
//     per storage, by the next member of the storage when the writer dies.
// The front end owns its data, model, forward and backward, and what it
// logs. It is told of each (re)formation (on_reform) to move its data.
#pragma once

#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "common/timing.h"
#include "data/pace_shares.h"
#include "data/sampler.h"
#include "optim/batch_policy.h"
#include "optim/flat_params.h"
#include "optim/isgd.h"
#include "train/checkpoint.h"
#include "train/membership.h"
#include "train/run_dir.h"
#include "train/update_rule.h"

namespace limbo::train {

// Failures of a peer, after which an elastic group re-forms.
bool recoverable(const Error& e);

struct SessionParts {
  torch::nn::Module& model;  // what checkpoints hold (its parameters are `flat`'s views)
  optim::FlatParams& flat;
  std::shared_ptr<OptimizerStep> opt;
  optim::BatchSizePolicy& policy;
  optim::IsgdController* isgd = nullptr;  // may be null
  TrainState& state;                      // the committed step, cursor and counts
  std::string run_dir;                    // empty: no files
  // Steps in a row whose gradient or loss is not finite after which the run
  // stops as diverged (0 = never).
  int64_t max_nonfinite_steps = 10;
  // The front end's own state beyond Limbo's (a Python user's optimizer,
  // scheduler and extra dict), as bytes: packed on the member whose state
  // everyone takes and into checkpoints (state/extra "front_end"), unpacked
  // everywhere else. Both empty: none.
  std::function<torch::Tensor()> pack_extra;
  std::function<void(const torch::Tensor&)> unpack_extra;
  // The front end's state is the same on members that took part in every
  // committed step since they last synced (a Python loop with sync="step"):
  // a re-formation then moves it only when some member is behind or new
  // (pickling and sending a large optimizer's state on every re-formation
  // lengthened recovery).
  bool extra_only_when_behind = false;
  // State of this member's own that checkpoints keep (the writer's) but
  // state sync does not move (DiLoCo's inner optimizer): added to the
  // checkpoint's state/extra, and read back on --resume and on a fallback
  // to the checkpoint. Both empty: none.
  std::function<void(std::map<std::string, torch::Tensor>&)> save_local;
  std::function<void(const std::map<std::string, torch::Tensor>&)> load_local;
  // Where this member writes its shards of a fully sharded checkpoint when
  // it writes no run directory (a fixed group's member other than 0 on the
  // host of member 0: the same directory). Empty: run_dir.
  std::string shard_dir;
};

class Session {
 public:
  // `membership` null: a fixed group (one process, or a static job whose
  // `rule` holds the group, this member being `rank` of `world`). A run
  // directory of an elastic job or a resumed run keeps its records
  // (appends).
  Session(SessionParts parts, std::shared_ptr<UpdateRule> rule, std::unique_ptr<Membership> membership,
          bool resume, int world, int rank = 0);
  ~Session();

  bool elastic() const { return membership_ != nullptr; }
  RunDir& run_dir() { return run_dir_; }
  TrainState& state() { return p_.state; }
  UpdateRule& rule() { return *rule_; }
  Membership* membership() { return membership_.get(); }
  int world() const { return world_; }
  int rank() const { return rank_; }
  bool rank0() const { return rank_ == 0; }
  // This member writes the run directory and checkpoints.
  bool writer() const { return writer_; }
  // Wrote the final files in place of a writer lost in the ending.
  bool took_over() const { return took_over_; }
  int64_t storage() const { return storage_; }
  int64_t membership_changes() const { return changes_; }
  const nlohmann::json& recoveries() const { return recoveries_; }
  const std::string& checkpoint_path() const { return checkpoint_path_; }

  // Told after every (re)formation, once the state is synced: the front end
  // moves its data to the new world, rank and cursor.
  void set_on_reform(std::function<void(const Membership::Established&)> f) { on_reform_ = std::move(f); }

  // Shares of the batch by pace: reset to equal shares for every group
  // formed (its world, the steps committed when it formed).
  void set_paces(std::shared_ptr<data::PaceShares> paces) { paces_ = std::move(paces); }
  const std::shared_ptr<data::PaceShares>& paces() const { return paces_; }
  // Adds each member's last agreed pace and the shares of step `step` to a
  // record (nothing without shares by pace).
  void add_pace_fields(nlohmann::json& record, int64_t step) const;

  // Loads the run directory's checkpoint (InvalidInput when there is none).
  void resume();
  // Writes the checkpoint where this member writes (nothing elsewhere).
  void checkpoint(const std::string& why);
  // A checkpoint of committed state: the sharded state gathered whole where
  // it is written, written, released.
  void checkpoint_now(const std::string& why);

  // The group's first formation (elastic: a round and the newest state;
  // throws CompletedElsewhere when training already completed), or the
  // rule's start (a fixed group: member 0's weights everywhere).
  void start();
  // Whether this member resumes from member 0's checkpoint (a fixed group's
  // member other than 0: no run directory of its own).
  bool resumes_from_first_ = false;
  bool resumed_ = false;  // resume() ran: a fixed group starts from member 0's state (start_resumed)
  // (Re)forms the group: new world and rank, the newest state everywhere.
  void reform(const std::string& reason, Clock::time_point detected, double detection);
  // Sharded optimizer state whole on the members that pass `here` (a
  // collective), re-forming and retrying when a member is lost meanwhile.
  void gather_state(const std::string& why, bool here);
  // Fully sharded (optim.shard_weights): every member writes its shards of
  // the committed step beside the checkpoint (a collective, retried across
  // a re-formation); checkpoint() then writes the file that names them.
  // False when the rule does not, or cannot (a member without a run
  // directory): the state is gathered instead.
  bool write_shards(const std::string& why);
  int64_t shards_step_ = -1;  // the step whose shards write_shards() wrote
  int shards_world_ = 0;      // ... and the group's size then (a re-formation may follow)
  std::string shard_path_;    // the checkpoint's path for write_shards() (empty: none)

  // A collective of the front end's own between steps (an evaluation's
  // sums): true when it completed; false when a peer failed (elastic): the
  // group re-formed and the front end does it again with the new one.
  bool collective(const std::string& what, const std::function<void()>& f);
  // Runs the rule. nullopt: a peer failed (elastic), the step did not
  // commit here, the group re-formed and the front end redoes the step.
  // `buffers_before` (FlatParams::save_buffers, may be empty) is put back
  // then.
  std::optional<StepResult> apply(StepContext& ctx, const std::vector<torch::Tensor>& buffers_before);
  // Counts the applied step: skipped (its buffers back as before; Diverged
  // after too many in a row) or not; the cursor moves to `end`. A pending
  // membership record is written with its first step's time.
  void commit(const StepResult& res, const data::Cursor& end, const std::vector<torch::Tensor>& buffers_before);
  // After a committed step and the front end's own work: the writer's
  // progress for the launcher's schedule (`epoch`, when `publish`), then an
  // agreed membership change: leave (returns true; the writer checkpoints
  // first) or re-form.
  bool after_step(double epoch, bool publish);

  // The ending. Gathers the sharded state for the final checkpoint (here:
  // where it is written); false when training completed elsewhere meanwhile.
  bool gather_final(bool here);
  // Training completed: published (the launcher ends the job on it) and
  // this member leaves the coordinator's watch (elastic only).
  void training_done();
  // Whether this member goes on to the final files: false when another
  // member of its storage writes them (it waited for that member's report);
  // true for the writer, and for the next member of the storage when the
  // writer is gone without the report (it takes over: took_over()).
  bool writes_final();
  // The final checkpoint and summary are written (the writer reports it).
  void final_written();

 private:
  SessionParts p_;
  std::shared_ptr<UpdateRule> rule_;
  std::unique_ptr<Membership> membership_;
  RunDir run_dir_;
  std::string checkpoint_path_;
  std::function<void(const Membership::Established&)> on_reform_;
  std::shared_ptr<data::PaceShares> paces_;
  // This member's front-end state is the group's as of its committed step
  // (SyncTargets::extra_current): set by a state sync, cleared when the
  // state comes from elsewhere (a checkpoint).
  bool extra_current_ = false;
  int world_ = 1, rank_ = 0;
  bool writer_ = true, took_over_ = false;
  int64_t storage_ = 0, changes_ = 0;
  nlohmann::json recoveries_ = nlohmann::json::array();
  nlohmann::json pending_event_;  // a change whose first committed step is still to come
  Clock::time_point pending_since_;
};

}  // namespace limbo::train
