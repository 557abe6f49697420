// Token streams (`data.dataset = "tokens"`): language-model data as one
// stream of token ids per split, cut into windows as it is read.
//
// A folder holds a training stream and a validation stream, each a 1-D
// integer array (uint8, int8, uint16, int16, int32 or int64):
//   train.npy and val.npy (np.save), or
//   train.safetensors and val.safetensors (one tensor, or a tensor "tokens"),
//   or shards of either: train-00000-of-00004.npy ... (or .safetensors),
//   val-00000-of-00001.npy ..., read as one stream in shard order.
// Files are memory-mapped, never copied. Sample i is the window
// x = s[o : o+T] with targets y = s[o+1 : o+T+1] (T = data.context), both
// int64 [T]; TokenStream (dataset.h) places the windows: each training
// epoch covers the stream once from a phase drawn from (seed, epoch), and
// validation windows never move.
//
// Every token must lie in [0, vocab); one outside is an InvalidInput naming
// the file, the position and the setting that fixed the vocabulary.
#pragma once

#include <string>

#include "data/dataset.h"

namespace limbo::data {

struct TokenOptions {
  int64_t context = 0;  // T, tokens per sample (data.context)
  int64_t vocab = 0;    // tokens lie in [0, vocab); 0: 1 + the largest token
  std::string vocab_from = "data.vocab";  // the setting that gave `vocab`, for messages
  uint64_t seed = 1;
};

DatasetSplits load_token_dataset(const std::string& dir, const TokenOptions& opt);

// The first token outside [0, vocab): its position in the stream and its
// value; position -1 when every token is in range.
struct TokenProblem {
  int64_t position = -1, value = 0;
};
TokenProblem find_bad_token(const TokenStream& s, int64_t vocab);
// "'FILE': the token at position P" (in a sharded stream: its shard and the
// position there), for messages.
std::string token_site(const TokenStream& s, int64_t position);

}  // namespace limbo::data
