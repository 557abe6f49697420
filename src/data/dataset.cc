#include "data/dataset.h"

#include <cmath>

namespace limbo::data {

void Dataset::truncate(int64_t n) {
  if (n < 0 || n >= size()) return;
  labels.resize(n);
  images.resize(n * shape.pixels());
}

Normalization compute_normalization(const Dataset& d) {
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
