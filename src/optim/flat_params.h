// Contiguous parameter and gradient storage for a module.
//
// The constructor copies every parameter of the module into one flat float
// buffer and re-points the parameter at its slice (as a view), and gives each
// parameter a gradient that is a view into a second flat buffer. Autograd then
// accumulates gradients in place into that buffer. Consequences:
//   - an optimizer step is a handful of vectorised ops over one tensor;
//   - all-reduce / push of the whole gradient needs no packing copy;
//   - zero_grad() is one fill.
// Call zero_grad() (never Module::zero_grad, which would detach the views)
// before each backward.
//
// Float32 buffers (BatchNorm running statistics) live in the same allocation,
// right after the gradient: grad_with_slot() = [gradient | buffers | slots].
// One all-reduce of grad_with_slot() therefore also averages the members'
// buffers (data-parallel training keeps them identical, see AllReduceUpdate).
// Other buffers (BatchNorm's int64 num_batches_tracked) stay where they are.
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

class FlatParams {
 public:
  explicit FlatParams(torch::nn::Module& module, bool channels_last = false);

  torch::Tensor& data() { return data_; }
  torch::Tensor& grad() { return grad_; }
  // The gradient buffer, the float buffers, then kSlots spare floats: a
  // collective can carry scalars (the loss, a membership-change flag) with
  // the gradient in one call. grad() is a view of its first numel() elements,
  // buffers() of the next buffer_numel().
  static constexpr int64_t kSlots = 2;
  torch::Tensor& grad_with_slot() { return grad_slot_; }
  torch::Tensor& buffers() { return buffers_; }
  int64_t buffer_numel() const { return buffers_.numel(); }
  int64_t numel() const { return data_.numel(); }
  void zero_grad() { grad_.zero_(); }

  struct Entry {
    std::string name;
    std::vector<int64_t> shape;
    int64_t offset, numel;
  };
  // Parameter names, shapes and offsets, in flat order.
  const std::vector<Entry>& entries() const { return entries_; }
  // The module's parameters in the same order (autograd leaves whose data
  // and gradient are views into the flat buffers).
  const std::vector<torch::Tensor>& parameters() const { return params_; }

 private:
  torch::Tensor data_, grad_, grad_slot_, buffers_;
  std::vector<Entry> entries_;
  std::vector<torch::Tensor> params_;
};

}  // namespace limbo::optim
