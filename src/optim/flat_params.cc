#include "optim/flat_params.h"

#include <malloc.h>

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "common/error.h"

namespace limbo::optim {

namespace {

// A view of `numel` elements of `flat` at `offset`, shaped `shape`.
torch::Tensor shaped_view(torch::Tensor& flat, int64_t offset, const std::vector<int64_t>& shape,
                          bool channels_last) {
  auto slice = flat.narrow(0, offset, c10::multiply_integers(shape));
  if (channels_last && shape.size() == 4)
    return slice.view({shape[0], shape[2], shape[3], shape[1]}).permute({0, 3, 1, 2});
  return slice.view(shape);
}

using Carry = FlatParams::Carry;

Carry carry_of(const std::string& name, const torch::Tensor& t) {
  const auto type = t.scalar_type();
  if (type == torch::kFloat32) return Carry::InPlace;
  if (type == torch::kFloat16 || type == torch::kBFloat16) return Carry::Float;
  if (type == torch::kFloat64) return Carry::Float64;
  if (c10::isIntegralType(type, /*includeBool=*/true)) return Carry::Integer;
  throw InvalidInput("buffer '" + name + "' is " + std::string(c10::toString(type)) +
                     "; Limbo keeps float, integer and bool buffers in step");
}

int64_t floats_for(Carry c, int64_t numel) {
  switch (c) {
    case Carry::Float64:
    case Carry::Integer: return 3 * numel;
    default: return numel;
  }
}

constexpr int64_t kPiece = int64_t{1} << 24;  // a float32 holds every integer below 2^24 exactly

}  // namespace

torch::Tensor lazy_floats(int64_t n) {
  const size_t bytes = std::max<size_t>(static_cast<size_t>(n) * sizeof(float), 1);
  void* p = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (p == MAP_FAILED)
    throw Error("cannot map " + std::to_string(bytes) + " bytes for the flat buffers: " + std::strerror(errno));
  return torch::from_blob(p, {n}, [bytes](void* q) { ::munmap(q, bytes); }, torch::kFloat32);
}

void release_pages(float* p, int64_t count) {
  if (count <= 0) return;
  static const uintptr_t page = static_cast<uintptr_t>(::sysconf(_SC_PAGESIZE));
  const uintptr_t a = (reinterpret_cast<uintptr_t>(p) + page - 1) / page * page;
  const uintptr_t e = reinterpret_cast<uintptr_t>(p + count) / page * page;
  if (e > a) ::madvise(reinterpret_cast<void*>(a), e - a, MADV_DONTNEED);
}

void FlatParams::release_weights(int64_t lo, int64_t hi) {
  if (lazy_ && hi > lo) release_pages(data_.data_ptr<float>() + lo, hi - lo);
}

void FlatParams::release_grad(int64_t lo, int64_t hi) {
  if (lazy_ && hi > lo) release_pages(grad_slot_.data_ptr<float>() + lo, hi - lo);
}

FlatParams::FlatParams(torch::nn::Module& module, bool channels_last, bool include_frozen, bool lazy)
    : lazy_(lazy) {
  auto named = module.named_parameters(/*recurse=*/true);
  int64_t total = 0;
  std::vector<torch::Tensor> trainable;
  for (const auto& p : named) {
    const bool in_flat = include_frozen && p.value().scalar_type() == torch::kFloat32;
    if (!p.value().requires_grad() && !in_flat) {  // frozen: the module keeps it as it is
      frozen_ += p.value().numel();
      frozen_params_.push_back(p.value());
      continue;
    }
    if (p.value().scalar_type() != torch::kFloat32)
      throw Error("FlatParams supports float32 parameters only; '" + p.key() + "' is " +
                  std::string(c10::toString(p.value().scalar_type())));
    entries_.push_back({p.key(), p.value().sizes().vec(), total, p.value().numel()});
    trainable.push_back(p.value());
    total += p.value().numel();
  }
  // Averaged kinds first, in this order, then the exact pieces (member 0's).
  int64_t buffer_total = 0;
  auto named_buffers = module.named_buffers(/*recurse=*/true);
  for (Carry kind : {Carry::InPlace, Carry::Float, Carry::Float64, Carry::Integer}) {
    if (kind == Carry::Float64) averaged_ = buffer_total;
    for (const auto& b : named_buffers) {
      if (carry_of(b.key(), b.value()) != kind) continue;
      buffer_entries_.push_back({b.key(), b.value(), kind, buffer_total});
      buffer_total += floats_for(kind, b.value().numel());
    }
  }
  const int64_t counts = include_frozen ? static_cast<int64_t>(trainable.size()) : 0;
  const int64_t slot_total = total + buffer_total + counts + kSlots;
  data_ = lazy ? lazy_floats(total) : torch::empty({total}, torch::kFloat32);
  grad_slot_ = lazy ? lazy_floats(slot_total) : torch::zeros({slot_total}, torch::kFloat32);
  grad_ = grad_slot_.narrow(0, 0, total);
  buffers_ = grad_slot_.narrow(0, total, buffer_total);
  counts_ = grad_slot_.narrow(0, total + buffer_total, counts);
  torch::NoGradGuard no_grad;
  for (auto& b : buffer_entries_) {
    if (b.carry != Carry::InPlace) continue;
    auto view = buffers_.narrow(0, b.offset, b.tensor.numel()).view(b.tensor.sizes());
    view.copy_(b.tensor);
    b.tensor.set_data(view);
  }
  buffers_to_flat();
  int64_t freed = 0;  // bytes of the module's own tensors freed since the heap last gave memory back
  for (size_t i = 0; i < trainable.size(); ++i) {
    const Entry& e = entries_[i];
    auto view = shaped_view(data_, e.offset, e.shape, channels_last);
    view.copy_(trainable[i]);
    trainable[i].set_data(view);
    // Lazy (a model larger than a member may hold, sharded next): the
    // module's tensor, freed into the heap, goes back to the system every
    // 64 MiB, so that the copy never holds the model twice.
    freed += 4 * e.numel;
    if (lazy && freed >= (int64_t{64} << 20)) {
      ::malloc_trim(0);
      freed = 0;
    }
    grad_views_.push_back(shaped_view(grad_, e.offset, e.shape, channels_last));
    if (trainable[i].requires_grad()) trainable[i].mutable_grad() = grad_views_.back();
    params_.push_back(trainable[i]);
  }
  dropped_.assign(params_.size(), 0);
  zeros_.assign(params_.size(), 1);
}

void FlatParams::drop_grad(size_t i) {
  torch::NoGradGuard no_grad;
  grad_views_[i].zero_();
  params_[i].mutable_grad() = torch::Tensor();
  dropped_[i] = 1;
  zeros_[i] = 1;
}

void FlatParams::attach_grad(size_t i, bool keep) {
  const auto& view = grad_views_[i];
  auto& g = params_[i].mutable_grad();
  if (dropped_[i]) {
    if (!g.defined()) return;  // dropped this step: stays so
    dropped_[i] = 0;
  }
  if (!params_[i].requires_grad()) {  // frozen now (include_frozen): no gradient, zeros on the wire
    g = torch::Tensor();
    if (keep && !zeros_[i]) {  // once after it was frozen: a frozen backbone costs no pass a step
      torch::NoGradGuard no_grad;
      view.zero_();
      zeros_[i] = 1;
    }
    return;
  }
  zeros_[i] = 0;
  if (g.defined() && g.data_ptr() == view.data_ptr() && g.sizes() == view.sizes() && g.strides() == view.strides())
    return;
  torch::NoGradGuard no_grad;
  if (keep) {
    if (g.defined()) view.copy_(g);
    else view.zero_();
  }
  g = view;
}

void FlatParams::attach_grads(bool keep) {
  for (size_t i = 0; i < params_.size(); ++i) attach_grad(i, keep);
}

bool FlatParams::grads_finite() const {
  torch::NoGradGuard no_grad;
  for (const auto& p : params_) {
    const auto& g = p.grad();
    if (g.defined() && g.numel() > 0 && !std::isfinite(g.sum().item<float>())) return false;
  }
  return true;
}

void FlatParams::release_grads() {
  std::fill(dropped_.begin(), dropped_.end(), 0);
  for (auto& p : params_) p.mutable_grad() = torch::Tensor();
}

void FlatParams::buffers_to_flat() {
  torch::NoGradGuard no_grad;
  for (auto& b : buffer_entries_) {
    const int64_t n = b.tensor.numel();
    auto v = b.tensor.reshape({-1});
    switch (b.carry) {
      case Carry::InPlace: break;
      case Carry::Float: buffers_.narrow(0, b.offset, n).copy_(v); break;
      case Carry::Float64:  // its 64 bits, as an integer's (any value, inf and NaN included)
      case Carry::Integer: {
        auto i = b.carry == Carry::Float64 ? v.contiguous().view(torch::kInt64) : v.to(torch::kInt64);
        buffers_.narrow(0, b.offset, n).copy_(torch::remainder(i, kPiece));
        auto high = torch::floor_divide(i, kPiece);
        buffers_.narrow(0, b.offset + n, n).copy_(torch::remainder(high, kPiece));
        buffers_.narrow(0, b.offset + 2 * n, n).copy_(torch::floor_divide(high, kPiece));
        break;
      }
    }
  }
}

void FlatParams::flat_to_buffers() {
  torch::NoGradGuard no_grad;
  for (auto& b : buffer_entries_) {
    const int64_t n = b.tensor.numel();
    auto shape = b.tensor.sizes();
    switch (b.carry) {
      case Carry::InPlace: break;
      case Carry::Float: b.tensor.copy_(buffers_.narrow(0, b.offset, n).view(shape)); break;
      case Carry::Float64:
      case Carry::Integer: {
        auto piece = [&](int k) { return buffers_.narrow(0, b.offset + k * n, n).to(torch::kInt64); };
        auto i = piece(0) + (piece(1) + piece(2) * kPiece) * kPiece;
        b.tensor.copy_((b.carry == Carry::Float64 ? i.view(torch::kFloat64) : i).view(shape));
        break;
      }
    }
  }
}

std::vector<torch::Tensor> FlatParams::save_buffers() const {
  std::vector<torch::Tensor> out;
  out.reserve(buffer_entries_.size());
  for (const auto& b : buffer_entries_) out.push_back(b.tensor.clone());
  return out;
}

void FlatParams::restore_buffers(const std::vector<torch::Tensor>& saved) {
  if (saved.size() != buffer_entries_.size()) throw Error("internal: restoring buffers of another model");
  torch::NoGradGuard no_grad;
  for (size_t i = 0; i < saved.size(); ++i) buffer_entries_[i].tensor.copy_(saved[i]);
}

}  // namespace limbo::optim
