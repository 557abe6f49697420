// A shard's checkpoint file (written atomically):
//   "LBPSCKPT"  8 bytes
//   meta length 8 bytes, little-endian
//   meta        JSON: shard, shards, range, model fingerprint, clock,
//               counters, staleness histogram, shard 0's leases,
//               "optimizer": {"algorithm", "state": [names], "steps"}
//   weights     numel float32
//   state       numel float32 per name in meta.optimizer.state, in order
//               (files of earlier versions: "momentum": true and one buffer)
#pragma once

#include <nlohmann/json.hpp>

#include <string>
#include <vector>

#include "optim/optimizer.h"
#include "ps/leases.h"

namespace limbo::ps {

// Adds meta["optimizer"] and writes the file atomically.
void write_shard_checkpoint(const std::string& path, nlohmann::json meta, const float* weights,
                            const optim::Optimizer& opt, int64_t numel);

struct ShardCheckpoint {
  nlohmann::json meta;
  std::vector<float> weights;
  std::vector<std::vector<float>> state;  // the optimizer's, in meta.optimizer.state order; none saved: empty
  std::vector<std::string> state_names;
  int64_t steps = 0;
};
// Reads and checks the layout (magic, sizes for `numel` floats); throws
// InvalidInput naming the file. The caller checks meta against itself.
ShardCheckpoint read_shard_checkpoint(const std::string& path, int64_t numel);

nlohmann::json leases_to_json(const LeaseBook::Snapshot& s);
LeaseBook::Snapshot leases_from_json(const nlohmann::json& j);

}  // namespace limbo::ps
