// Synchronous data-parallel update: every member averages its gradient with
// all others (Gloo all-reduce over the flat gradient, in buckets) and applies
// the same optimizer step, so all members keep identical weights.
//
// Members' batches may differ by one sample (the last batch of an epoch), so
// each gradient is weighted by its share of the global batch before the sum:
// the result is exactly the mean gradient over the global batch, as one
// process with batch R*b would compute it. The loss is averaged the same way,
// so loss-driven decisions (ISGD) agree on every member, and the float
// buffers that ride in the same all-reduce (BatchNorm running statistics,
// updated by each member's forward) become the same weighted mean everywhere;
// integer buffers (BatchNorm's num_batches_tracked) take member 0's value
// (see FlatParams). A sum that is not finite skips the update on every
// member alike (StepResult::skipped).
//
// With optim.shard_state (ReduceOptions::shard_state) the optimizer state is
// sharded (ZeRO stage 1): the gradient buckets are reduce-scattered, each
// member clips with the global norm built from the shards' squared norms,
// updates only its shard of the weights and of the optimizer state (kept in
// two versions in a ShardHome, elastic/shards.h) and the weights are
// all-gathered. Every addition of the gradient sum is the replicated path's,
// and the rule is elementwise, so the weights and state equal the
// replicated path's bit for bit; with clipping the norm is summed from the
// shards (float32 partial sums in another order), so the coefficient, and
// from it the update, can differ by float32 rounding.
#pragma once

#include <cmath>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "comm/collective.h"
#include "comm/compression.h"
#include "data/pace_shares.h"
#include "elastic/bucket_reducer.h"
#include "elastic/serial_queue.h"
#include "elastic/shards.h"
#include "train/update_rule.h"

namespace limbo::elastic {

struct ReduceOptions {
  int64_t bucket_bytes = 0;  // elastic.bucket_mb; 0 = one bucket
  bool overlap = false;      // elastic.overlap: reduce buckets while backward runs
  comm::Compression compression = comm::Compression::None;  // comm.compression
  int64_t testing_die_in_bucket = 0;  // train.testing_die_in_bucket (see BucketReducer)
  bool shard_state = false;  // optim.shard_state
  // optim.shard_weights (with shard_state): the weights and the gradient are
  // sharded too (ZeRO-3). A member's shard of the weights lives in its home
  // with the state (slot 0, two versions); the flat weights and gradient are
  // lazy (FlatParams' `lazy`) and hold pages only where a member works:
  // gather_weights() brings a unit's weights in before its forward and its
  // backward, each bucket of the gradient is reduce-scattered as backward
  // completes it, and what is not this member's is given back at once.
  bool shard_weights = false;
  // The flat parameter indices that start a unit (a bucket never spans two
  // units; shard_weights).
  std::vector<int> unit_starts;
  // The reduction completes at the end of the backward pass that reduces
  // (the Python front end: `.grad` is the group's when backward returns;
  // BucketReducer).
  bool finish_in_backward = false;
  // The start of the names of this job's shard homes, "/limbo-zero-<job>-"
  // (a member's are <prefix>m<member id>-r<round>); empty: in this
  // process's memory (a crash loses the shard).
  std::string home_prefix;
  // Shares of the batch by pace (elastic.shares = "pace"): the members'
  // paces are all-reduced in the steps that publish them, after the
  // gradient's reduction and before the update (data/pace_shares.h).
  std::shared_ptr<data::PaceShares> paces;
};

class AllReduceUpdate : public train::UpdateRule {
 public:
  // `flat` (the trainer's flat parameters) must outlive the rule.
  AllReduceUpdate(std::shared_ptr<comm::Collective> group, std::shared_ptr<train::OptimizerStep> optimizer,
                  optim::FlatParams& flat, const ReduceOptions& opt);
  // Broadcasts member 0's weights and buffers to everyone.
  void start(torch::Tensor& weights, torch::Tensor& buffers) override;
  // A fixed group resumed by member 0 alone: its whole state to everyone.
  void start_resumed(train::SyncTargets& s) override;
  void backward_starts(train::StepContext& ctx) override;
  void set_step_loss(double loss) override { reducer_.set_loss(loss); }
  void no_sync(bool on) override { reducer_.set_no_sync(on); }
  train::StepResult apply(train::StepContext& ctx) override;
  double reduce(torch::Tensor* grad, double loss) override;
  void agree_max(torch::Tensor& t) override { group_->allreduce_max(t); }
  void sum(torch::Tensor& t, int key) override;
  int64_t last_payload_bytes() const override { return last_payload_; }
  void sum_committed(int key) override;
  bool update_fragment(torch::Tensor& w, const torch::Tensor& g, int64_t lo, int64_t hi, double lr, int64_t step,
                       bool skip) override;
  double change_flag() override { return flag_source_ ? flag_source_() : 0.0; }
  void set_agreed_flag(double sum) override { flag_sum_ = sum; }
  const char* name() const override { return "allreduce"; }
  // Buckets, how many overlapped backward, the exposed communication.
  nlohmann::json summary() const override;
  // Elastic training swaps the group when membership changes.
  void set_group(std::shared_ptr<comm::Collective> group);
  // Sharded optimizer state (optim.shard_state).
  bool sharded() const { return shard_; }
  // Sharded weights and gradient too (optim.shard_weights).
  bool shards_weights() const override { return full_; }
  bool write_shards(const std::string& path, int64_t step) override;
  void drop_saved_state() override;
  // The first of a home's slots that holds optimizer state: 1 when the
  // weights are sharded (slot 0 holds the shard's weights), else 0.
  int first_state_slot() const { return full_ ? 1 : 0; }
  // shard_weights, before step `step`'s forward: the homes hold that step,
  // and the flat weights, whole until now (a new job), are given back; from
  // here on only gathered units are in them. No-op otherwise.
  void ready_weights(int64_t step);
  void before_forward(int64_t step) override;
  // shard_weights: [a, b) of the flat weights (whole parameters) gathered
  // from every member's home into the flat weights, or given back. Every
  // member calls them alike, in the same order (collectives). No-ops while
  // the weights are whole.
  void gather_weights(int64_t a, int64_t b);
  void release_weights(int64_t a, int64_t b);
  // The same in two halves: the gather handed to the collectives' queue
  // (a ticket; -1: nothing to gather), and the wait for it, so that a
  // unit's gather runs while the training thread computes another. A
  // failure is kept for apply() (as gather_weights()).
  int64_t issue_gather(int64_t a, int64_t b);
  void wait_gather(int64_t ticket);
  // shard_weights: every unit gathered, the whole weights in the flat
  // buffer (the end of training, a checkpoint); whole until ready_weights()
  // gives them back again.
  void gather_all_weights();
  bool weights_whole() const { return weights_whole_; }
  // After a state sync put step `step`'s weights into the new homes.
  void weights_resharded(int64_t step);
  // shard_weights, before a state sync reads the homes kept at step
  // `step`: every home holding the log of `step` (its update cut short by
  // a failure, here or in a dead member of this host) finished from it.
  // A live owner elsewhere (frozen, or out of the round) is killed first:
  // it could go on writing the home. See apply_logged().
  void settle_logs(int64_t step);
  // shard_weights, in a state sync: a part of this process's own homes of
  // the last group (retired by new_home) given back once the new homes
  // hold it (ShardHome::give_back).
  void give_back_retired(ShardHome::Part part);
  // ... and the logs of every home of this process's, once settled.
  void give_back_logs();
  bool shards_state() const override { return shard_; }
  const std::vector<int64_t>& bounds() const { return bounds_; }
  ShardHome* home() { return home_.get(); }
  // A new home for this member's shard of the current group (named for
  // membership round `round`); the previous one is retired: kept, and
  // readable, until the next committed step.
  ShardHome& new_home(int64_t round, int states);
  // Copies on another host, for a group across hosts: member j of host h
  // (hosts numbered by their lowest rank, members by rank) keeps a copy of
  // its shard on member j mod m of host h + 1 (m members; the last host's
  // go to the first), which updates it in the same step as its own shard,
  // from the same whole gradient (reduce_scatter_sum leaves it everywhere
  // then), so the copy has the owner's bits, written before the step
  // commits, and a host lost whole loses no state. Every member calls it
  // alike (one small all-reduce of host identities); ensure_home() does on
  // a new group's first step.
  void plan_copies();
  bool spans_hosts() const { return hosts_ > 1; }
  // The ranks whose shards this member keeps copies of.
  const std::vector<int>& copied_ranks() const { return copy_ranks_; }
  // New homes for those copies (named for `round`, in copied_ranks()
  // order); the previous ones are retired like the home.
  std::vector<ShardHome*> new_copy_homes(int64_t round, int states);
  // Homes kept for a state sync that may be retried: the home, the copies,
  // the retired ones and the dead members' ones this member read
  // (adopt_dead()).
  std::vector<ShardHome*> kept_homes();
  void adopt_dead(std::vector<std::unique_ptr<ShardHome>> homes);
  const std::string& home_prefix() const { return home_prefix_; }
  void set_member_id(int64_t id) { member_id_ = id; }
  // The committed step the whole weights (flat) hold on this member: after
  // each all-gather, and after a state sync; kWeightsUnknown before the
  // first step (they are the state's own). A failed all-gather leaves
  // them as they were.
  static constexpr int64_t kWeightsUnknown = INT64_MIN;
  int64_t whole_weights_step() const { return weights_step_; }
  void set_whole_weights_step(int64_t step) { weights_step_ = step; }
  // The whole optimizer state of committed step `step` into `opt` where
  // `here` (every member calls it alike): in pieces of a few MiB, each
  // element from its shard's owner and -0.0 from the others (exact), so a
  // member that does not keep the whole state never holds more than a
  // piece of it. No-op unless sharded, or when an earlier call for the same
  // step put it everywhere.
  void gather_state(optim::Optimizer& opt, int64_t step, bool here) override;
  void release_state(optim::Optimizer& opt, int64_t step) override;
  // Sharded: in every home this member keeps at `step` (its own and the
  // copies it keeps for another host), so that a copy stays the owner's
  // bits; and in `opt` where it holds the whole state.
  void scale_momentum(optim::Optimizer& opt, double factor, int64_t step) override;
  void state_replaced() override { weights_step_ = kWeightsUnknown; gathered_everywhere_ = -1; }
  bool takes_deferred_state() const override { return shards_state(); }
  void set_deferred_state(std::shared_ptr<const train::DeferredShardState> d) override { deferred_ = std::move(d); }
  // The state a resume left in the checkpoint's shard files (null: none),
  // read by the next re-sharding (sync_sharded_state), which drops it.
  const train::DeferredShardState* deferred_state() const { return deferred_.get(); }
  // Removes the names of this member's homes (train.testing_die_without_home).
  void testing_drop_kept_state() override;
  // The optimizer's update count and whether it has state, at committed
  // step `step` of this member's home (false: the home has no such version).
  bool version_meta(int64_t step, int64_t* optimizer_steps, bool* has_state);
  // A value each member contributes with every gradient (summed): elastic
  // training raises it to ask for a membership change, so all members see
  // the request after the same step.
  void set_flag_source(std::function<double()> f) { flag_source_ = std::move(f); }
  double last_flag_sum() const { return flag_sum_; }
  const BucketReducer& reducer() const { return reducer_; }
  std::optional<std::chrono::steady_clock::time_point> backward_ended() const override {
    return reducer_.finish_started();
  }

 private:
  // The step's publication of paces, if it has one (a collective).
  void publish_paces(int64_t step);
  void broadcast_frozen();
  std::shared_ptr<data::PaceShares> paces_;
  std::shared_ptr<comm::Collective> group_;
  std::shared_ptr<train::OptimizerStep> opt_;
  std::shared_ptr<const train::DeferredShardState> deferred_;
  optim::FlatParams& flat_;
  BucketReducer reducer_;
  torch::Tensor loss_buf_;
  double share_ = 1.0;  // this member's fraction of the last global batch
  std::function<double()> flag_source_;
  double flag_sum_ = 0;
  comm::Compression compression_;
  std::map<int, std::unique_ptr<comm::Compressor>> sum_encoders_;  // sum()'s, by key
  int64_t last_payload_ = -1;  // of the last apply() or sum() (last_payload_bytes)

  train::StepResult apply_shard(train::StepContext& ctx, double global_loss);
  // shard_weights: the step's commit through the homes' logs (apply_shard).
  train::StepResult apply_logged(train::StepContext& ctx, double global_loss, const std::vector<ShardHome*>& homes,
                                 float coef, bool finite);
  // Brings home `h` to step `step` from its log (ShardHome::roll_forward).
  bool roll_forward(ShardHome& h, int64_t step);
  double own_shard_sum() const;
  void ensure_home(int64_t step);
  bool update_into(ShardHome& h, int64_t step, float coef, train::StepContext& ctx);
  std::unique_ptr<ShardHome> make_home(const std::string& base, int64_t lo, int64_t hi, int states);
  void drop_retired();
  bool shard_ = false;
  bool full_ = false;             // shard_weights
  bool weights_whole_ = true;     // the flat weights hold every element (shard_weights)
  // A gather that failed this step (a peer lost in the forward's or the
  // backward's gathers): later gathers do nothing, and apply() fails the
  // step with it, so the user's forward and backward never see the failure
  // (they compute on what they have, and the step is redone).
  std::exception_ptr gather_error_;
  // A failure of the commit's second barrier (apply_logged): the step
  // counts, the homes hold its log; the next step's gathers fail with it.
  std::exception_ptr commit_error_;
  // Testing aid (LIMBO_TESTING_DIE_IN_COMMIT="ITERATION:WHERE:RANK:HOW:MARKER"):
  // the member of that rank SIGKILLs (HOW kill) or SIGSTOPs (stop) itself in the commit of the step after
  // ITERATION committed ones, at WHERE (logged: its logs written, before
  // barrier 1; barrier1: between the barriers; update: in its home's update
  // in place, at the third chunk), once a job (MARKER, made exclusively).
  struct CommitDeath {
    int64_t iteration = -1;
    std::string where, marker;
    int rank = -1;
    bool freeze = false;
  } die_in_commit_;
  void maybe_die_in_commit(const std::string& where, int64_t iteration);
  int64_t weights_at_ = INT64_MIN;  // the committed step the homes' weights are gathered from
  // A bucket of the gradient summed (shard_weights): what is not this
  // member's (its shard, the copies it keeps) given back, and the bucket's
  // weights (backward has no more use for them once every gradient of the
  // bucket is there).
  void bucket_reduced(int64_t a, int64_t b);
  // finish_in_backward with sharded state: the sum of this member's shard
  // of the reduced gradient when the reduction finished (NaN: none), to
  // refuse a gradient the user changed before the step (see apply_shard).
  double shard_sum_ = std::nan("");
  std::string home_prefix_;
  int64_t member_id_ = 0;
  int64_t weights_step_ = kWeightsUnknown;
  std::vector<int64_t> bounds_;
  std::unique_ptr<ShardHome> home_;
  std::vector<std::unique_ptr<ShardHome>> copies_;  // of copy_ranks_' shards
  std::vector<int> copy_ranks_;
  int hosts_ = 1;
  bool planned_ = false;  // plan_copies() ran for this group
  std::vector<std::unique_ptr<ShardHome>> retired_;
  torch::Tensor stats_;  // [non-finite elements, squared norm] of this member's shard
  double update_seconds_ = 0, gather_seconds_ = 0;
  int64_t updates_ = 0;
  int64_t gathered_everywhere_ = -1;  // the step an everywhere-gather last ran at
  // shard_weights: the gathers and the buckets' reduce-scatters, run in the
  // order handed over (last: its thread stops before the rest goes).
  SerialQueue queue_;
};

}  // namespace limbo::elastic
