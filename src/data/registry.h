// Datasets by name: "fashion-mnist", "mnist" (IDX), "cifar10" (binary),
// "synthetic" (generated), "tensors" (a user's npy / safetensors files, see
// tensor_dataset.h). Throws InvalidInput for unknown names.
#pragma once

#include <string>

#include "data/dataset.h"

namespace limbo::data {

struct DataSource {
  std::string dataset = "fashion-mnist";
  std::string path;  // empty = the dataset's default location
  int64_t train_limit = 0;  // 0 = all
  int64_t test_limit = 0;
  uint64_t seed = 1;  // for "synthetic"
};

DatasetSplits load_dataset(const DataSource& src);
std::string default_path(const std::string& dataset);

}  // namespace limbo::data
