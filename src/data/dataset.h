// In-memory image-classification datasets, independent of libtorch.
//
// Images are stored as uint8 N x C x H x W (row-major), labels as uint8 class
// ids. Readers validate everything they load and throw InvalidInput naming the
// file and what is wrong; a Dataset that exists is consistent.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace limbo::data {

struct Shape {
  int64_t channels = 0, height = 0, width = 0;
  int64_t pixels() const { return channels * height * width; }
};

struct Dataset {
  std::string name;
  Shape shape;
  int64_t num_classes = 0;
  std::vector<uint8_t> images;  // size() * shape.pixels()
  std::vector<uint8_t> labels;  // size()
  int64_t size() const { return static_cast<int64_t>(labels.size()); }
  const uint8_t* image(int64_t i) const { return images.data() + i * shape.pixels(); }
  // Keeps only the first n samples (n >= size() keeps all).
  void truncate(int64_t n);
};

struct DatasetSplits {
  Dataset train;
  Dataset test;
};

// Per-channel normalisation constants, computed from the training split.
struct Normalization {
  std::vector<float> mean, std;  // one per channel, in [0,1] pixel units
};
Normalization compute_normalization(const Dataset& d);

}  // namespace limbo::data
