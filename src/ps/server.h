// One parameter-server shard (`limbo ps-server`).
//
// The shard owns a contiguous slice [offset, offset + numel) of the flat
// parameter vector (see partition() in model_layout.h), its own clock, the aggregation state
// (Aggregator), optional server-side momentum / weight decay, and, on shard
// 0, the data leases (LeaseBook). It serves learners over one ROUTER socket
// on one thread: decode, validate, aggregate, update, reply. Anything
// malformed is rejected and counted, never applied.
//
// Files in `dir`: endpoint (the bound address, written once listening),
// checkpoint.bin (atomic, every checkpoint_every updates and at exit),
// metrics.jsonl (a line per log_every updates with the staleness histogram
// of that window), summary.json (at each checkpoint and at exit).
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "optim/optimizer.h"
#include "ps/aggregator.h"
#include "ps/leases.h"
#include "ps/model_layout.h"
#include "ps/transport.h"

namespace limbo::ps {

struct ServerOptions {
  int shard = 0, shards = 1;
  std::string bind = "tcp://127.0.0.1:*";
  std::string dir;  // shard directory (required)
  AggregatorOptions agg;
  optim::OptimizerOptions optimizer;       // makes the update from the aggregated gradient
  bool decay_at_base_rate = false;         // see UpdateOptions
  std::chrono::milliseconds heartbeat_timeout{10000};  // without a message before a learner is dropped
  int64_t checkpoint_every = 500;         // updates; 0 = only at exit
  int64_t log_every = 100;                // updates per metrics line
  bool resume = false;                    // start from dir/checkpoint.bin when present
  uint64_t max_payload_bytes = 1ull << 30;
  int64_t part_floats = 1 << 18;          // weights replies go out in parts of this many floats (0 = whole)
  // Shard 0 only: data leases.
  int64_t dataset_size = 0, batch = 64, epochs = 1;
};

class Server {
 public:
  // `initial` is the whole flat parameter vector (every shard starts from the
  // same seeded initialisation and keeps its slice).
  Server(ServerOptions opt, ModelFingerprint fp, const float* initial, int64_t total, CurveKeys keys);
  ~Server();
  Server(const Server&) = delete;
  Server& operator=(const Server&) = delete;
  // Serves until `stop` becomes true; writes the final checkpoint and summary.
  void run(const std::atomic<bool>& stop);
  std::string endpoint() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace limbo::ps
