#include "elastic/bucket_reducer.h"

#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/utils/lambda_post_hook.h>
#include <torch/csrc/autograd/variable.h>

#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <cmath>

#include "common/error.h"
#include "common/process.h"
#include "common/timing.h"

namespace limbo::elastic {

std::vector<Bucket> plan_buckets(const optim::FlatParams& flat, int64_t bucket_bytes,
                                 bool tail_in_first, const std::vector<int>& unit_starts) {
  std::vector<char> starts(flat.entries().size(), 0);
  for (int i : unit_starts)
    if (i >= 0 && static_cast<size_t>(i) < starts.size()) starts[static_cast<size_t>(i)] = 1;
  const auto& entries = flat.entries();
  const int64_t grad_n = flat.numel();
  std::vector<Bucket> out;
  Bucket cur;
  cur.end = grad_n;
  const auto& params = flat.parameters();
  for (int i = static_cast<int>(entries.size()) - 1; i >= 0; --i) {
    // A frozen parameter (FlatParams' include_frozen) never shares a bucket
    // with a trainable one: a frozen backbone's buckets can stay off the
    // wire (BucketReducer's counts).
    if (bucket_bytes > 0 && !cur.params.empty() &&
        params[static_cast<size_t>(i)].requires_grad() != params[static_cast<size_t>(cur.params.back())].requires_grad()) {
      cur.begin = entries[static_cast<size_t>(cur.params.back())].offset;
      out.push_back(std::move(cur));
      cur = Bucket{};
      cur.end = entries[i].offset + entries[i].numel;
    }
    cur.params.push_back(i);
    cur.begin = entries[i].offset;
    const int64_t bytes = (cur.end - cur.begin) * static_cast<int64_t>(sizeof(float));
    if (((bucket_bytes > 0 && bytes >= bucket_bytes) || starts[static_cast<size_t>(i)]) && i > 0) {
      out.push_back(std::move(cur));
      cur = Bucket{};
      cur.end = entries[i].offset;
    }
  }
  cur.begin = 0;
  out.push_back(std::move(cur));
  if (tail_in_first) out.front().end = const_cast<optim::FlatParams&>(flat).grad_with_slot().numel();
  return out;
}

BucketReducer::BucketReducer(optim::FlatParams& flat, int64_t bucket_bytes, bool overlap,
                             comm::Compression compression, bool sharded, const std::vector<int>& unit_starts)
    : flat_(flat),
      buckets_(plan_buckets(flat, bucket_bytes, false, unit_starts)),
      overlap_(overlap),
      compression_(compression),
      sharded_(sharded) {
  // The tail (float buffers, loss, flag) is written after backward, since
  // backward may read the buffers: an all-reduce of its own, last, unless a
  // single float32 bucket (reduced after backward anyway) can carry it.
  tail_separate_ = compression_ != comm::Compression::None || buckets_.size() > 1 || sharded_;
  if (!tail_separate_) buckets_.front().end = flat.grad_with_slot().numel();
  const size_t nb = buckets_.size();
  bucket_of_.assign(flat.entries().size(), -1);
  for (size_t b = 0; b < nb; ++b)
    for (int p : buckets_[b].params) bucket_of_[p] = static_cast<int>(b);
  expected_.assign(nb, 0);
  prepared_.assign(nb, 0);
  skip_.assign(nb, 0);
  counting_ = flat.trainable_counts().numel() > 0 && compression_ == comm::Compression::None && !sharded_ &&
              tail_separate_;
  wire_.resize(nb);
  gathered_.resize(nb);
  if (compression_ != comm::Compression::None)
    for (size_t b = 0; b < nb; ++b) compressors_.push_back(std::make_unique<comm::Compressor>(compression_));
  // The views each collective works on, made once here so that the
  // communication thread runs no torch operation.
  auto& buf = flat.grad_with_slot();
  const int64_t g = flat.numel();
  for (const auto& b : buckets_) views_.push_back(buf.narrow(0, b.begin, b.end - b.begin));
  if (tail_separate_) views_.push_back(buf.narrow(0, g, buf.numel() - g));
  ops_ = views_.size();
  ready_.assign(ops_, 0);
  next_ = ops_;
  if (overlap_) install_hooks();
}

void BucketReducer::set_reduce_in_hook(std::function<void(int64_t, int64_t)> reduced, SerialQueue* queue,
                                       std::function<void(int64_t, int64_t)> failed) {
  reduced_in_hook_ = std::move(reduced);
  failed_in_hook_ = std::move(failed);
  queue_ = queue;
  overlap_ = false;  // no communication thread: the hooks reduce
  if (hooks_.empty()) install_hooks();
}

void BucketReducer::run_in_hook(size_t b) {
  if (hook_error_) return;  // the step failed already: finish() throws it
  const int64_t begin = buckets_[b].begin, end = std::min(buckets_[b].end, flat_.numel());
  if (queue_ && queue_->error()) {  // a collective of this step failed: nothing more goes out
    done_[b] = 1;
    if (failed_in_hook_) failed_in_hook_(begin, end);
    return;
  }
  try {
    prepare(b);
    done_[b] = 1;
    auto job = [this, b, begin, end] {
      try {
        run(op_of(b));
      } catch (...) {
        if (failed_in_hook_) failed_in_hook_(begin, end);
        throw;
      }
      if (reduced_in_hook_) reduced_in_hook_(begin, end);
    };
    if (queue_)
      queue_->push(std::move(job));  // its failure: the queue's, which finish() throws
    else
      job();
  } catch (...) {
    hook_error_ = std::current_exception();
  }
}

void BucketReducer::set_finish_in_backward(bool on) {
  finish_in_backward_ = on;
  if (on && hooks_.empty()) install_hooks();
}

void BucketReducer::install_hooks() {
  const auto& params = flat_.parameters();
  hooked_.assign(params.size(), 0);
  for (size_t i = 0; i < params.size(); ++i) {
    // A parameter frozen now (FlatParams' include_frozen) gets its hook too,
    // on the accumulator it will use once unfrozen: autograd keeps a leaf's
    // accumulator while someone holds it, and this reducer does.
    torch::Tensor p = params[i];
    const bool frozen = !p.requires_grad();
    if (frozen) p.set_requires_grad(true);
    auto acc = torch::autograd::impl::grad_accumulator(p);
    if (frozen) p.set_requires_grad(false);
    if (!acc) continue;
    hooked_[i] = 1;
    const int index = static_cast<int>(i);
    const uintptr_t key = acc->add_post_hook(std::make_unique<torch::autograd::utils::LambdaPostHook>(
        [this, index](const torch::autograd::variable_list& outputs, const torch::autograd::variable_list&) {
          on_parameter_ready(index);
          return outputs;
        }));
    hooks_.push_back({acc, key});
    expected_[bucket_of_[i]] += 1;
  }
}

BucketReducer::~BucketReducer() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
    // Only a step abandoned by an exception leaves a collective in flight:
    // abort the group so that it returns instead of waiting for peers.
    if (busy_ && group_) group_->abort();
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
  for (auto& [acc, key] : hooks_) acc->del_post_hook(key);
}

size_t BucketReducer::op_of(size_t bucket) const { return bucket; }

void BucketReducer::begin(std::shared_ptr<comm::Collective> group, double share, double loss,
                          std::function<double()> flag) {
  if (armed_) throw Error("internal: a step's gradient reduction began twice");
  begun_ += 1;
  flag_ = std::move(flag);
  finished_ = callback_queued_ = grad_after_finish_ = false;
  finish_started_.reset();
  deferred_ = nullptr;
  payload_bytes_ = 0;
  group_ = std::move(group);
  share_ = share;
  loss_ = loss;
  // One bucket is ready only when backward ends: nothing to overlap, and
  // the hand-off to the communication thread would only cost.
  plan_skips();
  // Fewer than two buckets go on the wire (a frozen backbone's stay off):
  // nothing to overlap either.
  const auto on_wire = buckets_.size() - static_cast<size_t>(std::count(skip_.begin(), skip_.end(), 1));
  threaded_ = overlap_ && on_wire > 1 && group_ && group_->size() > 1;
  pending_ = expected_;
  std::fill(prepared_.begin(), prepared_.end(), 0);
  done_.assign(buckets_.size(), 0);
  hook_error_ = nullptr;
  {
    std::lock_guard<std::mutex> lock(mu_);
    std::fill(ready_.begin(), ready_.end(), 0);
    next_ = 0;
    error_ = nullptr;
    step_threaded_ = threaded_;
    in_backward_ = threaded_;
    started_in_backward_ = 0;
  }
  armed_ = true;
  if (threaded_) {
    if (!thread_.joinable()) thread_ = std::thread([this] { comm_loop(); });
    for (size_t b = 0; b < buckets_.size(); ++b)
      if (expected_[b] == 0 || skip_[b]) {  // no parameter of it gets a gradient, or none goes on the wire
        prepare(b);
        mark_ready(op_of(b));
      }
  }
}

void BucketReducer::on_parameter_ready(int param) {
  if (no_sync_) return;  // the user's micro-batches: the gradient accumulates locally
  if (finished_) {       // a backward after this step's reduction
    grad_after_finish_ = true;
    return;
  }
  if (!armed_) return;  // ISGD's extra passes, an unarmed micro-batch
  if (finish_in_backward_) {
    flat_.attach_grad(static_cast<size_t>(param), /*keep=*/true);
    if (!callback_queued_) {
      callback_queued_ = true;
      torch::autograd::Engine::get_default_engine().queue_callback([this] { finish_from_backward(); });
      // The loop may have frozen or unfrozen parameters since begin(): the
      // buckets wait for the gradients that backward will produce now.
      if (threaded_ || reduced_in_hook_) count_pending();
    }
  }
  if (reduced_in_hook_) {  // fully sharded: the bucket is reduced here, now
    if (!finish_in_backward_) flat_.attach_grad(static_cast<size_t>(param), /*keep=*/true);
    const int b = bucket_of_[param];
    if (--pending_[b] == 0 && !done_[static_cast<size_t>(b)]) run_in_hook(static_cast<size_t>(b));
    return;
  }
  if (!threaded_) return;  // no overlap this step
  const int b = bucket_of_[param];
  if (--pending_[b] != 0) return;
  prepare(b);
  mark_ready(op_of(b));
}

void BucketReducer::plan_skips() {
  std::fill(skip_.begin(), skip_.end(), 0);
  if (!counting_ || !group_ || counted_group_.lock() != group_) return;  // a new group: every bucket
  for (size_t b = 0; b < buckets_.size(); ++b) {
    bool all = !buckets_[b].params.empty();
    for (int p : buckets_[b].params) all = all && frozen_everywhere_[static_cast<size_t>(p)];
    skip_[b] = all;
  }
}

void BucketReducer::take_counts(std::weak_ptr<comm::Collective> group) {
  if (!counting_) return;
  const auto* c = flat_.trainable_counts().data_ptr<float>();
  frozen_everywhere_.assign(flat_.parameters().size(), 0);
  for (size_t p = 0; p < frozen_everywhere_.size(); ++p) frozen_everywhere_[p] = c[p] == 0.0f;
  counted_group_ = std::move(group);
}

void BucketReducer::drop_skipped() {
  torch::NoGradGuard no_grad;
  for (size_t b = 0; b < buckets_.size(); ++b) {
    if (!skip_[b]) continue;
    for (int p : buckets_[b].params)  // unfrozen since the counts: this step's gradient goes
      if (flat_.parameters()[static_cast<size_t>(p)].requires_grad()) flat_.drop_grad(static_cast<size_t>(p));
  }
}

void BucketReducer::count_pending() {
  const auto& params = flat_.parameters();
  for (size_t b = 0; b < buckets_.size(); ++b) {
    int n = 0;
    for (int p : buckets_[b].params)
      if (hooked_[static_cast<size_t>(p)] && params[static_cast<size_t>(p)].requires_grad()) ++n;
    pending_[b] = n;
    if ((n == 0 || skip_[b]) && !prepared_[b]) {  // frozen, all of it: zeros (or off the wire)
      prepare(b);
      mark_ready(op_of(b));
    }
  }
}

void BucketReducer::finish_from_backward() {
  try {
    finish(flag_ ? flag_() : 0.0);
  } catch (...) {
    deferred_ = std::current_exception();
  }
  finished_ = true;
}

void BucketReducer::take_finished() {
  if (!finished_) throw Error("internal: no reduction finished in backward");
  finished_ = false;
  if (deferred_) {
    auto e = deferred_;
    deferred_ = nullptr;
    std::rethrow_exception(e);
  }
  if (grad_after_finish_)
    throw InvalidInput("a backward added to the gradient after the step's gradient was reduced across the group "
                       "(loss.backward() twice in one step?): run the backwards before the last one inside "
                       "`with job.no_sync():`, or backward the sum of the losses once");
}

void BucketReducer::prepare(size_t b) {
  if (prepared_[b]) return;
  prepared_[b] = 1;
  if (skip_[b]) return;  // off the wire this step
  torch::NoGradGuard no_grad;
  const int64_t g = flat_.numel();
  const Bucket& bk = buckets_[b];
  auto grad = flat_.grad_with_slot().narrow(0, bk.begin, std::min(bk.end, g) - bk.begin);
  if (finish_in_backward_)  // parameters frozen now send zeros (FlatParams' include_frozen)
    for (int p : bk.params)
      if (!flat_.parameters()[static_cast<size_t>(p)].requires_grad()) flat_.attach_grad(static_cast<size_t>(p), true);
  grad.mul_(share_);
  if (compression_ != comm::Compression::None) wire_[b] = compressors_[b]->encode(grad);
  if (comm::is_quantized(compression_)) {
    const int64_t all = group_->size() * wire_[b].numel();
    if (!gathered_[b].defined() || gathered_[b].numel() != all) gathered_[b] = torch::empty({all}, torch::kUInt8);
  }
}

void BucketReducer::mark_ready(size_t op) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    ready_[op] = 1;
  }
  cv_.notify_all();
}

void BucketReducer::set_shards(const std::vector<int64_t>& bounds) {
  shard_bounds_.clear();
  for (const auto& b : buckets_) {
    std::vector<int64_t> rel;
    for (int64_t x : bounds) rel.push_back(std::clamp(x, b.begin, b.end) - b.begin);
    shard_bounds_.push_back(std::move(rel));
  }
}

void BucketReducer::run(size_t op) {
  if (op < buckets_.size() && skip_[op]) return;  // every member skips it alike
  if (op < buckets_.size())
    payload_bytes_ += compression_ != comm::Compression::None
                          ? static_cast<int64_t>(wire_[op].nbytes())
                          : 4 * (std::min(buckets_[op].end, flat_.numel()) - buckets_[op].begin);
  if (comm::is_16bit(compression_) && op < buckets_.size()) {
    group_->allreduce_sum_16(wire_[op]);
    return;
  }
  if (comm::is_quantized(compression_) && op < buckets_.size()) {
    // Every member's codes to everyone, then decoded and added in rank
    // order into the bucket (plain loops: no torch operation here).
    comm::gather_codes_and_sum(*group_, wire_[op].data_ptr<uint8_t>(), wire_[op].numel(), gathered_[op],
                               views_[op].data_ptr<float>(), views_[op].numel(),
                               compression_ == comm::Compression::Int8 ? 8 : 4);
    return;
  }
  if (views_[op].numel() == 0) return;
  if (sharded_ && op < buckets_.size()) group_->reduce_scatter_sum(views_[op], shard_bounds_.at(op));
  else group_->allreduce_sum(views_[op]);  // a float32 bucket, or the tail
}

void BucketReducer::comm_loop() {
  name_this_thread("limbo-reduce");
  std::unique_lock<std::mutex> lock(mu_);
  for (;;) {
    cv_.wait(lock, [&] { return stop_ || (step_threaded_ && next_ < ops_ && ready_[next_]); });
    if (stop_) return;
    const size_t op = next_;
    busy_ = true;
    if (die_at_step_ > 0 && begun_ == die_at_step_ && op == op_of(1)) ::kill(::getpid(), SIGKILL);
    if (in_backward_) ++started_in_backward_;
    lock.unlock();
    std::exception_ptr err;
    try {
      run(op);
    } catch (...) {
      err = std::current_exception();
    }
    lock.lock();
    busy_ = false;
    if (err) {
      error_ = err;
      next_ = ops_;  // no later bucket of this step starts
    } else {
      ++next_;
    }
    cv_.notify_all();
  }
}

void BucketReducer::finish(double flag) {
  if (!armed_) throw Error("internal: finishing a gradient reduction that did not begin");
  const auto t0 = Clock::now();
  finish_started_ = t0;
  std::exception_ptr err;
  // Backward is over: the tail can be written. The float buffers become
  // their share of the weighted mean; the loss and the flag ride behind.
  {
    torch::NoGradGuard no_grad;
    auto& buf = flat_.grad_with_slot();
    const int64_t g = flat_.numel(), n = buf.numel() - optim::FlatParams::kSlots;
    const int64_t avg = flat_.averaged_numel();
    flat_.buffers_to_flat();
    buf.narrow(0, g, avg).mul_(share_);
    // Integer buffers: member 0's pieces, plus zeros from everyone else.
    if (group_ && group_->rank() != 0) buf.narrow(0, g + avg, n - g - avg).zero_();
    buf[n].fill_(loss_ * share_);
    buf[n + 1].fill_(flag);
    if (counting_) {  // this member's trainable parameters, counted across the group
      auto* c = flat_.trainable_counts().data_ptr<float>();
      const auto& params = flat_.parameters();
      for (size_t p = 0; p < params.size(); ++p) c[p] = params[p].requires_grad() ? 1.0f : 0.0f;
    }
  }
  // Buckets that backward did not complete (no overlap, or a parameter it
  // never reached) are prepared here, in order; not when the step failed
  // already (a fully sharded backward gave its buckets' pages back: scaling
  // them would touch the whole gradient again for nothing).
  const bool failed = !threaded_ && (hook_error_ || (queue_ && queue_->error()));
  for (size_t b = 0; b < buckets_.size() && !failed; ++b) {
    if (prepared_[b]) continue;
    if (finish_in_backward_)
      for (int p : buckets_[b].params) flat_.attach_grad(static_cast<size_t>(p), /*keep=*/true);
    prepare(b);
    if (threaded_) mark_ready(op_of(b));
  }
  if (threaded_) {
    if (tail_separate_) mark_ready(ops_ - 1);
    std::unique_lock<std::mutex> lock(mu_);
    in_backward_ = false;
    cv_.wait(lock, [&] { return next_ >= ops_ && !busy_; });
    step_threaded_ = false;  // the thread keeps off the group until the next overlapped step
    err = error_;
    error_ = nullptr;
    stats_.buckets_started_in_backward += started_in_backward_;
  } else {
    err = hook_error_;
    hook_error_ = nullptr;
    if (queue_) {  // the buckets backward handed over: reduced, or the step failed
      queue_->drain();
      if (!err) err = queue_->error();
    }
    try {
      for (size_t op = 0; op < ops_ && !err; ++op) {
        const bool bucket = op < buckets_.size();
        if (reduced_in_hook_ && bucket) {  // the rest of a fully sharded backward's buckets, in order
          const size_t b = op;  // op_of() is the identity without a tail in a bucket
          if (done_[b]) continue;
          run(op);
          done_[b] = 1;
          reduced_in_hook_(buckets_[b].begin, std::min(buckets_[b].end, flat_.numel()));
          continue;
        }
        run(op);
      }
    } catch (...) {
      err = std::current_exception();
    }
  }
  armed_ = false;
  const std::weak_ptr<comm::Collective> step_group = group_;
  group_.reset();
  stats_.steps += 1;
  stats_.buckets += static_cast<int64_t>(buckets_.size());
  stats_.exposed_seconds += seconds_since(t0);
  if (err) std::rethrow_exception(err);  // the step failed; residuals stay as they were
  torch::NoGradGuard no_grad;
  flat_.flat_to_buffers();
  if (counting_) {
    drop_skipped();  // before anything reads the gradient: the same zeros on every member
    take_counts(step_group);
  }
  // A non-finite sum (a 16-bit overflow, a user's loss gone to inf) is the
  // same on every member: the step is skipped everywhere, and no residual
  // moves (one that took in an infinity would spoil every later step).
  {
    auto& buf = flat_.grad_with_slot();
    const int64_t n = buf.numel() - optim::FlatParams::kSlots;
    finite_ = std::isfinite(buf[n].item<float>());
    if (comm::is_16bit(compression_) && finite_)
      for (size_t b = 0; b < buckets_.size(); ++b)
        finite_ = finite_ && std::isfinite(wire_[b].sum(torch::kFloat32).item<float>());
    else if (finite_ && !sharded_ && std::find(skip_.begin(), skip_.end(), 1) != skip_.end())
      for (size_t b = 0; b < buckets_.size() && finite_; ++b) {  // a frozen backbone's zeros are not read
        if (skip_[b]) continue;
        const int64_t end = std::min(buckets_[b].end, flat_.numel());
        finite_ = std::isfinite(flat_.grad().narrow(0, buckets_[b].begin, end - buckets_[b].begin).sum().item<float>());
      }
    else if (finite_ && !sharded_)
      finite_ = std::isfinite(flat_.grad().sum().item<float>());
  }
  if (after_finish_) after_finish_();
  if (!finite_) return;
  if (compression_ != comm::Compression::None) {
    const int64_t g = flat_.numel();
    for (size_t b = 0; b < buckets_.size(); ++b) {
      const Bucket& bk = buckets_[b];
      if (comm::is_16bit(compression_))
        flat_.grad_with_slot().narrow(0, bk.begin, std::min(bk.end, g) - bk.begin).copy_(wire_[b]);
      compressors_[b]->commit();
    }
  }
}

}  // namespace limbo::elastic
