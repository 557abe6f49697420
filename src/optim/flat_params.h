// Contiguous parameter and gradient storage for a module.
//
// The constructor copies every trainable parameter of the module into one
// flat float buffer and re-points the parameter at its slice (as a view), and
// gives each such parameter a gradient that is a view into a second flat
// buffer. Autograd then accumulates gradients in place into that buffer.
// Consequences:
//   - an optimizer step is a handful of vectorised ops over one tensor;
//   - all-reduce / push of the whole gradient needs no packing copy;
//   - zero_grad() is one fill.
// Call zero_grad() (never Module::zero_grad, which would detach the views)
// before each backward.
//
// Frozen parameters (requires_grad = false, e.g. a user's pre-trained
// backbone) are not in the flat buffers: they get no gradient, no bucket, no
// update and no place on the wire, and stay the module's own tensors.
// With include_frozen (the Python front end, where a loop may unfreeze a
// layer later), frozen float32 parameters are in the flat buffers too, with
// their requires_grad as it is: while one is frozen its `.grad` stays
// undefined (attach_grad) and its part of the gradient is zeros, so the
// user's optimizer leaves it alone; once unfrozen it trains like the others.
//
// Buffers of every dtype travel in one float32 region right after the
// gradient, grad_with_slot() = [gradient | buffers | slots]:
//   [float32 buffers, in place | float16/bfloat16 buffers as float32 copies |
//    float64 buffers as three exact 24-bit pieces of their 64 bits |
//    integer and bool buffers as three exact 24-bit pieces of their int64
//    value]
// The first part (averaged_numel() floats) is averaged by data-parallel
// members; the pieces are taken from one member (member 0 sends them, the
// others send zeros, and a sum with zeros is exact). So float64 buffers are
// member 0's, exactly, as PyTorch DDP's broadcast of rank 0's buffers makes
// them: averaging them in float32 turned values beyond float32's range into
// NaN, and moved identical values by float32 rounding at every step. The module's
// own buffers are what the model reads and what checkpoints hold; the
// region is how they travel: buffers_to_flat() before a collective over it,
// flat_to_buffers() after. Float32 buffers live in the region, so both are
// no-ops for them. One all-reduce of grad_with_slot() therefore also keeps
// every member's buffers in step (see AllReduceUpdate).
//
// With channels_last, 4-D parameters (convolution weights) are laid out in
// the flat buffers as [out, h, w, in] and exposed with channels-last strides;
// oneDNN's convolutions then avoid reordering weights and run markedly faster
// on CPU. Shapes, names and values are unchanged; only memory order differs.
#pragma once

#include <torch/torch.h>

#include <string>
#include <vector>

namespace limbo::optim {

// A float32 tensor of n zeros in memory that is mapped but not backed until
// written (an anonymous private mapping): pages never touched cost nothing,
// and release_pages() gives touched ones back. The fully sharded mode keeps
// the flat weights and gradient so: every member has the whole address
// range, and holds pages only where it works on them.
torch::Tensor lazy_floats(int64_t n);
// Gives the whole pages inside [p, p + count) floats back to the system:
// they read as zeros afterwards, and cost nothing until written again.
void release_pages(float* p, int64_t count);

class FlatParams {
 public:
  // With `lazy`, the flat weights and gradient are lazy_floats(): what a
  // member does not touch, or releases (release_weights, release_grad),
  // costs no memory (the fully sharded mode, optim.shard_weights).
  explicit FlatParams(torch::nn::Module& module, bool channels_last = false, bool include_frozen = false,
                      bool lazy = false);
  bool lazy() const { return lazy_; }
  // The pages of [lo, hi) of the weights or of the gradient given back
  // (the whole pages inside; lazy buffers only, else a no-op).
  void release_weights(int64_t lo, int64_t hi);
  void release_grad(int64_t lo, int64_t hi);

  torch::Tensor& data() { return data_; }
  torch::Tensor& grad() { return grad_; }
  // The gradient buffer, the buffers region, then kSlots spare floats: a
  // collective can carry scalars (the loss, a membership-change flag) with
  // the gradient in one call. grad() is a view of its first numel() elements,
  // buffers() of the next buffer_numel().
  static constexpr int64_t kSlots = 2;
  torch::Tensor& grad_with_slot() { return grad_slot_; }
  torch::Tensor& buffers() { return buffers_; }
  int64_t buffer_numel() const { return buffers_.numel(); }
  // buffers()[0, averaged_numel()) is averaged across members, the rest
  // (float64 and integer pieces) is taken from member 0.
  int64_t averaged_numel() const { return averaged_; }
  int64_t numel() const { return data_.numel(); }
  // With include_frozen: one float per parameter between the buffers and
  // the slots, [gradient | buffers | trainable | slots], where a reduction
  // can count the members that train each parameter (elastic::BucketReducer
  // leaves a bucket that every member had frozen off the wire). Empty
  // otherwise.
  torch::Tensor& trainable_counts() { return counts_; }
  // Elements of frozen parameters (not in the flat buffers).
  int64_t frozen_numel() const { return frozen_; }
  // The frozen parameters themselves (the module's tensors).
  const std::vector<torch::Tensor>& frozen_parameters() const { return frozen_params_; }
  void zero_grad() { grad_.zero_(); }

  // Module buffers -> region (for those not stored in it), and back.
  void buffers_to_flat();
  void flat_to_buffers();
  // Copies of every module buffer, and putting them back: a step that is
  // undone or skipped leaves the buffers as they were.
  std::vector<torch::Tensor> save_buffers() const;
  void restore_buffers(const std::vector<torch::Tensor>& saved);

  struct Entry {
    std::string name;
    std::vector<int64_t> shape;
    int64_t offset, numel;
  };
  // Trainable parameter names, shapes and offsets, in flat order.
  const std::vector<Entry>& entries() const { return entries_; }
  // The module's trainable parameters in the same order (autograd leaves
  // whose data and gradient are views into the flat buffers).
  const std::vector<torch::Tensor>& parameters() const { return params_; }
  // Each parameter's gradient as the constructor made it (a view of grad(),
  // channels-last where the parameter is): what to give back to a parameter
  // whose gradient was dropped or replaced.
  const std::vector<torch::Tensor>& grad_views() const { return grad_views_; }
  // Parameter i's `.grad` back to its view of grad(): a gradient autograd or
  // the user put elsewhere (zero_grad(set_to_none=True), an assignment) is
  // copied in when `keep` (none: zeros), else dropped. A no-op while `.grad`
  // is the view. A parameter frozen now (include_frozen): `.grad` undefined
  // (an optimizer skips it) and, when `keep`, its view zeros.
  void attach_grad(size_t i, bool keep);
  void attach_grads(bool keep);
  // Parameter i's gradient of this step dropped (its view zeros, `.grad`
  // undefined, and kept so by attach_grad until autograd or the user gives
  // it a new one, or release_grads()): a bucket that stayed off the wire.
  void drop_grad(size_t i);
  // Every `.grad` undefined: the next backward's gradients land in tensors
  // of autograd's own, with no zeroing of grad() and no read of it, and
  // attach_grad(i, true) copies each into its view (one pass, as against
  // zero_grad()'s pass and the in-place sum's two).
  void release_grads();
  // Whether every parameter's `.grad`, wherever it is, holds only finite
  // values (undefined ones: no gradient, nothing to check).
  bool grads_finite() const;

  enum class Carry { InPlace, Float, Float64, Integer };
  struct BufferEntry {
    std::string name;
    torch::Tensor tensor;  // the module's buffer
    Carry carry;
    int64_t offset;  // in buffers()
  };
  const std::vector<BufferEntry>& buffer_entries() const { return buffer_entries_; }

 private:
  bool lazy_ = false;
  torch::Tensor data_, grad_, grad_slot_, buffers_, counts_;
  std::vector<Entry> entries_;
  std::vector<torch::Tensor> params_, grad_views_;
  std::vector<char> dropped_;
  std::vector<char> zeros_;  // per parameter: its view is known to hold zeros (frozen: not zeroed again)
  std::vector<BufferEntry> buffer_entries_;
  int64_t averaged_ = 0, frozen_ = 0;
  std::vector<torch::Tensor> frozen_params_;
};

}  // namespace limbo::optim
