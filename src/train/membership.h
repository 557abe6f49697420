// The seam for elastic membership. A trainer without one trains with a fixed
// group; elastic training installs an implementation (elastic/) that can
// re-form the group at step boundaries and after failures.
#pragma once

#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include <string>

#include "optim/batch_policy.h"
#include "optim/isgd.h"
#include "optim/sgd.h"
#include "train/checkpoint.h"

namespace limbo::train {

// Everything that must be identical on every member after a change.
struct SyncTargets {
  torch::Tensor& weights;
  torch::Tensor& buffers;  // float buffers (BatchNorm statistics); may be empty
  optim::Sgd& sgd;
  TrainState& state;
  optim::BatchSizePolicy& policy;
  optim::IsgdController* isgd;  // may be null
};

struct Membership {
  struct Established {
    int world = 1, rank = 0;
    nlohmann::json event;  // what changed, why, and how long each part took
  };
  virtual ~Membership() = default;
  // (Re)forms the group and makes every member hold the newest committed
  // state. Blocks; throws Timeout when no group can be formed in time.
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
  // A metrics record of the current writer (train, eval, membership, ...),
  // for the job's status pages. Must not block.
  virtual void publish_record(const nlohmann::json& record) {}
};

}  // namespace limbo::train
