// Reader for the CIFAR-10 binary format: records of 1 label byte followed by
// 3072 pixel bytes (3 x 32 x 32, channel-major), in data_batch_{1..5}.bin and
// test_batch.bin.
#pragma once

#include <string>
#include <vector>

#include "data/dataset.h"

namespace limbo::data {

// Reads and concatenates CIFAR-10 binary files. Throws InvalidInput naming the
// file on: a missing file, a size that is not a whole number of 3073-byte
// records (truncated), or a label >= 10.
Dataset read_cifar10_files(const std::vector<std::string>& paths, const std::string& name);

// Loads "<dir>/data_batch_{1..5}.bin" and "<dir>/test_batch.bin"; `dir` may
// also be the parent of "cifar-10-batches-bin".
DatasetSplits load_cifar10(const std::string& dir);

}  // namespace limbo::data
