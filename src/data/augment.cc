#include "data/augment.h"

#include <cstring>

#include "common/error.h"
#include "data/mix.h"

namespace limbo::data {
namespace {

std::string trim(const std::string& s) {
  const auto a = s.find_first_not_of(" \t");
  if (a == std::string::npos) return "";
  return s.substr(a, s.find_last_not_of(" \t") - a + 1);
}

const char* kAllowed = "allowed: random_crop:P (P pixels of padding, 1..64), hflip";

}  // namespace

Augmenter::Augmenter(const std::string& spec, uint64_t seed) : seed_(seed) {
  size_t at = 0;
  while (at <= spec.size()) {
    const size_t comma = spec.find(',', at);
    const std::string item = trim(spec.substr(at, comma == std::string::npos ? std::string::npos : comma - at));
    at = comma == std::string::npos ? spec.size() + 1 : comma + 1;
    if (item.empty()) {
      if (spec.find_first_not_of(" \t,") == std::string::npos) break;  // "" = none
      throw InvalidInput("data.augment '" + spec + "' has an empty item; " + kAllowed);
    }
    for (const auto& op : ops_)
      if ((op.kind == AugmentOp::Kind::HFlip) == (item == "hflip"))
        throw InvalidInput("data.augment '" + spec + "' lists " + (item == "hflip" ? "hflip" : "random_crop") +
                           " twice");
    if (item == "hflip") {
      ops_.push_back({AugmentOp::Kind::HFlip, 0});
      continue;
    }
    if (item.rfind("random_crop:", 0) == 0) {
      const std::string p = item.substr(12);
      char* end = nullptr;
      const long v = std::strtol(p.c_str(), &end, 10);
      if (!p.empty() && *end == '\0' && v >= 1 && v <= 64) {
        ops_.push_back({AugmentOp::Kind::RandomCrop, v});
        continue;
      }
    }
    throw InvalidInput("data.augment: unknown or malformed item '" + item + "'; " + kAllowed);
  }
}

std::string Augmenter::describe() const {
  std::string s;
  for (const auto& op : ops_) {
    if (!s.empty()) s += ",";
    s += op.kind == AugmentOp::Kind::HFlip ? "hflip" : "random_crop:" + std::to_string(op.padding);
  }
  return s;
}

void Augmenter::check_sample_shape(const std::vector<int64_t>& shape) const {
  if (empty() || shape.size() == 3) return;
  std::string dims;
  for (int64_t d : shape) dims += (dims.empty() ? "" : ", ") + std::to_string(d);
  throw InvalidInput("data.augment '" + describe() + "' needs image samples [C, H, W]; the training samples are [" +
                     dims + "]");
}

AugmentDraw Augmenter::draw(int64_t epoch, int64_t id) const {
  AugmentDraw d;
  uint64_t state = splitmix(seed_ ^ splitmix(static_cast<uint64_t>(epoch) * 0x100000001b3ULL) ^
                            splitmix(static_cast<uint64_t>(id) + 0x632be59bd9b4e019ULL));
  for (const auto& op : ops_) {
    state = splitmix(state);
    if (op.kind == AugmentOp::Kind::RandomCrop) {
      const uint64_t span = static_cast<uint64_t>(2 * op.padding + 1);
      d.top = static_cast<int64_t>((state >> 32) % span);
      d.left = static_cast<int64_t>((state & 0xffffffffULL) % span);
    } else {
      d.flip = (state >> 63) != 0;
    }
  }
  return d;
}

void Augmenter::apply(torch::Tensor& x, const std::vector<int64_t>& ids, int64_t epoch,
                      const std::vector<float>& fill) const {
  if (empty()) return;
  if (x.dim() != 4 || x.scalar_type() != torch::kFloat32 || !x.is_contiguous())
    throw Error("internal: augmenting a batch that is not contiguous float [n, C, H, W]");
  const int64_t n = x.size(0), C = x.size(1), H = x.size(2), W = x.size(3);
  int64_t pad = 0;
  bool flip_first = false;  // hflip listed before random_crop: the crop reads the mirrored image
  for (const auto& op : ops_) {
    if (op.kind == AugmentOp::Kind::RandomCrop) pad = op.padding;
    else flip_first = pad == 0;
  }
  std::vector<float> tmp(static_cast<size_t>(C * H * W));
  float* base = x.data_ptr<float>();
  for (int64_t i = 0; i < n; ++i) {
    const AugmentDraw d = draw(epoch, ids[static_cast<size_t>(i)]);
    float* img = base + i * C * H * W;
    std::memcpy(tmp.data(), img, tmp.size() * sizeof(float));
    // Crop then flip: out[c][y][x] = padded[c][y + top][x' + left] with
    // x' = W-1-x when flipped; padded[c][v][u] = in[c][v - pad][u - pad]
    // inside, fill[c] outside. Flip then crop: the column is W-1-(x + dx).
    const int64_t dy = d.top - pad, dx = d.left - pad;
    for (int64_t c = 0; c < C; ++c) {
      const float f = fill.empty() ? 0.0f : fill[static_cast<size_t>(c)];
      const float* src = tmp.data() + c * H * W;
      float* dst = img + c * H * W;
      for (int64_t y = 0; y < H; ++y) {
        const int64_t sy = y + dy;
        float* row = dst + y * W;
        if (sy < 0 || sy >= H) {
          std::fill(row, row + W, f);
          continue;
        }
        const float* srow = src + sy * W;
        for (int64_t xo = 0; xo < W; ++xo) {
          const int64_t sx = !d.flip ? xo + dx : flip_first ? W - 1 - (xo + dx) : W - 1 - xo + dx;
          row[xo] = sx >= 0 && sx < W ? srow[sx] : f;
        }
      }
    }
  }
}

}  // namespace limbo::data
