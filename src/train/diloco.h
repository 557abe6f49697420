// DiLoCo (elastic.sync = "diloco"): each member trains alone for H inner
// steps from the last global weights, then the members average their
// pseudo-gradients (global - local, weighted by the samples each processed)
// and an outer optimizer (SGD with Nesterov momentum) updates the global
// weights. The outer step is the unit that commits: the committed state
// (TrainState) counts outer steps, and the data cursor moves only when an
// outer step commits.
//
// How samples are dealt (docs/diloco.md): an outer step takes up to
// H x b x W samples of the epoch's order (b: data.batch_size, W: the
// members when it began): first the samples owed from earlier outer steps
// (TrainState::owed), then fresh ones from the cursor; member p of the plan
// takes a contiguous share (shares differ by at most one sample) and cuts
// it into inner batches of b. When the outer step commits, each member
// reports how many samples of its share it processed; what a member did not
// process (it was lost, or stopped early) is owed and dealt again first in
// the next outer step, so the committed model sees every sample of an epoch
// exactly once.
#pragma once

#include <algorithm>
#include <cstdint>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "data/sampler.h"

namespace limbo::train {

struct DilocoOptions {
  int64_t inner_steps = 500;    // H
  double outer_lr = 0.7;
  double outer_momentum = 0.9;
  bool nesterov = true;
  // The bounded wait: a member stops its inner steps once it has spent
  // (1 + max_wait) times what the fastest member took for a whole share in
  // the previous outer step; the rest of its share is owed (dealt again).
  // 0: no bound (every member processes its whole share).
  double max_wait = 1.0;
  // elastic.shares = "pace": each member's share of an outer step follows
  // its pace in the previous one (pace_shares()), so that members of
  // unequal speed end their inner steps together; false: equal shares.
  bool pace = false;
  // comm.compression, for the records' payload bytes.
  std::string wire = "none";
  // Streaming DiLoCo: the model's parameters in F contiguous fragments (cut
  // on parameter boundaries); every H / F inner steps one fragment is
  // synchronised, in turn, so each fragment still syncs every H inner steps
  // and a sync moves 1 / F of the model. 1: plain DiLoCo.
  int64_t fragments = 1;
  // The mixing factor alpha: after a fragment's sync the member's local
  // fragment becomes alpha x local + (1 - alpha) x global (0: the global
  // fragment, as plain DiLoCo takes the global weights).
  double mixing = 0.0;
  // Inner steps each sync overlaps: the fragment's all-reduce runs while
  // the next unit's first overlap_steps inner steps run, and is mixed in
  // after them (0: the members wait for it).
  int64_t overlap_steps = 0;
  // Inner steps between two syncs (H with one fragment).
  int64_t unit_steps() const { return inner_steps / std::max<int64_t>(fragments, 1); }
};

// Refuses streaming settings that cannot run (InvalidInput naming each
// setting as `key` spells it: "diloco.fragments" in the CLI, "fragments"
// in the Python module): inner steps not a multiple of the fragments, an
// overlap not below the inner steps between two syncs, a mixing factor
// outside [0, 1].
void check_streaming(const DilocoOptions& d, const std::function<std::string(const std::string&)>& key);

// Positions [lo, hi) of an epoch's order.
using PositionRanges = std::vector<std::pair<int64_t, int64_t>>;

struct OuterPlan {
  int64_t epoch = 0;
  int world = 1;
  std::vector<int64_t> positions;  // the outer step's samples, as positions of the epoch's order, in deal order
  std::vector<int64_t> offsets;    // world + 1 entries: member p deals positions[offsets[p], offsets[p + 1])
  int64_t fresh_end = 0;           // the cursor's position after the fresh samples dealt
  PositionRanges owed_left;        // owed samples left for a later outer step
  int64_t share(int p) const { return offsets[p + 1] - offsets[p]; }
};

// The samples of the outer step after committed `cursor` with `owed`
// (positions of epoch cursor.epoch), for `world` members of `per_member`
// samples each (H x b), in an epoch of n samples. A cursor at the epoch's
// end with nothing owed starts the next epoch. `weights` (`world` of them,
// or empty: equal shares) cut the step's samples in proportion: member p
// deals about total x weights[p] / (their sum); the step's samples do not
// depend on them.
OuterPlan plan_outer(data::Cursor cursor, const PositionRanges& owed, int64_t n, int64_t per_member, int world,
                     const std::vector<int64_t>& weights = {});

// Shares by pace (DilocoOptions::pace): from the shares (fractions) an
// outer step was planned with (empty: equal) and each member's seconds a
// sample in it, the next step's shares: each moves half the way to its
// pace's share of the group's pace (1 / seconds a sample, normalised), at
// most `max_move` of the whole a step, and not below `floor` x the equal
// share. Every member computes them from the same agreed figures, so they
// are identical everywhere.
std::vector<double> pace_shares(const std::vector<double>& shares, const std::vector<double>& seconds_a_sample,
                                double max_move = 0.25, double floor = 0.1);
// Integer weights of shares for plan_outer (they add up to about 2^16).
std::vector<int64_t> share_weights(const std::vector<double>& shares);

struct OuterSettled {
  data::Cursor cursor;
  PositionRanges owed;
  std::vector<int64_t> committed;  // positions processed, in plan order
  bool last_in_epoch = false;      // the epoch is complete (the cursor moved to the next one)
};

// After the outer step of `plan` committed with `consumed[p]` samples of
// member p's share processed (the first ones; fewer than its share, or 0
// for a member lost, leaves the rest owed).
OuterSettled settle_outer(const OuterPlan& plan, const std::vector<int64_t>& consumed, int64_t n);

// Sorted, with touching ranges merged.
PositionRanges normalize_ranges(PositionRanges r);
int64_t range_total(const PositionRanges& r);

// Bytes of n pseudo-gradient values as comm.compression `wire` encodes them
// (int8 and int4 with their float32 scale per 256 values).
int64_t payload_bytes_of(int64_t n, const std::string& wire);

}  // namespace limbo::train
