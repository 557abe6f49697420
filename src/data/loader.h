// Background batch preparation.
//
// A BatchLoader owns one producer thread that plans batches with a Sampler,
// gathers the uint8 images of the planned ids, normalises them into float
// tensors and augments them (data.augment), keeping up to `prefetch`
// batches ready. next() blocks only when the
// queue is empty, and rethrows any error raised on the producer thread.
// restart() discards prepared batches and continues from a new cursor / world
// (used after a resume or a membership change). All methods are called from
// one consumer thread.
#pragma once

#include <torch/torch.h>

#include <atomic>
#include <condition_variable>
#include <deque>
#include <exception>
#include <memory>
#include <mutex>
#include <thread>

#include "data/augment.h"
#include "data/dataset.h"
#include "data/pace_shares.h"
#include "data/sampler.h"

namespace limbo::data {

struct Batch {
  torch::Tensor x;  // float [n, C, H, W] (tensor datasets: [n, ...]), normalised
  torch::Tensor y;  // int64 [n] labels (tensor datasets: int64 or float [n, ...])
  BatchPlan plan;
};

struct LoaderOptions {
  int64_t batch_size = 64;  // per worker
  int world = 1;
  int rank = 0;
  bool drop_last = false;
  int prefetch = 4;
  Order order = Order::Shuffle;
  uint64_t seed = 1;
  Augmenter augment;  // data.augment (empty: none)
};

// Gathers and normalises the given samples (used by the loader and eval).
// Token streams: the windows of epoch 0 (validation windows never move).
Batch make_batch(const Dataset& d, const Normalization& norm, const std::vector<int64_t>& ids);
// A training batch: make_batch, then the augmentation of each sample, drawn
// from (its seed, epoch, sample id); token streams: the windows of `epoch`. Every training loop builds its batches
// here (the loader, parameter-server learners, the simulators).
Batch make_train_batch(const Dataset& d, const Normalization& norm, const std::vector<int64_t>& ids,
                       int64_t epoch, const Augmenter& augment);

class BatchLoader {
 public:
  BatchLoader(std::shared_ptr<const Dataset> dataset, Normalization norm, LoaderOptions opt,
              Cursor start);
  ~BatchLoader();
  BatchLoader(const BatchLoader&) = delete;
  BatchLoader& operator=(const BatchLoader&) = delete;

  Batch next();
  // From `from` in a group of `world`; `step`: the steps committed before
  // `from` (>= 0: with shares by pace, each batch is cut with the shares of
  // its step, waiting for them to be agreed; -1: equal shares).
  void restart(Cursor from, int world, int rank, int64_t step = -1);
  // Shares by pace (elastic.shares = "pace"); none: equal slices.
  void set_paces(std::shared_ptr<const PaceShares> paces);
  const LoaderOptions& options() const { return opt_; }

 private:
  void run();
  void stop_thread();
  void start_thread(Cursor from);

  std::shared_ptr<const Dataset> dataset_;
  Normalization norm_;
  LoaderOptions opt_;
  Sampler sampler_;

  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Batch> queue_;
  std::exception_ptr error_;
  bool stop_ = false;
  std::atomic<bool> stopping_{false};  // stop_, read without the lock while waiting for shares
  Cursor next_cursor_;
  int64_t next_step_ = -1;
  std::shared_ptr<const PaceShares> paces_;
  std::thread thread_;
};

}  // namespace limbo::data
