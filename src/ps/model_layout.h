// What learners and shards share about the model: how the flat parameter
// vector is split over shards, and the fingerprint both sides compare in the
// handshake. Used by the shard, the learner and the launchers; includes
// neither of them.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "optim/flat_params.h"

namespace limbo::ps {

struct Range {
  int64_t offset = 0, numel = 0;
};
// Contiguous ranges of a flat vector of `total` floats over `shards` shards,
// balanced by bytes (sizes differ by at most one element). Throws InvalidInput.
std::vector<Range> partition(int64_t total, int shards);

// What learners and shards must agree on: protocol version, parameter names,
// shapes and dtypes. A text description (for error messages) and its hash.
struct ModelFingerprint {
  std::string description;  // e.g. "mlp: fc1.weight[256,784] fc1.bias[256] ..."
  uint64_t hash = 0;
};

// The fingerprint of a model's flat parameters (built-in or TorchScript).
ModelFingerprint model_fingerprint(const std::string& model_name, const optim::FlatParams& params);

}  // namespace limbo::ps
