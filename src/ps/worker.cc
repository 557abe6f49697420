#include "ps/worker.h"
#include "ps/heartbeats.h"
#include "ps/protocol.h"

#include <signal.h>
#include <unistd.h>

#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <thread>

#include "common/error.h"
#include "common/timing.h"
#include "common/files.h"
#include "common/log.h"
#include "data/loader.h"
#include "ps/buffer_mean.h"
#include "ps/shard_links.h"
#include "ps/shard_state.h"
#include "optim/clip.h"
#include "train/checkpoint.h"

namespace limbo::ps {
namespace {

using json = nlohmann::json;

// Coefficient of variation (std / mean) of per-step times from their sum and sum of squares.
double cv_of(double sum, double squares, int64_t n) {
  if (n < 2 || sum <= 0) return 0;
  const double mean = sum / n, var = std::max(0.0, squares / n - mean * mean);
  return std::sqrt(var) / mean;
}

class Learner {
 public:
  Learner(train::Trainer& t, const train::TrainerConfig& cfg, const WorkerOptions& opt, const CurveKeys& keys)
      : t_(t), cfg_(cfg), opt_(opt),
        shards_(opt, keys, model_fingerprint(cfg.model.name, t.params()), t.params().numel()),
        sampler_(t.data().train.size(), cfg.loader.order, cfg.loader.seed),
        tag_("learner " + std::to_string(opt.learner_id)),
        lease_flag_(opt.finish_only ? 0 : kWantLease),
        pull_seq_(shards_.all().size()), push_seq_(shards_.all().size(), 0) {}

  json run(const std::atomic<bool>& stop);

 private:
  // What shard 0 said with the weights of a step.
  struct Pulled {
    json lease;          // the next batch (null: none out now)
    bool done = false;   // the data is exhausted
    bool finisher = false;
  };

  // The acknowledgements of the previous push from every shard, then the
  // weights of this step (into the flat parameters) and shard 0's lease.
  Pulled acknowledge_and_pull();
  // Counts shard 0's verdict on the last push (accepted, dropped, ...).
  void count_ack(const json& ack);
  // Batch, gradient (clipped), the push of each shard's slice, and the next
  // pull sent with it. Returns the batch's loss.
  double compute_and_push(const json& lease);
  // A metrics line every log_every steps.
  void log_window(double epoch, int64_t count);
  // The finisher's part: the final weights, their evaluation, checkpoint.pt
  // and final.json in the run directory.
  void write_final(json& summary);
  json summary() const;

  // What a push to shard 0 carries of this learner's buffers, as its forward
  // left them (see buffer_mean.h): a copy (the next forward may run while
  // ZeroMQ still sends it) and how many are averaged. None for a model
  // without buffers.
  struct BufferPush {
    Frame frame;
    std::string meta;
  };
  BufferPush buffers_to_push() {
    auto& flat = t_.params();
    if (flat.buffer_numel() == 0) return {};
    flat.buffers_to_flat();
    const float* b = flat.buffers().data_ptr<float>();
    BufferPush p;
    p.frame = float_frame(std::make_shared<std::vector<float>>(b, b + flat.buffer_numel()));
    p.meta = json{{"averaged", flat.averaged_numel()}}.dump();
    return p;
  }

  // Shard 0's buffers (from a weights reply) become this learner's.
  void take_buffers(const Message& w) {
    auto& flat = t_.params();
    if (flat.buffer_numel() == 0 || w.buffers.size == 0) return;  // none yet: this learner's stand
    if (static_cast<int64_t>(w.buffer_floats()) != flat.buffer_numel())
      throw PeerFailure("shard 0 sent buffers that do not fit this model (" + std::to_string(w.buffer_floats()) +
                        " floats; it has " + std::to_string(flat.buffer_numel()) + ")");
    std::memcpy(flat.buffers().data_ptr<float>(), w.buffers.data, w.buffers.size);
    flat.flat_to_buffers();
  }

  // A shard refused this learner's last gradient as not finite (NaN or
  // inf: its update was skipped), or every shard took it. Too many in a
  // row: the learner's model has diverged.
  void note_finite(bool finite) {
    if (finite) {
      nonfinite_in_a_row_ = 0;
      return;
    }
    nonfinite_ += 1;
    nonfinite_in_a_row_ += 1;
    const int64_t limit = cfg_.train.max_nonfinite_steps;
    if (limit > 0 && nonfinite_in_a_row_ >= limit)
      throw Diverged("learner " + std::to_string(opt_.learner_id) + ": " + std::to_string(nonfinite_in_a_row_) +
                     " gradients in a row (up to its step " + std::to_string(steps_) +
                     ") were not finite and were refused by the shards; the model has diverged. Lower "
                     "optim.lr or check the data for NaN or inf (train.max_nonfinite_steps sets how many are "
                     "allowed)");
  }

  void bye() {
    heartbeats_.reset();  // no heartbeat may follow the goodbye
    shards_.bye();
  }

  // Payloads go out from the gradient buffer without a copy: count sends in
  // flight and never write the buffer while one is.
  std::shared_ptr<void> keep_grad() {
    in_flight_->fetch_add(1);
    return std::shared_ptr<void>(static_cast<void*>(in_flight_.get()), [c = in_flight_](void*) { c->fetch_sub(1); });
  }
  void wait_sends() const {
    while (in_flight_->load() > 0) std::this_thread::yield();
  }

  train::Trainer& t_;
  const train::TrainerConfig& cfg_;
  WorkerOptions opt_;
  ShardLinks shards_;
  data::Sampler sampler_;
  const std::string tag_;
  const uint8_t lease_flag_;  // the pulls of a learner that trains ask shard 0 for a batch
  std::string metrics_;       // learners/<id>.jsonl (empty: no run directory)
  std::vector<uint64_t> pull_seq_, push_seq_;  // per shard; push 0: none unacknowledged
  std::shared_ptr<std::atomic<int>> in_flight_ = std::make_shared<std::atomic<int>>(0);
  // Counters of the run (the summary) and of the metrics window.
  int64_t steps_ = 0, samples_ = 0, accepted_ = 0, dropped_ = 0, lost_ = 0, rejected_ = 0, tau_sum_ = 0, tau_n_ = 0;
  int64_t nonfinite_ = 0, nonfinite_in_a_row_ = 0;  // gradients refused as not finite
  double loss_sum_ = 0, norm_sum_ = 0;
  int64_t norm_n_ = 0;
  train::MetricsWindow window_;
  Clock::time_point start_ = Clock::now();
  bool finisher_ = false;
  // Where a learner's time goes (the simulator is calibrated from these):
  // computing (batch, forward, backward) and waiting for the shards.
  double compute_seconds_ = 0, compute_squares_ = 0, wait_seconds_ = 0, wait_squares_ = 0;
  std::unique_ptr<Heartbeats> heartbeats_;  // after shards_ (its transport): stopped before it goes
};

void Learner::count_ack(const json& a) {
  const std::string st = a.value("status", std::string());
  if (st == "accepted") accepted_ += 1;
  else if (st == "dropped") dropped_ += 1;
  else if (st == "lost") lost_ += 1;
  else if (st == "rejected") {
    rejected_ += 1;
    if (rejected_ <= 3 || (rejected_ & (rejected_ - 1)) == 0)
      log_warn(tag_ + ": shard 0 rejected a gradient (" + std::to_string(rejected_) + " so far): " +
               a.value("reason", std::string("?")));
  }
  if (a.contains("tau")) {
    tau_sum_ += a["tau"].get<int64_t>();
    tau_n_ += 1;
  }
}

Learner::Pulled Learner::acknowledge_and_pull() {
  Pulled p;
  bool acked = false, not_finite = false;  // the last push, on any shard
  float* weights = t_.params().data().data_ptr<float>();
  for (auto& l : shards_.all()) {
    ShardLink& L = *l;
    const uint8_t flags = L.index == 0 ? lease_flag_ : 0;
    if (push_seq_[L.index]) {
      Message ack = shards_.await(L, push_seq_[L.index], MsgType::PushAck, [&] {
        pull_seq_[L.index] = shards_.send_pull(L, flags);  // the pull sent with the push was lost too
        return uint64_t{0};
      });
      json a = json::parse(ack.meta);
      if (a.value("status", std::string()) == "accepted") shards_.accepted(L);
      acked = true;
      not_finite = not_finite || a.value("code", std::string()) == "non_finite";
      if (L.index == 0) count_ack(a);
      push_seq_[L.index] = 0;
    }
    Message w = shards_.receive_weights(L, weights, pull_seq_[L.index],
                                        [&] { return pull_seq_[L.index] = shards_.send_pull(L, flags); });
    if (L.index == 0) {
      take_buffers(w);
      json meta = w.meta.empty() ? json::object() : json::parse(w.meta);
      p.lease = meta.value("lease", json());
      if (meta.value("lease_state", std::string()) == "done") {
        p.done = true;
        p.finisher = meta.value("finisher", false);
      }
    }
  }
  if (acked) note_finite(!not_finite);
  return p;
}

double Learner::compute_and_push(const json& lease) {
  auto& flat = t_.params();
  const int64_t lease_id = lease["id"], epoch = lease["epoch"], position = lease["position"], count = lease["count"];
  const auto& order = sampler_.epoch_order(epoch);
  if (position < 0 || count < 1 || position + count > static_cast<int64_t>(order.size()))
    throw PeerFailure("shard 0 handed out an invalid batch (epoch " + std::to_string(epoch) + ", position " +
                      std::to_string(position) + ", count " + std::to_string(count) + ")");
  auto compute0 = Clock::now();
  std::vector<int64_t> ids(order.begin() + position, order.begin() + position + count);
  auto batch = data::make_train_batch(t_.data().train, t_.normalization(), ids, epoch, cfg_.loader.augment);
  wait_sends();
  const double lv = t_.step().gradient(batch);
  if (cfg_.clip_grad_norm > 0) {  // this learner's own gradient, before the push
    norm_sum_ += optim::clip_grad_norm(flat.grad(), cfg_.clip_grad_norm);
    norm_n_ += 1;
  }
  const double step_compute = seconds_since(compute0);
  compute_seconds_ += step_compute;
  compute_squares_ += step_compute * step_compute;

  // A gradient (or loss) that is not finite anywhere, or that a 16-bit
  // push would make infinite anywhere (fp16 overflows at 65520), goes out
  // as NaN to every shard (ShardLinks::prepare_push).
  float* g = flat.grad().data_ptr<float>();
  shards_.prepare_push(g, std::isfinite(lv));
  const BufferPush b = buffers_to_push();
  for (auto& l : shards_.all())
    push_seq_[l->index] = shards_.send_push(*l, g, lease_id, l->index == 0 ? b.meta : std::string(),
                                            [this] { return keep_grad(); },
                                            l->index == 0 && b.frame.size > 0 ? &b.frame : nullptr);
  steps_ += 1;
  samples_ += count;
  if (cfg_.train.pause_at_step > 0 && steps_ == cfg_.train.pause_at_step) {
    // Testing aid: stops between batches (the step's gradient sent, no
    // next batch asked for), still sending heartbeats from their thread.
    std::fprintf(stderr, "paused at step %lld\n", static_cast<long long>(steps_));
    std::fflush(stderr);
    for (;;) std::this_thread::sleep_for(std::chrono::seconds(1));
  }
  for (auto& l : shards_.all()) pull_seq_[l->index] = shards_.send_pull(*l, l->index == 0 ? kWantLease : 0);
  return lv;
}

void Learner::log_window(double epoch, int64_t count) {
  if (window_.steps() < opt_.log_every || metrics_.empty()) return;
  train::StepRecord rec;
  rec.step = steps_;
  rec.epoch = epoch;
  rec.samples = samples_;
  rec.batch_size = count;
  rec.skipped_steps = nonfinite_;
  if (norm_n_ > 0) rec.grad_norm = norm_sum_ / static_cast<double>(norm_n_);
  json line = train::step_record(rec, window_, "learner");
  line["learner"] = opt_.learner_id;
  line["staleness_mean"] = tau_n_ ? static_cast<double>(tau_sum_) / tau_n_ : 0.0;
  line["gradients_dropped"] = dropped_;
  line["elapsed"] = seconds_since(start_);
  append_line(metrics_, line.dump());
  window_.reset();
  norm_sum_ = 0;
  norm_n_ = 0;
}

json Learner::summary() const {
  const double secs = seconds_since(start_);
  return {{"learner", opt_.learner_id}, {"steps", steps_}, {"samples", samples_},
          {"samples_per_second", secs > 0 ? samples_ / secs : 0.0}, {"seconds", secs},
          {"mean_loss", steps_ ? loss_sum_ / steps_ : 0.0}, {"gradients_accepted", accepted_},
          {"gradients_dropped", dropped_}, {"gradients_lost", lost_}, {"gradients_rejected", rejected_},
          {"skipped_steps", nonfinite_},
          {"staleness_mean_seen", tau_n_ ? static_cast<double>(tau_sum_) / tau_n_ : 0.0},
          {"finisher", finisher_},
          {"compute_seconds_per_step", steps_ ? compute_seconds_ / steps_ : 0.0},
          {"compute_cv", cv_of(compute_seconds_, compute_squares_, steps_)},
          {"wait_cv", cv_of(wait_seconds_, wait_squares_, steps_)},
          {"wait_seconds_per_step", steps_ ? wait_seconds_ / steps_ : 0.0}};
}

void Learner::write_final(json& summary) {
  if (cfg_.train.writer_dies_at == "eval" && !opt_.finish_only) {  // testing aid: the finisher dies
    std::fprintf(stderr, "testing: the finisher dies before the final weights\n");
    std::fflush(stderr);
    ::kill(::getpid(), SIGKILL);
  }
  // Final weights: answered by each shard once no learner is registered.
  float* weights = t_.params().data().data_ptr<float>();
  auto& links = shards_.all();
  std::vector<uint64_t> seqs;
  for (auto& l : links) seqs.push_back(shards_.send_pull(*l, kObserver | kFinal));
  uint64_t clock0 = 0;
  for (auto& l : links) {
    ShardLink& L = *l;
    Message w = shards_.receive_weights(
        L, weights, seqs[L.index], [&] { return seqs[L.index] = shards_.send_pull(L, kObserver | kFinal); },
        ShardLinks::Waiting::Observer);
    if (L.index == 0) {
      clock0 = w.header.clock;
      take_buffers(w);
    }
  }
  auto ev = t_.evaluate_test();
  train::TrainState st;
  st.step = static_cast<int64_t>(clock0);
  st.cursor = {cfg_.train.epochs, 0};
  st.config_toml = cfg_.config_toml;
  // The optimizer's state lives on the shards (their checkpoints): the
  // learner's checkpoint holds the final weights.
  train::save_checkpoint(opt_.run_dir + "/checkpoint.pt", t_.model(), t_.optimizer(), st);
  json fin = train::eval_fields(ev);
  fin.update(json{{"test_samples", ev.samples}, {"clock_shard0", clock0}, {"learner", opt_.learner_id}});
  write_file_atomic(opt_.run_dir + "/final.json", fin.dump(2) + "\n");
  log_info(tag_ + ": final test accuracy " + std::to_string(100 * ev.accuracy) + "%");
  summary.update(train::eval_fields(ev));
}

json Learner::run(const std::atomic<bool>& stop) {
  heartbeats_ = std::make_unique<Heartbeats>(shards_.transport(), opt_.servers, opt_.learner_id, opt_.heartbeat_interval);
  if (!opt_.run_dir.empty()) {
    make_dirs(opt_.run_dir + "/learners");
    metrics_ = opt_.run_dir + "/learners/" + std::to_string(opt_.learner_id) + ".jsonl";
  }
  // The first pull; later pulls go out together with the pushes. (One that
  // only takes the final weights asks for no batch.)
  for (auto& l : shards_.all()) pull_seq_[l->index] = shards_.send_pull(*l, l->index == 0 ? lease_flag_ : 0);
  start_ = Clock::now();
  for (;;) {
    auto wait0 = Clock::now();
    Pulled p = acknowledge_and_pull();
    finisher_ = finisher_ || p.finisher;
    const double step_wait = seconds_since(wait0);
    wait_seconds_ += step_wait;
    wait_squares_ += step_wait * step_wait;
    if (p.done || stop || opt_.finish_only || (opt_.max_steps > 0 && steps_ >= opt_.max_steps)) break;
    if (p.lease.is_null()) {  // all batches are out; some may come back
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
      for (auto& l : shards_.all()) pull_seq_[l->index] = shards_.send_pull(*l, l->index == 0 ? kWantLease : 0);
      continue;
    }
    const double lv = compute_and_push(p.lease);
    const int64_t count = p.lease["count"];
    loss_sum_ += lv;
    window_.add(lv, count);
    log_window(static_cast<double>(p.lease["epoch"].get<int64_t>()), count);
  }
  // Outstanding pushes were acknowledged above; leave every shard.
  wait_sends();
  bye();
  json s = summary();
  const double secs = s["seconds"];
  log_info(tag_ + ": left after " + std::to_string(steps_) + " steps (" + std::to_string(samples_) + " samples, " +
           std::to_string(static_cast<int64_t>(secs > 0 ? samples_ / secs : 0)) + " samples/s)");
  if (!opt_.run_dir.empty())
    write_file_atomic(opt_.run_dir + "/learners/" + std::to_string(opt_.learner_id) + ".summary.json", s.dump(2) + "\n");
  if ((finisher_ || opt_.finish_only) && !opt_.run_dir.empty()) write_final(s);
  return s;
}

}  // namespace

json run_worker(train::Trainer& trainer, const train::TrainerConfig& cfg, const WorkerOptions& opt,
                const CurveKeys& keys, const std::atomic<bool>& stop) {
  if (opt.servers.empty()) throw InvalidInput("a worker needs --servers (the shards' endpoints, in shard order)");
  check_buffers_fit(trainer.params().buffer_numel());
  Learner l(trainer, cfg, opt, keys);
  return l.run(stop);
}

}  // namespace limbo::ps
