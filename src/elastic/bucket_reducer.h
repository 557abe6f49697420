// The gradient all-reduce in buckets, overlapped with backward.
//
// The flat gradient buffer ([gradient | float buffers | loss | flag], see
// optim::FlatParams) is cut into buckets: contiguous ranges that end on
// parameter boundaries, taken from the end of the buffer towards its start,
// because backward produces the last layers' gradients first. Bucket 0 is
// the one backward finishes first; a bucket closes once it holds at least
// elastic.bucket_mb (a larger parameter makes a bucket of its own; 0 = one
// bucket for everything). A parameter frozen when the buckets are planned
// (the Python front end keeps them in the flat buffers) starts a new bucket
// where it follows a trainable one, and the other way round.
//
// With overlap, a post-hook on every parameter's gradient accumulator counts
// the parameters of its bucket; when the last one has its gradient, the
// training thread (inside backward) scales the bucket by this member's share
// of the global batch (and rounds it to 16 bits with comm.compression), and
// the communication thread all-reduces it while backward goes on. Buckets
// are reduced strictly in index order on every member, so the sequence of
// collectives is the same everywhere whatever order backward happens to
// finish them in. A parameter that backward never reaches (an unused
// branch) holds its bucket, and those after it, until backward ends.
//
// With a single bucket (a small model, or bucket_mb = 0) there is nothing to
// overlap and the sequential path runs.
//
// Without overlap the same buckets are scaled and reduced one after another
// on the training thread after backward. Both paths run the same operations
// on the same bytes, so for one bucket layout the results are bitwise equal.
//
// The buffers, the loss and the flag (the tail) are written only after
// backward, which may read the buffers (a frozen BatchNorm, a mask): they
// travel in a small float32 all-reduce of their own after the last bucket,
// or, when the whole gradient is one float32 bucket reduced after backward
// anyway, inside it. Float buffers are scaled by the member's share (a
// weighted mean); integer buffers' pieces are sent by member 0 only (the
// others send zeros), so every member ends with member 0's (FlatParams).
//
// A collective that fails (a peer gone, the group aborted) fails the step:
// finish() throws it after the communication thread has stopped touching
// the buffer, no later bucket is started, and no error-feedback residual
// moves; the caller re-forms the group and redoes the step. The float32
// buffers were scaled and partly summed in place, and forward had already
// moved every buffer: the caller restores them from a copy taken before
// forward (the trainer does; see FlatParams::save_buffers()). A sum that is
// not finite (finite()) moves no residual either.
//
// With finish_in_backward (the Python front end), the reduction is complete
// when backward returns, as DDP's is: the first hook of an armed step queues
// finish() as a callback of the autograd engine, which runs it at the end of
// that backward pass, on the thread that called backward. A failure there
// is kept and thrown by take_finished() (the step did not commit). So
// whatever the user does to `.grad` between backward and the step (clipping
// by hand, masking, reading the norm) sees the group's gradient, the same on
// every member, and never races the communication thread. Hooks then also
// keep each parameter's `.grad` the flat buffer's view (a user's
// zero_grad(set_to_none=True) made autograd put it elsewhere: it is copied
// in; a parameter that got none contributes zeros), and notice a backward
// that adds to the gradient after it was reduced (a second loss.backward()
// in one step), which take_finished() refuses. Under no_sync (the user's
// micro-batches by hand) the hooks do nothing: gradients accumulate locally
// until a backward outside it.
//
// Buckets frozen on every member (FlatParams' include_frozen: the Python
// front end keeps frozen parameters in the flat buffers so that a loop may
// unfreeze them): each step's tail also counts, per parameter, the members
// that train it (FlatParams::trainable_counts). A bucket whose parameters
// every member had frozen at the group's previous step stays off the wire
// (a frozen backbone costs what it costs DDP); the decision comes from sums
// every member holds, so all skip alike. A layer unfrozen at step s is in
// such a bucket at s: its gradient of that step is dropped (zeros, `.grad`
// None) on every member, and it is reduced from step s + 1. The first step
// of a new group reduces every bucket. Not with compression or a single
// bucket (the tail rides in it).
//
// Threads: one communication thread per member, which does nothing but the
// collectives (the network and gloo's summing loop; no torch operations, so
// it never starts an intra-op thread pool of its own).
#pragma once

#include <torch/torch.h>

#include <atomic>
#include <condition_variable>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <thread>
#include <vector>

#include "comm/collective.h"
#include "comm/compression.h"
#include "elastic/serial_queue.h"
#include "optim/flat_params.h"

namespace limbo::elastic {

struct Bucket {
  int64_t begin = 0, end = 0;  // range of grad_with_slot
  std::vector<int> params;     // indices into FlatParams::entries()
};

// Buckets over `flat` (bucket 0 first in backward order). With
// tail_in_first, bucket 0 extends to the end of grad_with_slot (buffers and
// slots ride with it); otherwise buckets cover the gradient only.
// With `unit_starts` (flat parameter indices), a bucket never holds both a
// parameter that starts a unit and the one before it.
std::vector<Bucket> plan_buckets(const optim::FlatParams& flat, int64_t bucket_bytes,
                                 bool tail_in_first, const std::vector<int>& unit_starts = {});

struct ReducerStats {
  int64_t steps = 0;
  // Buckets whose all-reduce started before backward ended, over all steps:
  // 0 means nothing overlapped.
  int64_t buckets_started_in_backward = 0;
  int64_t buckets = 0;
  // Seconds the training thread waited in finish() for communication after
  // backward (the exposed communication), over all steps.
  double exposed_seconds = 0;
};

class BucketReducer {
 public:
  // With `sharded`, gradient buckets are reduce-scattered among the shards
  // set by set_shards() (the tail still all-reduced, in an operation of its
  // own), and finite() looks at the loss only: each member checks its own
  // shard of the gradient (elastic/allreduce_update.h).
  BucketReducer(optim::FlatParams& flat, int64_t bucket_bytes, bool overlap,
                comm::Compression compression, bool sharded = false, const std::vector<int>& unit_starts = {});
  // Fully sharded (optim.shard_weights): each gradient bucket is handed to
  // `queue` as soon as backward completes it (scaled on the training thread
  // inside backward; the units' gathers go through the same queue, so every
  // member's collectives come in the one order of its backward, the same
  // everywhere), and once reduced `reduced(begin, end)` is called with its
  // range. finish() waits for the queue and throws its failure.
  // `failed(begin, end)`: a bucket whose reduction failed, or that comes
  // after a failure of this step (its gradient goes nowhere: the step
  // fails at its end), so that its pages can be given back at once.
  void set_reduce_in_hook(std::function<void(int64_t, int64_t)> reduced, SerialQueue* queue,
                          std::function<void(int64_t, int64_t)> failed = {});
  // The shards of the flat gradient (elastic/shards.h) of the next steps'
  // group: between steps, on the training thread.
  void set_shards(const std::vector<int64_t>& bounds);
  ~BucketReducer();
  BucketReducer(const BucketReducer&) = delete;
  BucketReducer& operator=(const BucketReducer&) = delete;

  // Between forward and backward: arms the hooks (with overlap) for a step
  // whose member weight is `share` and whose batch loss is `loss`.
  // `flag` (may be null: 0) is read when the reduction finishes.
  void begin(std::shared_ptr<comm::Collective> group, double share, double loss,
             std::function<double()> flag = nullptr);
  bool armed() const { return armed_; }
  // The step's loss, when it became known after begin() (before finish).
  void set_loss(double loss) { loss_ = loss; }
  // See finish_in_backward above; set before the first step.
  void set_finish_in_backward(bool on);
  void set_no_sync(bool on) { no_sync_ = on; }
  // Whether the armed step's reduction already finished at the end of a
  // backward (finish_in_backward). take_finished() then ends that step:
  // rethrows its failure, or refuses a gradient changed by a later backward.
  bool finished() const { return finished_; }
  // Called at the end of every finish() that summed (on its thread).
  void set_after_finish(std::function<void()> f) { after_finish_ = std::move(f); }
  void take_finished();
  // After backward: writes the tail (buffers scaled by the share, the loss
  // times the share, `flag`), reduces what is left, waits for everything,
  // and leaves grad_with_slot holding the sums. Throws the first failure
  // (the step failed; residuals unchanged). The module's buffers get the
  // reduced values (FlatParams::flat_to_buffers).
  void finish(double flag);
  // When finish() was entered for the step begun last (the end of this
  // member's backward: what comes after is the wait for the others); none
  // before it.
  std::optional<std::chrono::steady_clock::time_point> finish_started() const { return finish_started_; }
  // Whether the last finish() summed to finite values everywhere (the
  // gradient and the loss). When not, no residual moved and the caller
  // skips the update, as every member does.
  bool finite() const { return finite_; }

  const std::vector<Bucket>& buckets() const { return buckets_; }
  // The bytes of this member's gradient buckets the last finish() handed to
  // the collectives, as they went (codes and scales, or 16 or 32 bits a
  // value; the tail of buffers and scalars not counted).
  int64_t last_payload_bytes() const { return payload_bytes_; }
  bool overlapped() const { return overlap_; }
  const ReducerStats& stats() const { return stats_; }
  // Testing aid: in its Nth step (counting begin() calls from 1) this
  // process SIGKILLs itself as the communication thread starts bucket 1.
  void set_testing_death(int64_t step) { die_at_step_ = step; }

 private:
  void install_hooks();  // a post-hook on every trainable parameter's gradient accumulator
  void on_parameter_ready(int param);
  // pending_ from the parameters that require a gradient now (the Python
  // front end: a loop may freeze or unfreeze one between steps).
  void count_pending();
  // Which buckets this step leaves off the wire (from the last step's
  // counts in this group), and what a skipped bucket's parameters got.
  void plan_skips();
  void drop_skipped();
  void take_counts(std::weak_ptr<comm::Collective> group);
  void finish_from_backward();
  void prepare(size_t bucket);  // scale (and encode) on the training thread
  void mark_ready(size_t op);
  size_t op_of(size_t bucket) const;
  void run(size_t op);          // one collective; either thread
  void comm_loop();
  void run_in_hook(size_t bucket);
  std::function<void(int64_t, int64_t)> reduced_in_hook_, failed_in_hook_;
  SerialQueue* queue_ = nullptr;
  std::vector<char> done_;  // per bucket: reduced in a hook this step
  std::exception_ptr hook_error_;

  optim::FlatParams& flat_;
  std::vector<Bucket> buckets_;
  std::atomic<int64_t> payload_bytes_{0};  // since begin() (see last_payload_bytes)
  std::vector<int> bucket_of_;  // parameter -> bucket
  std::vector<int> expected_;   // parameters with a gradient accumulator, per bucket
  std::vector<char> hooked_;    // per parameter: its accumulator has this reducer's hook
  bool counting_ = false;               // trainable counts ride in the tail (see above)
  std::vector<char> frozen_everywhere_;  // per parameter, at the last step's sums
  std::weak_ptr<comm::Collective> counted_group_;  // the group those sums came from
  std::vector<char> skip_;                // per bucket, this step
  bool overlap_;
  comm::Compression compression_;
  std::vector<std::unique_ptr<comm::Compressor>> compressors_;  // per bucket
  std::vector<torch::Tensor> wire_;                              // per bucket, 16-bit (or int8 / int4 codes)
  std::vector<torch::Tensor> gathered_;  // per bucket, int8 / int4: every member's codes, by rank
  std::vector<torch::Tensor> views_;  // per op: the buckets, then the tail when separate
  bool sharded_ = false;
  std::vector<std::vector<int64_t>> shard_bounds_;  // per bucket: the shards within it
  // Gradient accumulators with this reducer's hook (held: they keep it).
  std::vector<std::pair<std::shared_ptr<torch::autograd::Node>, uintptr_t>> hooks_;

  // Per step (training thread).
  std::shared_ptr<comm::Collective> group_;
  double share_ = 1.0;
  bool armed_ = false;
  bool threaded_ = false;  // this step's collectives run on the communication thread
  bool tail_separate_ = true;
  double loss_ = 0;
  bool finite_ = true;
  std::function<double()> flag_;
  std::function<void()> after_finish_;
  bool finish_in_backward_ = false, no_sync_ = false, finished_ = false, callback_queued_ = false;
  std::optional<std::chrono::steady_clock::time_point> finish_started_;
  bool grad_after_finish_ = false;
  std::exception_ptr deferred_;  // a failure of finish() in a callback
  std::vector<int> pending_;
  std::vector<char> prepared_;
  int64_t begun_ = 0, die_at_step_ = 0;

  // Shared with the communication thread.
  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<char> ready_;  // per op
  size_t next_ = 0, ops_ = 0;
  bool step_threaded_ = false, in_backward_ = false, busy_ = false, stop_ = false;
  std::exception_ptr error_;
  int64_t started_in_backward_ = 0;
  std::thread thread_;

  ReducerStats stats_;
};

}  // namespace limbo::elastic
