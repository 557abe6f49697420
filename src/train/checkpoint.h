// Checkpoints: one libtorch archive holding everything needed to resume.
//
//   model/   parameters and buffers, nested by submodule (nn::Module layout)
//   optim/   the optimizer's state tensors by name (SGD: momentum_buffer;
//            Adam: exp_avg, exp_avg_sq; each flat over the trainable
//            parameters in named_parameters() order; absent before the first
//            update), step (its update count), algorithm (uint8 bytes)
//   state/   step, epoch, position, samples, owed (DiLoCo's [k, 2] ranges,
//            when any), format_version, rng (torch CPU
//            generator state), config (resolved TOML, as uint8 bytes),
//            model_description (every parameter's and buffer's name, shape
//            and dtype; a checkpoint for another model is refused naming the
//            first tensor that differs)
//
// Files are written atomically (temp file + rename). PyTorch for Python reads
// them with torch.jit.load(path); ckpt.model.state_dict() has the usual
// dotted parameter names.
#pragma once

#include <torch/torch.h>

#include <map>
#include <string>
#include <vector>

#include "data/sampler.h"
#include "train/diloco.h"
#include "optim/optimizer.h"

namespace limbo::train {

struct TrainState {
  int64_t step = 0;         // completed optimizer steps
  data::Cursor cursor;      // next sample of the epoch order
  int64_t samples = 0;      // samples trained on (all workers)
  // Steps skipped for a gradient or loss that was not finite: in all, and
  // in a row up to now (Diverged after train.max_nonfinite_steps). State
  // sync carries them, so every member of a group stops at the same step;
  // checkpoints do not (a resumed run counts afresh).
  int64_t skipped_steps = 0, skipped_in_a_row = 0;
  // DiLoCo: samples of this epoch behind the cursor that no committed outer
  // step processed yet (a member lost, or stopped early), dealt first in the
  // next outer step (train/diloco.h). Empty otherwise.
  PositionRanges owed;
  std::string config_toml;  // resolved configuration
  std::map<std::string, torch::Tensor> extra;  // component state, by name
};

// A fully sharded checkpoint (optim.shard_weights): the file at `path`
// holds all but the weights and the optimizer state (model/ holds the
// buffers; sharded/ the flat layout of the weights below), and each of the
// `world` shards of the flat weights and state is a file of its own beside
// it (shard_file), written by a member that holds it, in parallel.
struct ShardedLayout {
  int64_t world = 0, numel = 0;
  struct Param {
    std::string name;
    int64_t offset = 0, numel = 0;  // in the flat weights
    bool channels_last = false;     // its elements in the flat weights in NHWC order (a 4-D weight)
  };
  std::vector<Param> params;
};
// "PATH.shard-R-of-W.step-S": a shard's file, named for the step it holds
// (a checkpoint cut short leaves the last whole one readable).
std::string shard_file(const std::string& path, int rank, int world, int64_t step);
// Shard [lo, hi) of n: its weights, and its optimizer state by name (none
// before the first update), at committed step `step`.
void save_shard(const std::string& file, int64_t lo, int64_t hi, int64_t n, int64_t step, const float* weights,
                const std::vector<std::string>& state_names, const std::vector<const float*>& state,
                int64_t optimizer_steps);
// Removes the shard files beside `path` of other steps or worlds than the
// checkpoint's (after it is written).
void remove_other_shards(const std::string& path, int world, int64_t step);

// `sharded`: the file of a fully sharded checkpoint (above): `opt` gives
// only the update count and algorithm.
void save_checkpoint(const std::string& path, torch::nn::Module& model, const optim::Optimizer& opt,
                     const TrainState& state, const ShardedLayout* sharded = nullptr);

// The optimizer state of a fully sharded checkpoint left in its shard
// files for a resume that shards the state (load_checkpoint's `deferred`):
// whoever re-shards it reads the ranges it sends straight from the files,
// so that no member puts the whole state together.
struct DeferredShardState {
  int64_t step = -1, numel = 0, optimizer_steps = 0;
  std::vector<std::string> names;  // the optimizer's state tensors, in order
  struct Shard {
    std::string file;
    int64_t lo = 0, hi = 0;
    std::vector<uint64_t> offsets;  // where each state tensor's elements begin in the file
  };
  std::vector<Shard> shards;  // covering [0, numel) in order
  bool valid() const { return step >= 0 && !shards.empty(); }
  // Elements [a, b) of state tensor `i` into `dst`.
  void read(size_t i, int64_t a, int64_t b, float* dst) const;
};

// Loads into an existing model (values copied in place, so flat-parameter
// views survive; a fully sharded checkpoint's weights and state are read
// from its shard files, whole) and optimizer (state of another algorithm: started afresh); restores the torch RNG. Throws InvalidInput
// naming the file and the mismatching tensor on a missing file or shape clash.
// `deferred` (a resume whose state is sharded): a fully sharded
// checkpoint's optimizer state is not read but described there (`opt`
// gets its update count alone); other checkpoints load as without it.
TrainState load_checkpoint(const std::string& path, torch::nn::Module& model, optim::Optimizer* opt,
                           DeferredShardState* deferred = nullptr);

// The model's fingerprint stored in every checkpoint (state/model_description)
// and checked on load: one "parameter|buffer NAME[SHAPE]:DTYPE" per tensor.
std::vector<std::string> model_description(torch::nn::Module& m);

// Reads only the resolved config stored in a checkpoint.
std::string read_checkpoint_config(const std::string& path);

}  // namespace limbo::train
