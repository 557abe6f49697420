// Reading and writing the archives of a checkpoint: the helpers that the
// checkpoint file (checkpoint.cc) and its shard files (shard_files.cc) share.
// Internal to src/train.
#pragma once

#include <torch/torch.h>

#include <string>
#include <vector>

#include "train/checkpoint.h"

namespace limbo::train::archive_io {

torch::Tensor scalar(int64_t v);
std::string tensor_bytes(const torch::Tensor& t);
std::vector<std::string> split_lines(const std::string& text);
int64_t read_int(torch::serialize::InputArchive& ar, const std::string& key, const std::string& file);
torch::serialize::InputArchive open_archive(const std::string& path);
// Refuses a state saved for another set of trainable parameters, by name.
void check_same_trainable(torch::serialize::InputArchive& o, torch::nn::Module& model, int64_t state_numel,
                          const std::string& path);
// Written to a temporary name, flushed, then renamed into place.
void write_archive(torch::serialize::OutputArchive& root, const std::string& path);

// The weights and state of a fully sharded checkpoint from its shard files
// (shard_files.cc).
void load_shards(const std::string& path, torch::serialize::InputArchive& sharded, int64_t step,
                 torch::serialize::InputArchive& root, torch::nn::Module& model, optim::Optimizer* opt,
                 DeferredShardState* deferred);

}  // namespace limbo::train::archive_io
