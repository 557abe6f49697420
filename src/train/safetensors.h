// Writes tensors in the safetensors format: an 8-byte little-endian header
// length, a JSON header {name: {dtype, shape, data_offsets}, "__metadata__":
// {...}} padded with spaces to a multiple of 8 bytes, then the raw
// little-endian data of each tensor in header order. Written atomically.
#pragma once

#include <torch/torch.h>

#include <map>
#include <string>
#include <utility>
#include <vector>

namespace limbo::train {

using NamedTensors = std::vector<std::pair<std::string, torch::Tensor>>;

void write_safetensors(const std::string& path, const NamedTensors& tensors,
                       const std::map<std::string, std::string>& metadata);

// Parameters then buffers of a module, with dotted names (state_dict order).
NamedTensors state_dict(torch::nn::Module& m);

}  // namespace limbo::train
