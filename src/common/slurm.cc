#include "common/slurm.h"

#include <cstdlib>

#include "common/error.h"

namespace limbo {

namespace {

int64_t to_number(const std::string& s, const std::string& list) {
  if (s.empty() || s.find_first_not_of("0123456789") != std::string::npos || s.size() > 9)
    throw InvalidInput("Slurm host list '" + list + "': '" + s + "' is not a number");
  return std::stoll(s);
}

// "01-03,7" -> {"01","02","03","7"}: each range keeps the width of its
// first bound ("08-10" gives "08","09","10").
std::vector<std::string> expand_ranges(const std::string& ranges, const std::string& list, size_t limit) {
  std::vector<std::string> out;
  size_t start = 0;
  while (start <= ranges.size()) {
    size_t comma = ranges.find(',', start);
    if (comma == std::string::npos) comma = ranges.size();
    const std::string part = ranges.substr(start, comma - start);
    const size_t dash = part.find('-');
    const std::string lo_s = part.substr(0, dash);
    const std::string hi_s = dash == std::string::npos ? lo_s : part.substr(dash + 1);
    const int64_t lo = to_number(lo_s, list), hi = to_number(hi_s, list);
    if (hi < lo) throw InvalidInput("Slurm host list '" + list + "': range '" + part + "' runs backwards");
    if (static_cast<size_t>(hi - lo) + out.size() >= limit)
      throw InvalidInput("Slurm host list '" + list + "' names more than " + std::to_string(limit) + " hosts");
    for (int64_t v = lo; v <= hi; ++v) {
      std::string n = std::to_string(v);
      if (n.size() < lo_s.size()) n.insert(0, lo_s.size() - n.size(), '0');
      out.push_back(n);
    }
    start = comma + 1;
  }
  return out;
}

// One name of the list (no top-level comma): its bracketed parts expand to
// every combination, in order.
void expand_name(const std::string& name, const std::string& list, size_t limit, std::vector<std::string>* out) {
  std::vector<std::string> acc{""};
  size_t i = 0;
  while (i < name.size()) {
    if (name[i] == '[') {
      const size_t close = name.find(']', i);
      if (close == std::string::npos) throw InvalidInput("Slurm host list '" + list + "': '[' without ']'");
      const auto values = expand_ranges(name.substr(i + 1, close - i - 1), list, limit);
      if (acc.size() * values.size() + out->size() > limit)
        throw InvalidInput("Slurm host list '" + list + "' names more than " + std::to_string(limit) + " hosts");
      std::vector<std::string> next;
      for (const auto& a : acc)
        for (const auto& v : values) next.push_back(a + v);
      acc = std::move(next);
      i = close + 1;
    } else if (name[i] == ']') {
      throw InvalidInput("Slurm host list '" + list + "': ']' without '['");
    } else {
      for (auto& a : acc) a += name[i];
      ++i;
    }
  }
  if (acc.size() == 1 && acc[0].empty()) throw InvalidInput("Slurm host list '" + list + "' has an empty name");
  out->insert(out->end(), acc.begin(), acc.end());
}

int env_int(const std::function<const char*(const char*)>& get, const char* name, int fallback) {
  const char* v = get(name);
  if (!v || !*v) return fallback;
  // SLURM_CPUS_ON_NODE may read "4", SLURM_JOB_CPUS_PER_NODE "4(x2)"; the
  // leading number is the one for this node.
  char* end = nullptr;
  const long n = std::strtol(v, &end, 10);
  if (end == v || n < 0 || n > 1000000)
    throw InvalidInput(std::string("Slurm's ") + name + "='" + v + "' is not a count");
  return static_cast<int>(n);
}

}  // namespace

std::vector<std::string> expand_slurm_hostlist(const std::string& list, size_t limit) {
  std::vector<std::string> out;
  int depth = 0;
  size_t start = 0;
  for (size_t i = 0; i <= list.size(); ++i) {
    if (i < list.size() && list[i] == '[') ++depth;
    if (i < list.size() && list[i] == ']') --depth;
    if (depth < 0) throw InvalidInput("Slurm host list '" + list + "': ']' without '['");
    if (i == list.size() || (list[i] == ',' && depth == 0)) {
      expand_name(list.substr(start, i - start), list, limit, &out);
      start = i + 1;
    }
  }
  if (depth != 0) throw InvalidInput("Slurm host list '" + list + "': '[' without ']'");
  return out;
}

int SlurmJob::workers_per_node() const {
  if (cpus_per_task > 0) return cpus_per_task;
  if (cpus_on_node > 0) return cpus_on_node;
  return 1;
}

int SlurmJob::rendezvous_port() const {
  int64_t id = 0;
  for (char c : job_id)
    if (c >= '0' && c <= '9') id = (id * 10 + (c - '0')) % 1000;
  return 29400 + static_cast<int>(id);
}

std::optional<SlurmJob> slurm_job(const std::function<const char*(const char*)>& getenv_fn) {
  const auto get = getenv_fn ? getenv_fn : [](const char* n) -> const char* { return std::getenv(n); };
  const char* id = get("SLURM_JOB_ID");
  if (!id || !*id) return std::nullopt;
  SlurmJob j;
  j.job_id = id;
  const char* nodes = get("SLURM_JOB_NODELIST");
  if (!nodes || !*nodes) nodes = get("SLURM_NODELIST");
  if (!nodes || !*nodes) throw InvalidInput("Slurm job " + j.job_id + ": SLURM_JOB_NODELIST is not set");
  j.nodes = expand_slurm_hostlist(nodes);
  j.cpus_per_task = env_int(get, "SLURM_CPUS_PER_TASK", 0);
  j.cpus_on_node = env_int(get, "SLURM_CPUS_ON_NODE", 0);
  j.restart_count = env_int(get, "SLURM_RESTART_COUNT", 0);
  j.node_id = env_int(get, "SLURM_NODEID", -1);
  if (const char* ip = get("SLURM_LAUNCH_NODE_IPADDR")) j.launch_node_ip = ip;
  return j;
}

}  // namespace limbo
