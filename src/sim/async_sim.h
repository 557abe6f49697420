// Virtual-cluster simulation of asynchronous training (`limbo sim`).
//
// λ virtual learners run the real learner loop in virtual time: pull →
// compute → push, with a per-learner compute time drawn from a distribution
// and a one-way network delay. An event queue (ordered by virtual time, ties
// by creation order) decides who pulls and who pushes when. The server side is
// the real thing: the same Aggregator (hardsync / n-softsync, staleness
// policies, bound), ShardState (update math, momentum) and LeaseBook (data
// assignment) that `limbo ps-server` uses, on one shard.
//
// A pull hands the learner a snapshot of the published weights (shared, not
// copied: published versions are immutable). When its push arrives, the
// gradient is computed for real on that snapshot and offered to the
// aggregator, so every gradient is exactly as stale as the event order says.
// Snapshots alive at once are bounded by λ + 1 versions; the peak is reported.
//
// Deterministic for a seed (and a fixed thread count).
#pragma once

#include <nlohmann/json.hpp>

#include <string>

#include "ps/aggregator.h"
#include "ps/shard_state.h"
#include "train/trainer.h"

namespace limbo::sim {

enum class ComputeKind { Constant, Normal, LongTail, Mixed };
ComputeKind parse_compute_kind(const std::string& s);

struct ComputeModel {
  ComputeKind kind = ComputeKind::Constant;
  double mean = 0.1;                 // seconds per mini-batch
  double cv = 0.2;                   // normal: std / mean; long-tail: lognormal sigma
  double straggler_fraction = 0.25;  // mixed: share of learners that are slow
  double straggler_factor = 4.0;     // mixed: how much slower they are
};

struct AsyncSimOptions {
  int learners = 4;
  ps::AggregatorOptions agg;
  ps::UpdateOptions update;
  ComputeModel compute;
  double net_delay = 0.001;  // one-way, seconds
  // Cores the learners share (0 = one each). With fewer cores than learners,
  // a learner whose weights arrived waits for a free core (first come, first
  // served) and then computes without interruption, as processes with steps
  // shorter than the OS time slice do on a small machine.
  int cores = 0;
  uint64_t seed = 1;
  int64_t log_every = 100;   // updates per metrics line
  std::string run_dir;       // empty = no files
};

// Runs the simulation with the trainer's model and data (epochs, batch and
// order from `cfg`); returns the summary (also written to run_dir).
nlohmann::json run_async_sim(train::Trainer& trainer, const train::TrainerConfig& cfg, const AsyncSimOptions& opt);

}  // namespace limbo::sim
