// The seam for elastic membership. A trainer without one trains with a fixed
// group; elastic training installs an implementation (elastic/) that can
// re-form the group at step boundaries and after failures.
#pragma once

#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include <functional>
#include <string>

#include "optim/batch_policy.h"
#include "optim/isgd.h"
#include "optim/optimizer.h"
#include "common/error.h"
#include "train/checkpoint.h"

namespace limbo::train {

// Everything that must be identical on every member after a change.
struct SyncTargets {
  torch::Tensor& weights;
  torch::Tensor& buffers;  // float buffers (BatchNorm statistics); may be empty
  optim::Optimizer& optimizer;  // its named state and update count
  TrainState& state;
  optim::BatchSizePolicy& policy;
  optim::IsgdController* isgd;  // may be null
  // The storage this member's run directory is on (RunDir::storage_id; 0:
  // none), so that run records are kept once per storage.
  int64_t storage = 0;
  // The run's records so far (this member's metrics.jsonl), and how many
  // (either may be null). A writer whose copy holds fewer records than the
  // fullest receives that copy (Established::records), so each copy holds
  // the whole run, also on a host that joined late or left and came back.
  // (Copies differ in bytes: each host's membership records carry its own
  // worker and timings; they agree in count.)
  std::function<std::string()> records;
  std::function<int64_t()> record_count;
  // The front end's own state (train/session.h: SessionParts::pack_extra),
  // as bytes, taken from the member whose state everyone takes. Both empty:
  // none.
  std::function<torch::Tensor()> pack_extra;
  std::function<void(const torch::Tensor&)> unpack_extra;
  // Non-null (SessionParts::extra_only_when_behind): whether this member's
  // front-end state is the group's as of its committed step. The bytes then
  // move only when some member is behind the newest step, new, or at step
  // 0; every member's flag is set once its group has synced.
  bool* extra_current = nullptr;
  // Set by the sync: whether the front end's bytes moved.
  bool extra_moved = false;
};

// Training completed on other members while this member's step failed or
// its group re-formed: its state is behind theirs, and they write the
// results; it ends without redoing the step (thrown by establish()).
class CompletedElsewhere : public limbo::Error {
 public:
  using Error::Error;
};

// Some part of the newest committed state is held by no member (sharded
// optimizer state whose shard and copy were lost together; thrown by
// establish()). The trainer falls back to the run directory's checkpoint.
// The member was asked to leave (a signal) while it waited for a group that
// did not form within a second: it ends without a step to commit (the
// front end exits as the signal asks).
class Interrupted : public limbo::Error {
 public:
  using Error::Error;
};

class StateLost : public limbo::Error {
 public:
  using Error::Error;
};
// The state is lost and no member has a checkpoint either (every member
// fell back and forgot its step): the job ends with this error instead of
// re-forming for ever.
class StateLostForGood : public StateLost {
 public:
  using StateLost::StateLost;
};

struct Membership {
  struct Established {
    int world = 1, rank = 0;
    // This member writes its run directory: it is the lowest rank of the
    // members whose run directories are on one storage. Every member holds
    // the same state and the same records, so each host's own run directory
    // (or the one shared directory) keeps the newest checkpoint and the
    // whole run's metrics from the time it joined.
    bool writes_run_dir = true;
    int record_copies = 1;  // distinct storages among the members
    std::string records;    // the fullest records, for a writer whose copy was behind (replaces it)
    nlohmann::json event;  // what changed, why, and how long each part took
  };
  virtual ~Membership() = default;
  // (Re)forms the group and makes every member hold the newest committed
  // state. Blocks; throws Timeout when no group can be formed in time.
  // Throws CompletedElsewhere when training completed meanwhile.
  virtual Established establish(SyncTargets& s, const std::string& reason) = 0;
  // After a committed step: did all members agree to change membership now?
  virtual bool change_agreed() = 0;
  // This member is leaving (SIGTERM) at the agreed change.
  virtual bool leaving() = 0;
  virtual void leave() = 0;
  // The writer reports training progress (fractional epochs) for schedulers.
  virtual void publish_progress(double epoch) {}
  // Training completed (after the last step, before the final evaluation).
  virtual void publish_done() {}
  // The ending, per storage (SyncTargets::storage): the member writing the
  // run directory reports that the final checkpoint and summary are
  // written; every other member of the storage waits for that report
  // (true), or until each member before it on the storage is gone without
  // it (false: it writes them itself), so a writer that dies while the job
  // ends loses nothing.
  virtual void publish_final(int64_t storage) {}
  virtual bool wait_final(int64_t storage) { return true; }
  // A metrics record of the current writer (train, eval, membership, ...),
  // for the job's status pages. Must not block.
  virtual void publish_record(const nlohmann::json& record) {}
};

}  // namespace limbo::train
