// Staleness histograms (tau -> gradients) and the statistics reported from
// them: shards, the launcher's merged summary and the simulator use these.
#pragma once

#include <nlohmann/json.hpp>

#include <cstdint>
#include <map>

namespace limbo::ps {

using StalenessHist = std::map<int64_t, int64_t>;

struct StalenessStats {
  int64_t count = 0;
  double mean = 0;
  int64_t p99 = 0;  // smallest tau with at least 99% of gradients at or below it
  int64_t max = 0;
};
StalenessStats staleness_stats(const StalenessHist& h);

nlohmann::json hist_to_json(const StalenessHist& h);  // {"tau": count, ...}
void add_hist_json(StalenessHist& into, const nlohmann::json& j);

}  // namespace limbo::ps
