#include "ps/buffer_mean.h"

#include <algorithm>
#include <cstring>

#include "common/base64.h"
#include "common/error.h"

namespace limbo::ps {

std::string floats_to_base64(const float* v, size_t n) {
  return base64_encode(std::string(reinterpret_cast<const char*>(v), n * sizeof(float)));
}

void check_buffers_fit(int64_t buffer_floats) {
  if (buffer_floats > static_cast<int64_t>(kMaxBufferFloats))
    throw InvalidInput("the model has " + std::to_string(buffer_floats) +
                       " floats of buffers; the parameter server carries at most " + std::to_string(kMaxBufferFloats));
}

bool base64_to_floats(const std::string& text, std::vector<float>& out) {
  const std::string bytes = base64_decode(text);
  if (bytes.size() % sizeof(float) != 0) return false;
  out.resize(bytes.size() / sizeof(float));
  if (!bytes.empty()) std::memcpy(out.data(), bytes.data(), bytes.size());
  return true;
}

bool BufferMean::add(const float* v, size_t n, int64_t averaged) {
  if (averaged < 0 || averaged > static_cast<int64_t>(n)) return false;
  if (!empty() && (n != value_->size() || averaged != averaged_)) return false;
  if (count_ > 0 && (n != sum_.size() + first_.size() || averaged != averaged_)) return false;
  if (count_ == 0) {
    averaged_ = averaged;
    sum_.assign(v, v + averaged);
    first_.assign(v + averaged, v + n);
  } else {
    for (int64_t i = 0; i < averaged; ++i) sum_[i] += v[i];
  }
  count_ += 1;
  return true;
}

void BufferMean::commit() {
  if (count_ == 0) return;
  auto next = std::make_shared<std::vector<float>>(sum_.size() + first_.size());
  for (size_t i = 0; i < sum_.size(); ++i) (*next)[i] = sum_[i] / static_cast<float>(count_);
  std::copy(first_.begin(), first_.end(), next->begin() + static_cast<long>(sum_.size()));
  value_ = std::move(next);
  count_ = 0;
}

const std::vector<float>& BufferMean::value() const {
  static const std::vector<float> none;
  return value_ ? *value_ : none;
}

Frame BufferMean::frame() const { return empty() ? Frame() : float_frame(value_); }

void BufferMean::write(nlohmann::json& meta) const {
  if (empty()) return;
  meta["buffers"] = floats_to_base64(value_->data(), value_->size());
  meta["averaged"] = averaged_;
}

void BufferMean::restore(const nlohmann::json& meta) {
  auto b = meta.find("buffers");
  if (b == meta.end() || !b->is_string()) return;
  auto v = std::make_shared<std::vector<float>>();
  if (!base64_to_floats(b->get<std::string>(), *v)) return;
  value_ = std::move(v);
  averaged_ = meta.value("averaged", static_cast<int64_t>(value_->size()));
  count_ = 0;
}

}  // namespace limbo::ps
