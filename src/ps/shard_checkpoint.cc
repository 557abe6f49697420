#include "ps/shard_checkpoint.h"

#include <cstring>

#include "common/error.h"
#include "common/files.h"

namespace limbo::ps {
namespace {
constexpr char kShardCheckpointMagic[8] = {'L', 'B', 'P', 'S', 'C', 'K', 'P', 'T'};
}

void write_shard_checkpoint(const std::string& path, nlohmann::json meta, const float* weights,
                            const optim::Optimizer& opt, int64_t numel) {
  const auto names = opt.has_state() ? opt.state_names() : std::vector<std::string>();
  meta["optimizer"] = {{"algorithm", opt.algorithm()}, {"state", names}, {"steps", opt.steps()}};
  const std::string m = meta.dump();
  const size_t n = static_cast<size_t>(numel) * 4;
  std::string bytes(kShardCheckpointMagic, 8);
  const uint64_t len = m.size();
  bytes.append(reinterpret_cast<const char*>(&len), 8);
  bytes += m;
  bytes.append(reinterpret_cast<const char*>(weights), n);
  for (size_t i = 0; i < names.size(); ++i)
    bytes.append(reinterpret_cast<const char*>(opt.state()[i].data_ptr<float>()), n);
  write_file_atomic(path, bytes);
}

ShardCheckpoint read_shard_checkpoint(const std::string& path, int64_t numel) {
  const std::string bytes = read_file(path);
  auto bad = [&](const std::string& why) { return InvalidInput("shard checkpoint '" + path + "': " + why); };
  if (bytes.size() < 16 || std::memcmp(bytes.data(), kShardCheckpointMagic, 8) != 0) throw bad("not a Limbo shard checkpoint");
  uint64_t len;
  std::memcpy(&len, bytes.data() + 8, 8);
  if (len > bytes.size() - 16) throw bad("truncated");
  ShardCheckpoint c;
  c.meta = nlohmann::json::parse(bytes.substr(16, len), nullptr, /*allow_exceptions=*/false);
  if (!c.meta.is_object() || !(c.meta.contains("optimizer") || c.meta.contains("momentum")))
    throw bad("unreadable metadata");
  try {
    if (c.meta.contains("optimizer")) {
      c.state_names = c.meta["optimizer"]["state"].get<std::vector<std::string>>();
      c.steps = c.meta["optimizer"]["steps"].get<int64_t>();
    } else if (c.meta["momentum"].get<bool>()) {  // an earlier version's file
      c.state_names = {"momentum_buffer"};
    }
  } catch (const nlohmann::json::exception&) {
    throw bad("unreadable optimizer metadata");
  }
  const size_t n = static_cast<size_t>(numel) * 4;
  const size_t need = 16 + len + n * (1 + c.state_names.size());
  if (bytes.size() != need) throw bad("size " + std::to_string(bytes.size()) + ", expected " + std::to_string(need));
  const char* p = bytes.data() + 16 + len;
  c.weights.resize(static_cast<size_t>(numel));
  std::memcpy(c.weights.data(), p, n);
  for (size_t i = 0; i < c.state_names.size(); ++i) {
    c.state.emplace_back(static_cast<size_t>(numel));
    std::memcpy(c.state.back().data(), p + n * (i + 1), n);
  }
  return c;
}

nlohmann::json leases_to_json(const LeaseBook::Snapshot& s) {
  nlohmann::json q = nlohmann::json::array();
  for (const auto& l : s.queued) q.push_back({l.epoch, l.position, l.count});
  return {{"epoch", s.cursor.epoch}, {"position", s.cursor.position}, {"completed", s.completed_samples},
          {"next_id", s.next_id}, {"queued", q}};
}

LeaseBook::Snapshot leases_from_json(const nlohmann::json& l) {
  LeaseBook::Snapshot s;
  s.cursor = {l["epoch"].get<int64_t>(), l["position"].get<int64_t>()};
  s.completed_samples = l["completed"];
  s.next_id = l["next_id"];
  for (const auto& q : l["queued"]) {
    Lease x;
    x.epoch = q[0];
    x.position = q[1];
    x.count = q[2];
    s.queued.push_back(x);
  }
  return s;
}

}  // namespace limbo::ps
