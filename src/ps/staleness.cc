#include "ps/staleness.h"

#include <algorithm>
#include <string>

namespace limbo::ps {

StalenessStats staleness_stats(const StalenessHist& h) {
  StalenessStats s;
  int64_t sum = 0;
  for (const auto& [t, c] : h) {
    s.count += c;
    sum += t * c;
    s.max = std::max(s.max, t);
  }
  if (s.count == 0) return s;
  s.mean = static_cast<double>(sum) / s.count;
  int64_t seen = 0;
  for (const auto& [t, c] : h) {
    seen += c;
    if (seen * 100 >= s.count * 99) {
      s.p99 = t;
      break;
    }
  }
  return s;
}

nlohmann::json hist_to_json(const StalenessHist& h) {
  nlohmann::json j = nlohmann::json::object();
  for (const auto& [t, c] : h) j[std::to_string(t)] = c;
  return j;
}

void add_hist_json(StalenessHist& into, const nlohmann::json& j) {
  for (const auto& [t, c] : j.items()) into[std::stoll(t)] += c.get<int64_t>();
}

}  // namespace limbo::ps
