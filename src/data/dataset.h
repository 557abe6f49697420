// Datasets, independent of libtorch.
//
// Built-in readers (IDX, CIFAR-10, synthetic) hold images in memory as uint8
// N x C x H x W (row-major) and labels as uint8 class ids. Tensor datasets
// ("tensors": npy / safetensors files) instead hold memory-mapped arrays x
// [N, ...] and y [N, ...] of any supported dtype (`tensors`); their `shape`
// describes one sample of x as C x H x W where it can (see tensor_dataset.h).
// Readers validate everything they load and throw InvalidInput naming the
// file and what is wrong; a Dataset that exists is consistent.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "data/tensor_file.h"

namespace limbo::data {

struct Shape {
  int64_t channels = 0, height = 0, width = 0;
  int64_t pixels() const { return channels * height * width; }
};

// Mapped sample and target arrays of a tensor dataset (rows agree).
struct TensorPair {
  MappedTensor x, y;
};

// A token stream (`data.dataset = "tokens"`, token_dataset.h): one 1-D
// integer array; sample i of epoch e is the window of `context` tokens at
// offset(e, i), its targets the same window one token later.
struct TokenStream {
  MappedTensor tokens;  // [L], shards concatenated
  int64_t context = 0;  // T
  // Validation: window i starts at i * T in every epoch. Training: at
  // i * T + a phase in [0, T) drawn from (seed, epoch), so an epoch covers
  // the stream once, cut differently each epoch.
  bool fixed = false;
  uint64_t seed = 1;
  int64_t windows() const;  // samples per epoch
  int64_t offset(int64_t epoch, int64_t id) const;
  // Tokens [start, start + n) as int64 (across shards).
  void read(int64_t start, int64_t n, int64_t* out) const;
};

struct Dataset {
  std::string name;
  Shape shape;
  int64_t num_classes = 0;  // tensor datasets: 1 + the largest label (0 = float targets)
  std::vector<uint8_t> images;  // size() * shape.pixels()
  std::vector<uint8_t> labels;  // size()
  std::shared_ptr<const TensorPair> tensors;  // set for tensor datasets (images/labels empty)
  std::shared_ptr<const TokenStream> stream;  // set for token streams (images/labels empty)
  int64_t tensor_rows = 0;  // rows of `tensors`, or windows of `stream`, in use (after truncate)
  // Tensor datasets: x reaches the model as int64 ids (token or item ids
  // for an embedding) instead of float (registry.h, data.inputs).
  bool x_ids = false;
  int64_t size() const {
    return tensors || stream ? tensor_rows : static_cast<int64_t>(labels.size());
  }
  const uint8_t* image(int64_t i) const { return images.data() + i * shape.pixels(); }
  // Keeps only the first n samples (n >= size() keeps all).
  void truncate(int64_t n);
};

struct DatasetSplits {
  Dataset train;
  Dataset test;
};

// Per-channel normalisation constants, computed from the training split.
// Empty vectors mean "no normalisation" (tensor datasets by default).
struct Normalization {
  std::vector<float> mean, std;  // one per channel, in [0,1] pixel units
};
// Image datasets: channels of C x H x W. Tensor datasets: the first dimension
// after N of x is the channel (every feature for x [N, D]); values are taken
// after uint8 inputs are scaled by 1/255. One streaming pass over the split.
Normalization compute_normalization(const Dataset& d);

}  // namespace limbo::data
