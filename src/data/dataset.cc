#include "data/dataset.h"

#include <cmath>

namespace limbo::data {

void Dataset::truncate(int64_t n) {
  if (n < 0 || n >= size()) return;
  if (tensors || stream) {
    tensor_rows = n;
    return;
  }
  labels.resize(n);
  images.resize(n * shape.pixels());
}

namespace {

Normalization tensor_normalization(const Dataset& d) {
  const MappedTensor& x = d.tensors->x;
  const int64_t channels = x.shape.size() >= 2 ? x.shape[1] : 1;
  const int64_t inner = channels > 0 ? x.row_numel() / channels : 0;
  const double scale = x.dtype == DType::U8 ? 1.0 / 255.0 : 1.0;
  std::vector<double> sum(channels, 0.0), sq(channels, 0.0);
  std::vector<float> row(x.row_numel());
  for (int64_t i = 0; i < d.size(); ++i) {
    to_float(x.dtype, x.row(i), x.row_numel(), row.data());
    for (int64_t c = 0; c < channels; ++c) {
      const float* p = row.data() + c * inner;
      for (int64_t k = 0; k < inner; ++k) {
        double v = p[k] * scale;
        sum[c] += v;
        sq[c] += v * v;
      }
    }
  }
  Normalization norm;
  const double n = static_cast<double>(inner) * std::max<int64_t>(d.size(), 1);
  for (int64_t c = 0; c < channels; ++c) {
    double mean = sum[c] / n;
    double var = std::max(sq[c] / n - mean * mean, 1e-12);
    norm.mean.push_back(static_cast<float>(mean));
    norm.std.push_back(static_cast<float>(std::sqrt(var)));
  }
  return norm;
}

}  // namespace

Normalization compute_normalization(const Dataset& d) {
  if (d.tensors) return tensor_normalization(d);
  Normalization norm;
  const int64_t plane = d.shape.height * d.shape.width;
  for (int64_t c = 0; c < d.shape.channels; ++c) {
    double sum = 0, sq = 0;
    for (int64_t i = 0; i < d.size(); ++i) {
      const uint8_t* p = d.image(i) + c * plane;
      for (int64_t k = 0; k < plane; ++k) {
        double v = p[k] / 255.0;
        sum += v;
        sq += v * v;
      }
    }
    double n = static_cast<double>(plane) * std::max<int64_t>(d.size(), 1);
    double mean = sum / n;
    double var = std::max(sq / n - mean * mean, 1e-12);
    norm.mean.push_back(static_cast<float>(mean));
    norm.std.push_back(static_cast<float>(std::sqrt(var)));
  }
  return norm;
}

}  // namespace limbo::data
