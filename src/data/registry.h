// Datasets by name: "fashion-mnist", "mnist" (IDX), "cifar10" (binary),
// "synthetic" (generated), "tensors" (a user's npy / safetensors files, see
// tensor_dataset.h), "tokens" (a user's token streams, token_dataset.h). Throws InvalidInput for unknown names.
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
  // The model's outputs for class labels (model.classes); 0: the dataset's
  // own count (tensors: 1 + the largest label, every label below it seen in
  // the training split). Labels outside [0, classes) are refused, naming
  // the file and the sample.
  int64_t classes = 0;
  // How integer samples x of a tensor dataset reach the model (data.inputs):
  // "auto": uint8 as float scaled by 1/255 (images), other integers as
  // int64 ids when `user_model`, else float; "ids": every integer dtype as
  // int64 ids; "float": all as float.
  std::string inputs = "auto";
  // The model is the user's own module: its output width, not the labels,
  // says how many classes there are (no refusal of label gaps here; the
  // trainer checks the labels against the module's outputs).
  bool user_model = false;
  // Token streams ("tokens", token_dataset.h): tokens per sample
  // (data.context), and the vocabulary (data.vocab; 0 = model.classes,
  // else 1 + the largest token).
  int64_t context = 0;
  int64_t vocab = 0;
};

DatasetSplits load_dataset(const DataSource& src);
std::string default_path(const std::string& dataset);

}  // namespace limbo::data
