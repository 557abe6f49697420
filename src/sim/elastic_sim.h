// Virtual-cluster simulation of elastic synchronous training (`limbo sim`
// with sim.mode = "elastic").
//
// R(t) virtual workers follow a schedule of (epoch, workers). Every step cuts
// the next global batch of R * b samples from the global cursor exactly as
// the real elastic trainer does, computes each worker's mean gradient on its
// slice, and averages them weighted by slice size - what the all-reduce
// computes. The learning rate follows the same BatchSizePolicy (none, linear,
// Dynamic SGD) and momentum handling as `limbo launch` elastic jobs, over the
// same schedule and SGD. One process, no sockets: 16x or 128x workers cost
// only their gradient computations.
//
// With elastic.sync = "diloco" the virtual members run DiLoCo's outer
// steps instead (each member's inner steps alone, with an inner optimizer
// of its own, then the weighted pseudo-gradients and the outer optimizer),
// over the same schedule.
#pragma once

#include <nlohmann/json.hpp>

#include <string>
#include <utility>
#include <vector>

#include "train/trainer.h"

namespace limbo::sim {

struct ElasticSimOptions {
  std::vector<std::pair<double, int>> schedule;  // (epoch, workers), ascending; first at epoch 0
  std::string run_dir;                           // empty = no files
  int64_t log_every = 20;                        // steps per metrics line
};

nlohmann::json run_elastic_sim(train::Trainer& trainer, const train::TrainerConfig& cfg,
                               const ElasticSimOptions& opt);

}  // namespace limbo::sim
