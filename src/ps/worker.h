// One asynchronous learner (`limbo worker`).
//
// Loop: pull the weights from every shard (requests to all shards are in
// flight at once; shard 0 also hands out the next data batch as a lease),
// compute the mean gradient of the batch, push each shard its slice with the
// clock it was pulled at, and pull again. Pushes and the next pull are sent
// together, so a step costs one round trip per shard. Payloads are sent from
// the flat gradient buffer without copying.
//
// The learner registers with every shard (handshake: protocol version, model
// fingerprint and a per-process incarnation id), sends heartbeats from a
// thread of its own (so long steps are not taken for a crash), re-registers and
// re-sends when a restarted shard no longer knows it, and gives up with
// PeerFailure after `request_timeout` seconds without any answer from a
// shard. On SIGTERM (stop flag) it finishes the current step and leaves.
//
// When shard 0 reports the data exhausted, the learner leaves; the first one
// told so (the finisher) then waits for the final weights (no learner left
// registered), evaluates them on the test split and writes final.json and
// checkpoint.pt into the run directory.
#pragma once

#include <nlohmann/json.hpp>

#include <atomic>
#include <chrono>
#include <string>
#include <vector>

#include "ps/model_layout.h"
#include "ps/transport.h"
#include "train/trainer.h"

namespace limbo::ps {

struct WorkerOptions {
  std::vector<std::string> servers;  // shard endpoints in shard order, e.g. tcp://10.0.0.1:5555
  uint32_t learner_id = 0;
  std::chrono::milliseconds request_timeout{60000};   // without any answer from a shard before giving up
  std::chrono::milliseconds heartbeat_interval{500};  // between heartbeats (own thread)
  int64_t log_every = 50;           // steps per metrics line
  std::string run_dir;              // learners/<id>.jsonl; the finisher's final.json, checkpoint.pt
  int64_t max_steps = 0;            // leave after this many steps (0 = until the data is done)
  // Trains nothing: takes the final weights as the finisher does and writes
  // final.json and checkpoint.pt (the launcher runs one when the finisher
  // died before writing them).
  bool finish_only = false;
  int64_t part_floats = 1 << 18;    // pushes go out in parts of this many floats (0 = whole slices)
  // Values on the wire (protocol flags kFp16Values / kBf16Values, 0 = float32):
  // gradients pushed (comm.compression, with an error-feedback residual) and
  // weights pulled during training (ps.pull_compression; the final weights
  // always come in float32).
  uint8_t push_encoding = 0, pull_encoding = 0;
};

// Trains as one learner until the data is done, `stop` is set or max_steps;
// returns this learner's summary.
nlohmann::json run_worker(train::Trainer& trainer, const train::TrainerConfig& cfg, const WorkerOptions& opt,
                          const CurveKeys& keys, const std::atomic<bool>& stop);

}  // namespace limbo::ps
