#include "train/safetensors.h"

#include <nlohmann/json.hpp>

#include <cstring>

#include "common/error.h"
#include "common/files.h"

namespace limbo::train {
namespace {

const char* dtype_name(torch::ScalarType t) {
  switch (t) {
    case torch::kFloat32: return "F32";
    case torch::kFloat64: return "F64";
    case torch::kFloat16: return "F16";
    case torch::kBFloat16: return "BF16";
    case torch::kInt64: return "I64";
    case torch::kInt32: return "I32";
    case torch::kInt16: return "I16";
    case torch::kInt8: return "I8";
    case torch::kUInt8: return "U8";
    case torch::kBool: return "BOOL";
    default: throw Error("safetensors: unsupported dtype " + std::string(c10::toString(t)));
  }
}

}  // namespace

NamedTensors state_dict(torch::nn::Module& m) {
  NamedTensors out;
  for (const auto& p : m.named_parameters(true)) out.emplace_back(p.key(), p.value());
  for (const auto& b : m.named_buffers(true)) out.emplace_back(b.key(), b.value());
  return out;
}

void write_safetensors(const std::string& path, const NamedTensors& tensors,
                       const std::map<std::string, std::string>& metadata) {
  nlohmann::ordered_json header;
  if (!metadata.empty()) header["__metadata__"] = metadata;
  int64_t offset = 0;
  std::vector<torch::Tensor> bodies;
  for (const auto& [name, t] : tensors) {
    auto c = t.detach().contiguous().cpu();
    int64_t bytes = c.numel() * static_cast<int64_t>(c.element_size());
    header[name] = {{"dtype", dtype_name(c.scalar_type())},
                    {"shape", c.sizes().vec()},
                    {"data_offsets", {offset, offset + bytes}}};
    offset += bytes;
    bodies.push_back(c);
  }
  std::string h = header.dump();
  h.append((8 - h.size() % 8) % 8, ' ');
  std::string out(8, '\0');
  uint64_t len = h.size();
  for (int i = 0; i < 8; ++i) out[i] = static_cast<char>((len >> (8 * i)) & 0xff);  // LE
  out += h;
  out.reserve(out.size() + offset);
  for (const auto& c : bodies)
    out.append(static_cast<const char*>(c.data_ptr()), c.numel() * c.element_size());
  write_file_atomic(path, out);
}

}  // namespace limbo::train
