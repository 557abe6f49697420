// The model's buffers on the parameter server (BatchNorm running statistics,
// its batch count, a user's float64 or integer state): shard 0 holds them.
//
// A learner sends its buffers with every gradient it pushes to shard 0 (the
// float32 region of optim::FlatParams, as float32 in a frame of their own,
// flag kBuffers, with {"averaged": K} in the push's metadata). Its forward
// moved them from the values it last pulled. When shard 0 makes an update, the buffers become the mean
// of those its accepted gradients brought: the first K floats averaged, the
// rest (exact integer pieces) taken from the first of them, the rule
// data-parallel training follows. Pull replies from shard 0 carry them back
// the same way, and shard checkpoints keep them (base64 in their JSON). Gradients dropped as
// too stale or rejected bring no buffers.
#pragma once

#include <nlohmann/json.hpp>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "ps/protocol.h"

namespace limbo::ps {

class BufferMean {
 public:
  // The n buffers sent with an accepted gradient, the first `averaged` of
  // them averaged. Returns false, taking nothing, for buffers that do not fit
  // (another size or split than earlier pushes).
  bool add(const float* v, size_t n, int64_t averaged);
  // An update was made: the mean of what its gradients brought becomes the
  // buffers (no gradient with buffers: they stay).
  void commit();
  bool empty() const { return !value_ || value_->empty(); }
  const std::vector<float>& value() const;
  int64_t averaged() const { return averaged_; }
  // The buffers as they are now, for a reply frame: a commit makes new ones,
  // so ZeroMQ may go on sending these without a copy.
  Frame frame() const;
  // For checkpoints: {"buffers": base64, "averaged": K}.
  void write(nlohmann::json& meta) const;
  void restore(const nlohmann::json& meta);  // from a checkpoint's metadata

 private:
  std::shared_ptr<std::vector<float>> value_;
  std::vector<float> sum_, first_;
  int64_t averaged_ = 0, count_ = 0;
};

// Throws InvalidInput, naming both numbers, for a model with more buffers
// than the parameter server carries (kMaxBufferFloats).
void check_buffers_fit(int64_t buffer_floats);

// Float32 values <-> base64 text of their bytes.
std::string floats_to_base64(const float* v, size_t n);
bool base64_to_floats(const std::string& text, std::vector<float>& out);

}  // namespace limbo::ps
