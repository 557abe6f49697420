#include "ps/model_layout.h"

#include "common/error.h"
#include "ps/protocol.h"

namespace limbo::ps {

std::vector<Range> partition(int64_t total, int shards) {
  if (shards < 1) throw InvalidInput("the number of shards must be >= 1");
  if (total < shards)
    throw InvalidInput(std::to_string(shards) + " shards for " + std::to_string(total) + " parameters: too many shards");
  std::vector<Range> r;
  for (int k = 0; k < shards; ++k) {
    int64_t a = total * k / shards, b = total * (k + 1) / shards;
    r.push_back({a, b - a});
  }
  return r;
}

ModelFingerprint model_fingerprint(const std::string& model_name, const optim::FlatParams& params) {
  ModelFingerprint fp;
  fp.description = model_name + ":";
  std::string canon = "limbo-ps-v" + std::to_string(kProtocolVersion);
  // The description goes into the hello's meta and a refusal names two of
  // them: past kDescribed characters the rest of the parameters are counted.
  constexpr size_t kDescribed = 2000;
  size_t untold = 0;
  for (const auto& e : params.entries()) {
    std::string shape;
    for (size_t i = 0; i < e.shape.size(); ++i) shape += (i ? "," : "") + std::to_string(e.shape[i]);
    const std::string one = e.name + "[" + shape + "]";
    if (untold == 0 && fp.description.size() + one.size() < kDescribed) fp.description += " " + one;
    else untold += 1;
    canon += ";" + one + ":float32";  // FlatParams holds float32 only
  }
  if (untold) fp.description += " ... and " + std::to_string(untold) + " more parameters";
  fp.hash = fnv1a(canon);
  return fp;
}

}  // namespace limbo::ps
