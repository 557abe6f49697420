// Shares of the global batch by pace (elastic.shares = "pace"): each
// member's slice of a synchronous step's global batch follows its measured
// rate, so that members of unequal speed end their backward at about the
// same time and no one waits for the slowest. The global batch, and so the
// batch policy, the learning rate and the cursor, do not depend on shares;
// the reduction weights each member by its samples, so the gradient is the
// exact mean over the global batch whatever the shares.
//
// Agreement. A member's pace is the samples a second of its own forward and
// backward (data waits and the group's reduction left out), smoothed over
// time: the samples and seconds measured so far fade by exp(-t / memory) as
// t seconds of wall-clock time pass, so the pace is a ratio of two moving
// sums that weights the last `memory` seconds most. Wall-clock time, not a
// number of steps: what makes a pace noisy (a cpu quota's period, 100 ms by
// default; the scheduler's time slices) comes in seconds, and a member under
// a quota that waits for the others uses less than it, so a pace measured
// over less than a few quota periods swings with the share itself. Not the
// member's own compute time either: a member with a small share computes
// briefly each step, and its memory would span many more steps than the
// others'. Steps longer than the memory each stand alone. Every `period`
// steps after the group formed (a
// publication step p; every step by default), the paces travel to every
// member in one small all-reduce of `world` floats right after the
// gradient's, each member writing its own place (publication() before it,
// agreed() after it, before the step's update). From the agreed paces and the
// shares the last publication made, every member computes the same new
// shares, as integer weights; they hold from step p + lag on, so a loader
// that plans up to lag - 1 batches ahead plans only with shares already
// agreed. A new group (a member lost, one joining) starts from equal shares.
//
// Bounds. target = paces / sum of paces; each share moves alpha of the way
// to its target, at most max_move (a fraction of the whole batch) a
// publication, and never below floor x the equal share (a member whose pace
// falls towards zero is a hang, for heartbeats to find). A publication in
// which a member has measured nothing (pace 0) leaves the shares as they
// were.
//
// Following. A change of pace moves the smoothed paces most of the way
// within `memory` seconds and the shares with them (max_move bounds a
// publication's move); the shares hold lag steps after their publication.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <optional>
#include <vector>

namespace limbo::data {

class PaceShares {
 public:
  struct Options {
    int64_t period = 1;  // steps between publications
    int64_t lag = 16;    // steps from a publication to the shares it makes
    double alpha = 1.0;
    double max_move = 0.1;
    double floor = 0.1;
    // The pace's memory: what was measured t seconds ago weighs
    // exp(-t / memory) (0: each publication sums the steps since the last
    // one, and only those).
    double memory = 0.25;
  };
  // The weights of a member add up to about this in all.
  static constexpr int64_t kScale = int64_t{1} << 16;

  explicit PaceShares(Options o);

  // A group of `world` members formed with `formed_at` steps committed:
  // equal shares, nothing measured.
  void reset(int world, int64_t formed_at);
  // This member computed `samples` in `seconds` of forward and backward.
  // `since_last`: the wall-clock seconds since its last record (negative:
  // measured here, on the steady clock).
  void record(int64_t samples, double seconds, double since_last = -1);
  // Whether step `step` (the steps committed before it) publishes paces.
  bool publishes(int64_t step) const;
  // What this member adds to the publication's all-reduce: `world` floats,
  // its pace at `rank`, zeros elsewhere. Starts the next measuring window.
  std::vector<float> publication(int rank);
  // The members' summed publication of step `step`.
  void agreed(int64_t step, const std::vector<float>& paces);

  // The weights of step `step`'s slices; none while a publication they
  // depend on is not agreed yet.
  std::optional<std::vector<int64_t>> weights_for(int64_t step) const;
  // As weights_for(), waiting until they are known or `stop()` (polled
  // every 50 ms) says to give up (then empty: equal shares).
  std::vector<int64_t> wait_weights_for(int64_t step, const std::function<bool()>& stop) const;

  // For records: the last agreed paces (empty before the first) and the
  // shares (fractions of the batch) in force at `step`.
  std::vector<double> last_paces() const;
  std::vector<double> shares_at(int64_t step) const;
  int world() const;
  const Options& options() const { return o_; }

 private:
  struct Entry {
    int64_t from;  // the first step these weights hold for
    std::vector<int64_t> weights;
  };
  std::optional<std::vector<int64_t>> weights_locked(int64_t step) const;
  std::vector<int64_t> equal() const;

  Options o_;
  mutable std::mutex mu_;
  mutable std::condition_variable cv_;
  int world_ = 1;
  int64_t formed_at_ = 0;
  int64_t last_agreed_ = -1;  // the last publication step agreed
  std::vector<Entry> entries_;
  std::vector<double> shares_;  // as the last publication left them (fractions)
  std::vector<double> last_paces_;
  double window_samples_ = 0;
  double window_seconds_ = 0;
  std::chrono::steady_clock::time_point last_record_{};
  bool recorded_ = false;
};

}  // namespace limbo::data
