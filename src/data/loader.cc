#include "data/loader.h"

#include <algorithm>

#include "common/error.h"
#include "common/process.h"

namespace limbo::data {

namespace {

void fill_targets(const MappedTensor& ys, const std::vector<int64_t>& ids, Batch& b) {
  const bool labels = is_integer(ys.dtype);
  std::vector<int64_t> yshape = ys.shape;
  yshape[0] = static_cast<int64_t>(ids.size());
  b.y = torch::empty(yshape, labels ? torch::kInt64 : torch::kFloat32);
  const int64_t yrow = ys.row_numel();
  for (size_t i = 0; i < ids.size(); ++i) {
    if (labels) to_int64(ys.dtype, ys.row(ids[i]), yrow, b.y.data_ptr<int64_t>() + i * yrow);
    else to_float(ys.dtype, ys.row(ids[i]), yrow, b.y.data_ptr<float>() + i * yrow);
  }
}

// Tensor datasets: rows of x converted to float (uint8 scaled by 1/255), then
// standardised per channel when `norm` is set, or (Dataset::x_ids) to int64
// ids as they are; y as int64 labels or float.
Batch make_tensor_batch(const Dataset& d, const Normalization& norm,
                        const std::vector<int64_t>& ids) {
  const MappedTensor& xs = d.tensors->x;
  const int64_t n = static_cast<int64_t>(ids.size());
  std::vector<int64_t> xshape = xs.shape;
  xshape[0] = n;
  Batch b;
  fill_targets(d.tensors->y, ids, b);
  const int64_t xrow = xs.row_numel();
  if (d.x_ids) {
    b.x = torch::empty(xshape, torch::kInt64);
    int64_t* x = b.x.data_ptr<int64_t>();
    for (int64_t i = 0; i < n; ++i) to_int64(xs.dtype, xs.row(ids[i]), xrow, x + i * xrow);
    return b;
  }
  b.x = torch::empty(xshape, torch::kFloat32);
  const int64_t channels = norm.mean.empty() ? 0 : static_cast<int64_t>(norm.mean.size());
  const int64_t inner = channels > 0 ? xrow / channels : 0;
  float* x = b.x.data_ptr<float>();
  const float base = xs.dtype == DType::U8 ? 1.0f / 255.0f : 1.0f;
  for (int64_t i = 0; i < n; ++i) {
    float* q = x + i * xrow;
    if (xs.dtype == DType::U8) {  // one pass: uint8 -> scaled (and normalised) float
      const uint8_t* p = xs.row(ids[i]);
      const int64_t groups = channels > 0 ? channels : 1, len = channels > 0 ? inner : xrow;
      for (int64_t c = 0; c < groups; ++c) {
        const float scale = channels > 0 ? base / norm.std[c] : base;
        const float shift = channels > 0 ? -norm.mean[c] / norm.std[c] : 0.0f;
        for (int64_t k = c * len; k < (c + 1) * len; ++k) q[k] = p[k] * scale + shift;
      }
      continue;
    }
    to_float(xs.dtype, xs.row(ids[i]), xrow, q);  // other dtypes: as they are
    for (int64_t c = 0; c < channels; ++c) {
      const float scale = 1.0f / norm.std[c], shift = -norm.mean[c] / norm.std[c];
      float* r = q + c * inner;
      for (int64_t k = 0; k < inner; ++k) r[k] = r[k] * scale + shift;
    }
  }
  return b;
}

// Token streams: window x = s[o : o+T] and y = s[o+1 : o+T+1] of each id,
// from one read of T + 1 tokens.
Batch make_token_batch(const TokenStream& s, const std::vector<int64_t>& ids, int64_t epoch) {
  const int64_t n = static_cast<int64_t>(ids.size()), t = s.context;
  Batch b;
  b.x = torch::empty({n, t}, torch::kInt64);
  b.y = torch::empty({n, t}, torch::kInt64);
  int64_t* x = b.x.data_ptr<int64_t>();
  int64_t* y = b.y.data_ptr<int64_t>();
  std::vector<int64_t> w(static_cast<size_t>(t + 1));
  for (int64_t i = 0; i < n; ++i) {
    s.read(s.offset(epoch, ids[i]), t + 1, w.data());
    std::copy(w.begin(), w.end() - 1, x + i * t);
    std::copy(w.begin() + 1, w.end(), y + i * t);
  }
  return b;
}

}  // namespace

Batch make_batch(const Dataset& d, const Normalization& norm, const std::vector<int64_t>& ids) {
  if (d.stream) return make_token_batch(*d.stream, ids, 0);
  if (d.tensors) return make_tensor_batch(d, norm, ids);
  const int64_t n = static_cast<int64_t>(ids.size());
  const auto& s = d.shape;
  const int64_t plane = s.height * s.width;
  Batch b;
  b.x = torch::empty({n, s.channels, s.height, s.width}, torch::kFloat32);
  b.y = torch::empty({n}, torch::kInt64);
  float* x = b.x.data_ptr<float>();
  int64_t* y = b.y.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i) {
    const uint8_t* src = d.image(ids[i]);
    for (int64_t c = 0; c < s.channels; ++c) {
      // (v/255 - mean)/std == v*scale + shift
      const float scale = 1.0f / (255.0f * norm.std[c]);
      const float shift = -norm.mean[c] / norm.std[c];
      const uint8_t* p = src + c * plane;
      float* q = x + (i * s.channels + c) * plane;
      for (int64_t k = 0; k < plane; ++k) q[k] = p[k] * scale + shift;
    }
    y[i] = d.labels[ids[i]];
  }
  return b;
}

Batch make_train_batch(const Dataset& d, const Normalization& norm, const std::vector<int64_t>& ids,
                       int64_t epoch, const Augmenter& augment) {
  if (d.stream) return make_token_batch(*d.stream, ids, epoch);
  Batch b = make_batch(d, norm, ids);
  if (augment.empty()) return b;
  std::vector<float> fill;  // a zero pixel, normalised
  for (size_t c = 0; c < norm.mean.size(); ++c) fill.push_back(-norm.mean[c] / norm.std[c]);
  augment.apply(b.x, ids, epoch, fill);
  return b;
}

BatchLoader::BatchLoader(std::shared_ptr<const Dataset> dataset, Normalization norm,
                         LoaderOptions opt, Cursor start)
    : dataset_(std::move(dataset)),
      norm_(std::move(norm)),
      opt_(opt),
      sampler_(dataset_->size(), opt.order, opt.seed) {
  if (opt_.prefetch < 1) opt_.prefetch = 1;
  start_thread(start);
}

BatchLoader::~BatchLoader() { stop_thread(); }

void BatchLoader::start_thread(Cursor from) {
  stop_ = false;
  stopping_ = false;
  error_ = nullptr;
  queue_.clear();
  next_cursor_ = from;
  thread_ = std::thread([this] { run(); });
}

void BatchLoader::stop_thread() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
    stopping_ = true;
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
}

void BatchLoader::restart(Cursor from, int world, int rank, int64_t step) {
  stop_thread();
  opt_.world = world;
  opt_.rank = rank;
  next_step_ = step;
  start_thread(from);
}

void BatchLoader::set_paces(std::shared_ptr<const PaceShares> paces) {
  std::lock_guard<std::mutex> lock(mu_);
  paces_ = std::move(paces);
}

void BatchLoader::run() {
  name_this_thread("limbo-loader");
  try {
    for (;;) {
      Cursor at;
      int64_t step;
      std::shared_ptr<const PaceShares> paces;
      {
        std::unique_lock<std::mutex> lock(mu_);
        cv_.wait(lock, [&] { return stop_ || static_cast<int>(queue_.size()) < opt_.prefetch; });
        if (stop_) return;
        at = next_cursor_;
        step = next_step_;
        paces = paces_;
      }
      // Planning and gathering run without the lock: the consumer keeps going.
      std::vector<int64_t> weights;
      if (paces && step >= 0) {
        weights = paces->wait_weights_for(step, [this] { return stopping_.load(); });
        if (stopping_) return;
      }
      BatchPlan plan = plan_batch(sampler_, at, opt_.batch_size, opt_.world, opt_.rank,
                                  opt_.drop_last, weights);
      Batch b = make_train_batch(*dataset_, norm_, plan.ids, plan.begin.epoch, opt_.augment);
      b.plan = std::move(plan);
      {
        std::lock_guard<std::mutex> lock(mu_);
        if (stop_) return;
        next_cursor_ = b.plan.end;
        if (next_step_ >= 0) next_step_ += 1;
        queue_.push_back(std::move(b));
      }
      cv_.notify_all();
    }
  } catch (...) {
    std::lock_guard<std::mutex> lock(mu_);
    error_ = std::current_exception();
    cv_.notify_all();
  }
}

Batch BatchLoader::next() {
  std::unique_lock<std::mutex> lock(mu_);
  cv_.wait(lock, [&] { return !queue_.empty() || error_; });
  if (queue_.empty() && error_) std::rethrow_exception(error_);
  Batch b = std::move(queue_.front());
  queue_.pop_front();
  lock.unlock();
  cv_.notify_all();
  return b;
}

}  // namespace limbo::data
