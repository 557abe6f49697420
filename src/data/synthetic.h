// A synthetic, learnable image-classification dataset for tests and
// benchmarks: each class has a random prototype image; a sample is its
// class prototype plus uniform noise. Deterministic for a seed.
#pragma once

#include <cstdint>

#include "data/dataset.h"

namespace limbo::data {

struct SyntheticOptions {
  Shape shape{1, 28, 28};
  int64_t num_classes = 10;
  int64_t train_size = 2048;
  int64_t test_size = 512;
  int noise = 96;  // max absolute noise per pixel, 0..255
  uint64_t seed = 1;
};

DatasetSplits make_synthetic(const SyntheticOptions& opt);

}  // namespace limbo::data
