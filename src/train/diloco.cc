#include "train/diloco.h"

#include <algorithm>
#include <cmath>
#include <string>

#include "common/error.h"

namespace limbo::train {

PositionRanges normalize_ranges(PositionRanges r) {
  std::sort(r.begin(), r.end());
  PositionRanges out;
  for (const auto& [a, b] : r) {
    if (b <= a) continue;
    if (!out.empty() && a <= out.back().second) out.back().second = std::max(out.back().second, b);
    else out.push_back({a, b});
  }
  return out;
}

int64_t payload_bytes_of(int64_t n, const std::string& wire) {
  const int64_t scales = 4 * ((n + 255) / 256);
  if (wire == "int8") return n + scales;
  if (wire == "int4") return (n + 1) / 2 + scales;
  if (wire == "fp16" || wire == "bf16") return 2 * n;
  return 4 * n;
}

int64_t range_total(const PositionRanges& r) {
  int64_t t = 0;
  for (const auto& [a, b] : r) t += b - a;
  return t;
}

OuterPlan plan_outer(data::Cursor cursor, const PositionRanges& owed, int64_t n, int64_t per_member, int world,
                     const std::vector<int64_t>& weights) {
  if (per_member <= 0 || world <= 0 || n <= 0)
    throw Error("internal: plan_outer(per_member " + std::to_string(per_member) + ", world " +
                std::to_string(world) + ", n " + std::to_string(n) + ")");
  OuterPlan p;
  p.world = world;
  if (cursor.position >= n && owed.empty()) cursor = {cursor.epoch + 1, 0};
  p.epoch = cursor.epoch;
  const int64_t want = per_member * world;
  for (const auto& [a, b] : owed) {
    const int64_t room = want - static_cast<int64_t>(p.positions.size());
    const int64_t take = std::min(room, b - a);
    for (int64_t i = a; i < a + take; ++i) p.positions.push_back(i);
    if (a + take < b) p.owed_left.push_back({a + take, b});
  }
  const int64_t fresh = std::min(want - static_cast<int64_t>(p.positions.size()), std::max<int64_t>(n - cursor.position, 0));
  for (int64_t i = 0; i < fresh; ++i) p.positions.push_back(cursor.position + i);
  p.fresh_end = cursor.position + fresh;
  const int64_t total = static_cast<int64_t>(p.positions.size());
  p.offsets.assign(static_cast<size_t>(world) + 1, 0);
  if (!weights.empty()) {
    if (static_cast<int>(weights.size()) != world)
      throw Error("internal: plan_outer with " + std::to_string(weights.size()) + " weights for " +
                  std::to_string(world) + " members");
    __int128 sum = 0;
    for (auto w : weights) {
      if (w < 0) throw Error("internal: plan_outer with a negative weight");
      sum += w;
    }
    if (sum > 0) {
      __int128 upto = 0;
      for (int r = 0; r < world; ++r) {
        p.offsets[r] = static_cast<int64_t>(static_cast<__int128>(total) * upto / sum);
        upto += weights[static_cast<size_t>(r)];
      }
      p.offsets[world] = total;
      return p;
    }
  }
  // As data::plan_batch slices a global batch (the later ranks take the
  // extra samples), so that H = 1 deals as elastic.sync = "step" does.
  for (int r = 0; r <= world; ++r) p.offsets[r] = total * r / world;
  return p;
}

std::vector<double> pace_shares(const std::vector<double>& shares, const std::vector<double>& seconds_a_sample,
                                double max_move, double floor) {
  const size_t W = seconds_a_sample.size();
  std::vector<double> old = shares.size() == W ? shares : std::vector<double>(W, 1.0 / static_cast<double>(W));
  double total = 0;
  for (double s : seconds_a_sample) {
    if (!(s > 0) || !std::isfinite(s)) return old;  // a member measured nothing: as they were
    total += 1.0 / s;
  }
  std::vector<double> out(W);
  double sum = 0;
  for (size_t m = 0; m < W; ++m) {
    const double target = (1.0 / seconds_a_sample[m]) / total;
    const double move = std::clamp(0.5 * (target - old[m]), -max_move, max_move);
    out[m] = std::max(old[m] + move, floor / static_cast<double>(W));
    sum += out[m];
  }
  for (double& s : out) s /= sum;
  return out;
}

std::vector<int64_t> share_weights(const std::vector<double>& shares) {
  std::vector<int64_t> w;
  for (double s : shares) w.push_back(std::max<int64_t>(1, std::llround(s * 65536.0)));
  return w;
}

OuterSettled settle_outer(const OuterPlan& plan, const std::vector<int64_t>& consumed, int64_t n) {
  if (static_cast<int>(consumed.size()) != plan.world)
    throw Error("internal: settle_outer with " + std::to_string(consumed.size()) + " counts for a plan of " +
                std::to_string(plan.world));
  OuterSettled s;
  PositionRanges owed = plan.owed_left;
  for (int p = 0; p < plan.world; ++p) {
    const int64_t lo = plan.offsets[p], hi = plan.offsets[p + 1];
    const int64_t done = std::clamp<int64_t>(consumed[p], 0, hi - lo);
    for (int64_t i = lo; i < lo + done; ++i) s.committed.push_back(plan.positions[i]);
    for (int64_t i = lo + done; i < hi; ++i) owed.push_back({plan.positions[i], plan.positions[i] + 1});
  }
  s.owed = normalize_ranges(std::move(owed));
  s.cursor = {plan.epoch, plan.fresh_end};
  if (plan.fresh_end >= n && s.owed.empty()) {
    s.cursor = {plan.epoch + 1, 0};
    s.last_in_epoch = true;
  }
  return s;
}

void check_streaming(const DilocoOptions& d, const std::function<std::string(const std::string&)>& key) {
  if (d.fragments < 1 || d.inner_steps % d.fragments != 0)
    throw InvalidInput(key("inner_steps") + " (" + std::to_string(d.inner_steps) + ") must be a multiple of " +
                       key("fragments") + " (" + std::to_string(d.fragments) +
                       "): one fragment syncs every inner_steps / fragments inner steps");
  if (d.overlap_steps < 0 || (d.overlap_steps > 0 && d.overlap_steps >= d.unit_steps()))
    throw InvalidInput(key("overlap_steps") + " (" + std::to_string(d.overlap_steps) + ") must be below the " +
                       std::to_string(d.unit_steps()) + " inner steps between two syncs (inner_steps / fragments)");
  if (d.mixing < 0 || d.mixing > 1) throw InvalidInput(key("mixing") + " must be in [0, 1]");
}

}  // namespace limbo::train
