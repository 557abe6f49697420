// A shard's checkpoint file (written atomically):
//   "LBPSCKPT"  8 bytes
//   meta length 8 bytes, little-endian
//   meta        JSON: shard, shards, range, model fingerprint, clock,
//               counters, staleness histogram, shard 0's leases, "momentum"
//   weights     numel float32
//   momentum    numel float32, present when meta.momentum is true
#pragma once

#include <nlohmann/json.hpp>

#include <string>
#include <vector>

#include "ps/leases.h"

namespace limbo::ps {

// Adds meta["momentum"] and writes the file atomically.
void write_shard_checkpoint(const std::string& path, nlohmann::json meta, const float* weights,
                            const float* momentum /* may be null */, int64_t numel);

struct ShardCheckpoint {
  nlohmann::json meta;
  std::vector<float> weights, momentum;  // momentum empty when none was saved
};
// Reads and checks the layout (magic, sizes for `numel` floats); throws
// InvalidInput naming the file. The caller checks meta against itself.
ShardCheckpoint read_shard_checkpoint(const std::string& path, int64_t numel);

nlohmann::json leases_to_json(const LeaseBook::Snapshot& s);
LeaseBook::Snapshot leases_from_json(const nlohmann::json& j);

}  // namespace limbo::ps
