// Reader for the IDX format of the MNIST family (MNIST, Fashion-MNIST, ...).
// Accepts raw files and gzip-compressed (.gz) files transparently. Only the
// unsigned-byte element type (0x08) is supported, which is what these
// datasets use.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "data/dataset.h"

namespace limbo::data {

struct IdxArray {
  std::vector<int64_t> dims;
  std::vector<uint8_t> data;
};

// Reads one IDX file. Throws InvalidInput naming the path on: a missing file,
// bad magic, an unsupported element type, a truncated body or trailing bytes.
IdxArray read_idx(const std::string& path);

// Reads an images file (3 dims: N x H x W) and a labels file (1 dim: N) into
// a 1-channel Dataset. Throws InvalidInput on wrong dimensions, differing
// counts, or labels >= num_classes.
Dataset read_idx_dataset(const std::string& images_path,
                         const std::string& labels_path,
                         const std::string& name, int64_t num_classes = 10);

// Loads "<dir>/train-images-idx3-ubyte[.gz]" etc. Prefers the .gz files
// when both exist.
DatasetSplits load_mnist_family(const std::string& dir, const std::string& name);

}  // namespace limbo::data
