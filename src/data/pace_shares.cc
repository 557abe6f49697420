#include "data/pace_shares.h"

#include <algorithm>
#include <chrono>
#include <cmath>

#include "common/error.h"

namespace limbo::data {

PaceShares::PaceShares(Options o) : o_(o) {
  if (o_.period < 1 || o_.lag < 1 || !(o_.alpha > 0 && o_.alpha <= 1) || !(o_.max_move > 0) ||
      !(o_.floor >= 0 && o_.floor < 1) || !(o_.memory >= 0))
    throw Error("internal: pace shares with period " + std::to_string(o_.period) + ", lag " +
                std::to_string(o_.lag));
  reset(1, 0);
}

std::vector<int64_t> PaceShares::equal() const {
  return std::vector<int64_t>(static_cast<size_t>(world_), kScale / world_ > 0 ? kScale / world_ : 1);
}

void PaceShares::reset(int world, int64_t formed_at) {
  if (world < 1) throw Error("internal: pace shares for a group of " + std::to_string(world));
  {
    std::lock_guard<std::mutex> lock(mu_);
    world_ = world;
    formed_at_ = formed_at;
    last_agreed_ = -1;
    entries_ = {{formed_at, equal()}};
    shares_.assign(static_cast<size_t>(world), 1.0 / world);
    last_paces_.clear();
    window_samples_ = 0;
    window_seconds_ = 0;
    recorded_ = false;
  }
  cv_.notify_all();
}

void PaceShares::record(int64_t samples, double seconds, double since_last) {
  if (samples <= 0 || !(seconds > 0) || !std::isfinite(seconds)) return;
  std::lock_guard<std::mutex> lock(mu_);
  const auto now = std::chrono::steady_clock::now();
  if (since_last < 0) since_last = recorded_ ? std::chrono::duration<double>(now - last_record_).count() : seconds;
  last_record_ = now;
  recorded_ = true;
  const double fade = o_.memory > 0 ? std::exp(-std::max(since_last, seconds) / o_.memory) : 1.0;
  window_samples_ = window_samples_ * fade + static_cast<double>(samples);
  window_seconds_ = window_seconds_ * fade + seconds;
}

bool PaceShares::publishes(int64_t step) const {
  std::lock_guard<std::mutex> lock(mu_);
  return world_ > 1 && step > formed_at_ && (step - formed_at_) % o_.period == 0;
}

std::vector<float> PaceShares::publication(int rank) {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<float> v(static_cast<size_t>(world_), 0.0f);
  if (rank < 0 || rank >= world_) throw Error("internal: rank " + std::to_string(rank) + " publishing a pace");
  if (window_seconds_ > 0) v[static_cast<size_t>(rank)] = static_cast<float>(window_samples_ / window_seconds_);
  if (o_.memory <= 0) {  // the next publication measures only the steps after this one
    window_samples_ = 0;
    window_seconds_ = 0;
  }
  return v;
}

void PaceShares::agreed(int64_t step, const std::vector<float>& paces) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (static_cast<int>(paces.size()) != world_)
      throw Error("internal: " + std::to_string(paces.size()) + " paces for a group of " + std::to_string(world_));
    last_agreed_ = step;
    last_paces_.assign(paces.begin(), paces.end());
    double sum = 0;
    bool all = true;
    for (float p : paces) {
      all = all && std::isfinite(p) && p > 0;
      sum += p;
    }
    if (all && sum > 0) {
      const double lowest = o_.floor / world_;
      double total = 0;
      for (size_t i = 0; i < shares_.size(); ++i) {
        const double target = paces[i] / sum;
        const double move = std::clamp(o_.alpha * (target - shares_[i]), -o_.max_move, o_.max_move);
        shares_[i] = std::max(shares_[i] + move, lowest);
        total += shares_[i];
      }
      for (double& s : shares_) s /= total;
    }
    std::vector<int64_t> w(shares_.size());
    for (size_t i = 0; i < w.size(); ++i)
      w[i] = std::max<int64_t>(1, std::llround(shares_[i] * static_cast<double>(kScale)));
    // Weights that held before this step are asked for no more.
    while (entries_.size() > 1 && entries_[1].from <= step) entries_.erase(entries_.begin());
    entries_.push_back({step + o_.lag, std::move(w)});
  }
  cv_.notify_all();
}

std::optional<std::vector<int64_t>> PaceShares::weights_locked(int64_t step) const {
  const int64_t last_due = step - o_.lag;  // the last publication that can act on `step`
  if (last_due >= formed_at_ + o_.period) {
    const int64_t p = formed_at_ + (last_due - formed_at_) / o_.period * o_.period;
    if (p > last_agreed_) return std::nullopt;
  }
  const Entry* in_force = &entries_.front();
  for (const auto& e : entries_)
    if (e.from <= step) in_force = &e;
  return in_force->weights;
}

std::optional<std::vector<int64_t>> PaceShares::weights_for(int64_t step) const {
  std::lock_guard<std::mutex> lock(mu_);
  return weights_locked(step);
}

std::vector<int64_t> PaceShares::wait_weights_for(int64_t step, const std::function<bool()>& stop) const {
  std::unique_lock<std::mutex> lock(mu_);
  for (;;) {
    if (auto w = weights_locked(step)) return *w;
    if (stop && stop()) return {};
    cv_.wait_for(lock, std::chrono::milliseconds(50));
  }
}

std::vector<double> PaceShares::last_paces() const {
  std::lock_guard<std::mutex> lock(mu_);
  return last_paces_;
}

std::vector<double> PaceShares::shares_at(int64_t step) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto w = weights_locked(step);
  const auto& weights = w ? *w : entries_.back().weights;
  double total = 0;
  for (int64_t x : weights) total += static_cast<double>(x);
  std::vector<double> out;
  for (int64_t x : weights) out.push_back(static_cast<double>(x) / total);
  return out;
}

int PaceShares::world() const {
  std::lock_guard<std::mutex> lock(mu_);
  return world_;
}

}  // namespace limbo::data
