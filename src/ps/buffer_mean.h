// The model's buffers on the parameter server (BatchNorm running statistics,
// its batch count, a user's float64 or integer state): shard 0 holds them.
//
// A learner sends its buffers with every gradient it pushes to shard 0 (the
// float32 region of optim::FlatParams, base64 in the push's JSON metadata:
// {"buffers": ..., "averaged": K}). Its forward moved them from the values
// it last pulled. When shard 0 makes an update, the buffers become the mean
// of those its accepted gradients brought: the first K floats averaged, the
// rest (exact integer pieces) taken from the first of them, the rule
// data-parallel training follows. Pull replies from shard 0 carry them back
// ({"buffers": ...}), and shard checkpoints keep them. Gradients dropped as
// too stale or rejected bring no buffers.
#pragma once

#include <nlohmann/json.hpp>

#include <cstdint>
#include <string>
#include <vector>

#include "ps/protocol.h"

namespace limbo::ps {

class BufferMean {
 public:
  // The buffers sent with an accepted gradient (the push's metadata; no
  // "buffers" key: nothing). Returns false, taking nothing, for metadata
  // that does not fit (another size than earlier pushes, bad base64).
  bool add(const nlohmann::json& meta);
  // An update was made: the mean of what its gradients brought becomes the
  // buffers (no gradient with buffers: they stay).
  void commit();
  bool empty() const { return value_.empty(); }
  const std::vector<float>& value() const { return value_; }
  // For pull replies and checkpoints: {"buffers": base64, "averaged": K}.
  void write(nlohmann::json& meta) const;
  void restore(const nlohmann::json& meta);  // from a checkpoint's metadata

 private:
  std::vector<float> value_, sum_, first_;
  int64_t averaged_ = 0, count_ = 0;
};

// The most floats of buffers a model may have under the parameter server:
// their base64 (4 characters per 3 bytes), with room for the lease and the
// key names, stays within a meta frame (kMaxMetaBytes).
constexpr size_t kMaxBufferFloats = (kMaxMetaBytes - 4096) / 4 * 3 / sizeof(float);
// Throws InvalidInput, naming both numbers, for a model with more.
void check_buffers_fit(int64_t buffer_floats);

// Float32 values <-> base64 text of their bytes.
std::string floats_to_base64(const float* v, size_t n);
bool base64_to_floats(const std::string& text, std::vector<float>& out);

}  // namespace limbo::ps
