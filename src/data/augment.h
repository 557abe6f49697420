// Data augmentation in the loader (data.augment).
//
// A comma-separated list of operations, applied in order to each training
// sample on the loader's producer thread (never to evaluation):
//   random_crop:P  pad the image by P pixels of zero on every side and crop
//                  it back to its size at a random offset (torchvision's
//                  RandomCrop(size, padding=P) with fill 0)
//   hflip          mirror the image left to right with probability 1/2
//                  (torchvision's RandomHorizontalFlip())
// Samples are images [C, H, W]. Padding is zero in pixel space, before
// normalisation (as ToTensor, RandomCrop, Normalize do), so a normalised
// batch is filled with each channel's normalised zero.
//
// The random draws are a pure function of (train.seed, epoch, sample id):
// a step redone after a failure, a membership change or a resume sees the
// same augmented sample, so exactly-once holds for what is trained on, not
// only for sample ids; and a learner of any mode augments a sample alike.
#pragma once

#include <torch/torch.h>

#include <cstdint>
#include <string>
#include <vector>

namespace limbo::data {

struct AugmentOp {
  enum class Kind { RandomCrop, HFlip } kind;
  int64_t padding = 0;  // random_crop
};

// What the operations drew for one sample.
struct AugmentDraw {
  int64_t top = 0, left = 0;  // random_crop: the crop's corner in the padded image
  bool flip = false;
};

class Augmenter {
 public:
  Augmenter() = default;
  // Parses data.augment ("random_crop:4,hflip"; "" = none); throws
  // InvalidInput naming the item and what is allowed.
  Augmenter(const std::string& spec, uint64_t seed);
  bool empty() const { return ops_.empty(); }
  const std::vector<AugmentOp>& ops() const { return ops_; }
  std::string describe() const;
  // Throws InvalidInput unless samples of this shape ([C, H, W]) can be augmented.
  void check_sample_shape(const std::vector<int64_t>& shape) const;
  AugmentDraw draw(int64_t epoch, int64_t id) const;
  // Augments the samples of x [n, C, H, W] in place; fill[c] is channel c's
  // value of a zero pixel (empty: 0).
  void apply(torch::Tensor& x, const std::vector<int64_t>& ids, int64_t epoch,
             const std::vector<float>& fill) const;

 private:
  std::vector<AugmentOp> ops_;
  uint64_t seed_ = 0;
};

}  // namespace limbo::data
