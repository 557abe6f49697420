#include "data/synthetic.h"

#include <algorithm>
#include <random>

#include "common/error.h"

namespace limbo::data {
namespace {

Dataset fill(const std::vector<std::vector<uint8_t>>& protos, const SyntheticOptions& o,
             int64_t n, uint64_t stream, const char* name) {
  std::mt19937_64 rng(o.seed * 0x9E3779B97F4A7C15ull + stream);
  Dataset d;
  d.name = name;
  d.shape = o.shape;
  d.num_classes = o.num_classes;
  d.images.resize(n * o.shape.pixels());
  d.labels.resize(n);
  for (int64_t i = 0; i < n; ++i) {
    uint8_t label = static_cast<uint8_t>(rng() % o.num_classes);
    d.labels[i] = label;
    uint8_t* img = d.images.data() + i * o.shape.pixels();
    for (int64_t p = 0; p < o.shape.pixels(); ++p) {
      int noise = static_cast<int>(rng() % (2 * o.noise + 1)) - o.noise;
      img[p] = static_cast<uint8_t>(std::clamp(protos[label][p] + noise, 0, 255));
    }
  }
  return d;
}

}  // namespace

DatasetSplits make_synthetic(const SyntheticOptions& o) {
  if (o.num_classes < 2 || o.num_classes > 256 || o.shape.pixels() <= 0 || o.train_size <= 0 ||
      o.test_size <= 0)
    throw InvalidInput("synthetic dataset: need 2..256 classes, a positive shape and sizes");
  std::mt19937_64 rng(o.seed);
  std::vector<std::vector<uint8_t>> protos(o.num_classes, std::vector<uint8_t>(o.shape.pixels()));
  for (auto& p : protos)
    for (auto& v : p) v = static_cast<uint8_t>(rng() % 256);
  DatasetSplits s;
  s.train = fill(protos, o, o.train_size, 1, "synthetic/train");
  s.test = fill(protos, o, o.test_size, 2, "synthetic/test");
  return s;
}

}  // namespace limbo::data
