// Sharded optimizer state (optim.shard_state): the layout of the shards and
// the memory that holds a member's shard.
//
// The flat parameters (n floats) are cut into contiguous, balanced shards,
// one per member of the group (shard_bounds). A member owns the weights and
// the optimizer state of its shard: it updates only those and the weights
// are all-gathered afterwards (elastic/allreduce_update.h).
//
// A ShardHome holds one shard of the optimizer state in two versions, each
// the shard's state tensors at one committed step: the step being made is
// written beside the last committed one, so a step that fails anywhere, at
// any point, leaves every member's last committed version intact. (The
// weights need no home: they are all-gathered into the gradient's buffer,
// and each member's whole weights move from one step to the next only once
// that all-gather is complete.) On a membership change the survivors
// re-shard from the versions of the newest committed step
// (sync_sharded_state).
//
// A home with a log (the fully sharded mode, optim.shard_weights) holds one
// version instead of two, and beside it the step's log: the reduced
// gradient of the shard (clipped), the rate and whether the step was
// skipped. The update of step k + 1 is written in place over k, in chunks,
// behind a cursor in the header; elements below the cursor are at k + 1,
// the rest at k, so whoever holds the home (its owner, or a member of its
// host after the owner died there) finishes k + 1 exactly from the log
// (roll_forward). The commit protocol that makes a partial update safe is
// in elastic/allreduce_update.h (two barriers around the logs).
//
// A home with a name lives in POSIX shared memory (/dev/shm, 0600) and
// outlives its process: when a member dies or is left out of the round
// (frozen), the members on its host open its home (open_departed_homes) and
// hand its shard on, so a crash or a freeze loses no optimizer state. Names are limbo-zero-<job>-m<member>-r<round>; the
// header records the host (comm::host_identity()) and the owner's pid, so
// only a dead owner's home on the same host is read.
#pragma once

#include <sys/types.h>

#include <atomic>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <torch/torch.h>

#include "comm/collective.h"
#include "train/membership.h"

namespace limbo::elastic {

// Shards of n elements among `world` members: world + 1 offsets, each
// shard a whole number of 16-float lines (the last takes the remainder),
// sizes differing by at most one line.
std::vector<int64_t> shard_bounds(int64_t n, int world);

class ShardHome {
 public:
  struct Header;
  // A home for [lo, hi) of n elements with `states` state tensors, in
  // shared memory under `name` (e.g. "/limbo-zero-..."), or in this
  // process's memory when `name` is empty or the segment cannot be made.
  // `logged`: one version and a log (above) instead of two versions.
  ShardHome(const std::string& name, int64_t n, int64_t lo, int64_t hi, int states, bool logged = false);
  // Opens another process's home read-only (nullptr when it is not a home,
  // or not of this host).
  static std::unique_ptr<ShardHome> open(const std::string& name);
  ~ShardHome();
  ShardHome(const ShardHome&) = delete;
  ShardHome& operator=(const ShardHome&) = delete;

  int64_t n() const;
  int64_t lo() const;
  int64_t hi() const;
  int64_t size() const { return hi() - lo(); }
  int states() const;
  pid_t owner() const;
  const std::string& name() const { return name_; }
  bool shared() const { return !name_.empty(); }

  // The version (0 or 1) that holds committed step `step`, or -1.
  int version_of(int64_t step) const;
  float* state(int v, int i);
  int64_t optimizer_steps(int v) const;
  bool has_state(int v) const;
  // Marks version v as being written (no step), and as holding `step`
  // once written (after every write to it, in this order).
  void begin(int v);
  void commit(int v, int64_t step, int64_t optimizer_steps, bool has_state);
  // A home with a log: one version (0), holding the step its header names
  // once no update is under way over it.
  bool logged() const;
  // The log: size() floats (the step's gradient for this shard, clipped).
  float* log();
  // The step the log is for (-1: none); the elements already updated.
  int64_t log_step() const;
  int64_t cursor() const;
  // Before the log is written (no step), and once it is (in this order).
  void begin_log();
  void log_written(int64_t step, double lr, bool skip);
  // The update of elements [a, b) of version 0 from the log, given the
  // update count and whether the state existed before it, at rate lr: slot
  // i's new values go to out[i] (for element a).
  using Update = std::function<void(int64_t a, int64_t b, int64_t optimizer_steps, bool has_state, double lr,
                                    const std::vector<float*>& out)>;
  // Brings version 0 to the log's step `step` (from the cursor on, in
  // chunks: each chunk's new values go to a scratch area first, then over
  // the chunk, so a process that dies anywhere leaves either the chunk
  // untouched or its new values whole in the scratch); false when the
  // home holds neither `step` nor its log.
  bool roll_forward(int64_t step, const Update& update, bool first_state_is_weights);
  // A home with a log: parts of its memory given back to the system
  // (they read as zeros afterwards) once their values are elsewhere: the
  // log (after the step it holds is settled), the weights (slot 0), the
  // state (every later slot, with the log). A state sync gives back a
  // re-sharded part of the homes it re-shards from before it writes the
  // next, so that a member never holds its old and new shards whole.
  enum Part { kLog = 4, kWeights = 1, kState = 2 };
  void give_back(Part part);
  // Whether the weights, or the state, of `step` are here (not given
  // back); the weights also once commit_weights(step) marked slot 0 whole
  // before the version is committed (a sync retried after it wrote them).
  bool holds_weights(int64_t step) const;
  bool holds_state(int64_t step) const;
  void commit_weights(int64_t step);
  // After a fully sharded job's final checkpoint: the state given back,
  // version 0 holds its step without state.
  void drop_state();
  // Removes the name (the memory goes with the last mapping).
  void unlink();
  // Bytes of one version.
  int64_t version_bytes() const { return static_cast<int64_t>(sizeof(float)) * size() * states(); }
  // Bytes of the whole home (its versions or version and log, and header).
  int64_t bytes() const { return bytes_; }

 private:
  ShardHome() = default;
  Header* h_ = nullptr;
  uint8_t* base_ = nullptr;
  int64_t bytes_ = 0;
  bool mapped_ = false;
  std::string name_;
  std::vector<float> private_;  // the memory when not shared
};

// The homes under /dev/shm named `prefix`*, made on this host, of members
// gone from the round of `members`: those whose owner is no longer running,
// and those of a member id outside `members` whatever its process does (a
// frozen member is out of the round, but alive). A frozen member cannot
// write its committed versions: a step is written beside them.
std::vector<std::unique_ptr<ShardHome>> open_departed_homes(const std::string& prefix,
                                                            const std::vector<int64_t>& members);

// Removes the homes a job left on this host when no process of it is left
// here to read them (a launcher SIGKILLed, as Slurm's KillWait does, never
// removes its job's homes): those of every job tag, but `keep_tag`, none of
// whose homes on this host has a running owner. Returns how many.
int remove_orphaned_homes(const std::string& keep_tag = "");

// Removes every home named `prefix`*; returns how many.
int remove_homes(const std::string& prefix);

}  // namespace limbo::elastic
