// Tensor datasets (`data.dataset = "tensors"`): a user's arrays in files.
//
// A folder holds either `train.safetensors` and `test.safetensors`, each with
// tensors `x` [N, ...] and `y` [N, ...], or the numpy files `train_x.npy`,
// `train_y.npy`, `test_x.npy`, `test_y.npy` (np.save). x may be uint8, int8,
// int32, int64, float16, bfloat16, float32 or float64; how it reaches the
// model is `Dataset::x_ids` (dataset.h): float (uint8 scaled by 1/255, the
// others as they are), or int64 token ids. y holds integer class labels
// ([N] or [N, ...], e.g. per token; made int64) or float targets.
//
// Files are memory-mapped, never copied. Every problem is an InvalidInput
// naming the file: a missing file or tensor, an unsupported dtype, x and y
// lengths that differ, a truncated file, a corrupt header, train and test
// samples of different shapes, a negative label.
//
// The samples' `shape` is C x H x W for x [N, C, H, W], 1 x H x W for
// [N, H, W], D x 1 x 1 for [N, D]; `num_classes` is 1 + the largest label of
// either split (0 for float targets).
#pragma once

#include <string>

#include "data/dataset.h"

namespace limbo::data {

// `classes` > 0: the model's outputs (registry.h); labels are checked
// against it by the caller. 0: 1 + the largest label, refused (naming the
// file and the sample) when some label below it never occurs in the
// training split: a stray label (255 among 0..9) would otherwise size the
// model's output layer, up to running out of memory. `sized_by_model`: the
// model's output width is its own (a user's module), and the caller checks
// labels against it; no such refusal (byte data never holds bytes 0-31).
DatasetSplits load_tensor_dataset(const std::string& dir, int64_t classes = 0, bool sized_by_model = false);

// The sample shape of x without N, e.g. {1, 28, 28}.
std::vector<int64_t> sample_shape(const Dataset& d);
// The target shape of y without N ({} for [N] labels).
std::vector<int64_t> target_shape(const Dataset& d);
// True when targets are class labels (integers; every built-in dataset).
bool has_labels(const Dataset& d);

// The first sample whose label lies outside [0, num_classes): its index and
// label; index -1 when every label is in range.
struct LabelProblem {
  int64_t index = -1, label = 0;
};
// Token streams: the first token outside the range, by position.
LabelProblem find_bad_label(const Dataset& d, int64_t num_classes);
// Where label `index` of find_bad_label sits, for messages: "'FILE': sample
// K" (tensors, built-in datasets) or "'FILE': the token at position P".
std::string label_site(const Dataset& d, int64_t index);

}  // namespace limbo::data
