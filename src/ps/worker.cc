#include "ps/worker.h"
#include "ps/heartbeats.h"

#include <signal.h>
#include <unistd.h>

#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
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
        shards_(opt, keys, model_fingerprint(cfg.model.name, t.params()), t.params().numel()) {}

  json run(const std::atomic<bool>& stop);

 private:
  // The metadata of a push to shard 0: this learner's buffers, as its
  // forward left them (see buffer_mean.h). Empty for a model without any.
  std::string buffers_meta() {
    auto& flat = t_.params();
    if (flat.buffer_numel() == 0) return {};
    flat.buffers_to_flat();
    return json{{"buffers", floats_to_base64(flat.buffers().data_ptr<float>(), static_cast<size_t>(flat.buffer_numel()))},
                {"averaged", flat.averaged_numel()}}
        .dump();
  }

  // Shard 0's buffers (from a weights reply) become this learner's.
  void take_buffers(const std::string& meta_text) {
    auto& flat = t_.params();
    if (flat.buffer_numel() == 0 || meta_text.empty()) return;
    json meta = json::parse(meta_text, nullptr, /*allow_exceptions=*/false);
    auto b = meta.is_object() ? meta.find("buffers") : meta.end();
    if (!meta.is_object() || b == meta.end()) return;  // none yet: this learner's stand
    std::vector<float> v;
    if (!b->is_string() || !base64_to_floats(b->get<std::string>(), v) ||
        static_cast<int64_t>(v.size()) != flat.buffer_numel())
      throw PeerFailure("shard 0 sent buffers that do not fit this model (" + std::to_string(v.size()) +
                        " floats; it has " + std::to_string(flat.buffer_numel()) + ")");
    std::copy(v.begin(), v.end(), flat.buffers().data_ptr<float>());
    flat.flat_to_buffers();
  }

  // A shard refused this learner's last gradient as not finite (NaN or
  // inf: its update was skipped), or every shard took it. Too many in a
  // row: the learner's model has diverged.
  void note_finite(bool finite, int64_t steps) {
    if (finite) {
      nonfinite_in_a_row_ = 0;
      return;
    }
    nonfinite_ += 1;
    nonfinite_in_a_row_ += 1;
    const int64_t limit = cfg_.train.max_nonfinite_steps;
    if (limit > 0 && nonfinite_in_a_row_ >= limit)
      throw Diverged("learner " + std::to_string(opt_.learner_id) + ": " + std::to_string(nonfinite_in_a_row_) +
                     " gradients in a row (up to its step " + std::to_string(steps) +
                     ") were not finite and were refused by the shards; the model has diverged. Lower "
                     "optim.lr or check the data for NaN or inf (train.max_nonfinite_steps sets how many are "
                     "allowed)");
  }

  void bye() {
    heartbeats_.reset();  // no heartbeat may follow the goodbye
    shards_.bye();
  }


  train::Trainer& t_;
  const train::TrainerConfig& cfg_;
  WorkerOptions opt_;
  ShardLinks shards_;
  int64_t nonfinite_ = 0, nonfinite_in_a_row_ = 0;  // gradients refused as not finite
  std::unique_ptr<Heartbeats> heartbeats_;  // after shards_ (its transport): stopped before it goes
};

json Learner::run(const std::atomic<bool>& stop) {
  heartbeats_ = std::make_unique<Heartbeats>(shards_.transport(), opt_.servers, opt_.learner_id, opt_.heartbeat_interval);
  auto& flat = t_.params();
  float* weights = flat.data().data_ptr<float>();
  auto& links = shards_.all();
  auto& model = t_.model();
  const auto& train_set = t_.data().train;
  data::Sampler sampler(train_set.size(), cfg_.loader.order, cfg_.loader.seed);
  const std::string tag = "learner " + std::to_string(opt_.learner_id);
  std::string metrics;
  if (!opt_.run_dir.empty()) {
    make_dirs(opt_.run_dir + "/learners");
    metrics = opt_.run_dir + "/learners/" + std::to_string(opt_.learner_id) + ".jsonl";
  }
  // Payloads go out from the gradient buffer without a copy: count sends in
  // flight and never write the buffer while one is.
  auto in_flight = std::make_shared<std::atomic<int>>(0);
  auto keep_grad = [&] {
    in_flight->fetch_add(1);
    return std::shared_ptr<void>(static_cast<void*>(in_flight.get()), [c = in_flight](void*) { c->fetch_sub(1); });
  };

  int64_t steps = 0, samples = 0, accepted = 0, dropped = 0, lost = 0, rejected = 0, tau_sum = 0, tau_n = 0;
  double loss_sum = 0, norm_sum = 0;
  int64_t norm_n = 0;
  train::MetricsWindow window;
  auto start = Clock::now();
  bool finisher = false, done = false;

  // The first pull; later pulls go out together with the pushes. (One that
  // only takes the final weights asks for no batch.)
  const uint8_t lease_flag = opt_.finish_only ? 0 : kWantLease;
  std::vector<uint64_t> pull_seq(links.size());
  for (auto& l : links) pull_seq[l->index] = shards_.send_pull(*l, l->index == 0 ? lease_flag : 0);
  std::vector<uint64_t> push_seq(links.size(), 0);
  int64_t lease_id = -1;
  json lease;

  // Where a learner's time goes (the simulator is calibrated from these):
  // computing (batch, forward, backward) and waiting for the shards.
  double compute_seconds = 0, compute_squares = 0, wait_seconds = 0, wait_squares = 0;
  for (;;) {
    // Acknowledgements of the previous push, then the weights of this step.
    auto wait0 = Clock::now();
    bool acked = false, not_finite = false;  // the last push, on any shard
    for (auto& l : links) {
      ShardLink& L = *l;
      const uint8_t flags = L.index == 0 ? lease_flag : 0;
      if (push_seq[L.index]) {
        Message ack = shards_.await(L, push_seq[L.index], MsgType::PushAck, [&] {
          pull_seq[L.index] = shards_.send_pull(L, flags);  // the pull sent with the push was lost too
          return uint64_t{0};
        });
        json a = json::parse(ack.meta);
        std::string st = a.value("status", std::string());
        if (st == "accepted") shards_.accepted(L);
        acked = true;
        not_finite = not_finite || a.value("code", std::string()) == "non_finite";
        if (L.index == 0) {
          if (st == "accepted") accepted += 1;
          else if (st == "dropped") dropped += 1;
          else if (st == "lost") lost += 1;
          else if (st == "rejected") {
            rejected += 1;
            if (rejected <= 3 || (rejected & (rejected - 1)) == 0)
              log_warn(tag + ": shard 0 rejected a gradient (" + std::to_string(rejected) + " so far): " +
                       a.value("reason", std::string("?")));
          }
          if (a.contains("tau")) {
            tau_sum += a["tau"].get<int64_t>();
            tau_n += 1;
          }
        }
        push_seq[L.index] = 0;
      }
      Message w = shards_.receive_weights(L, weights, pull_seq[L.index],
                                          [&] { return pull_seq[L.index] = shards_.send_pull(L, flags); });
      if (L.index == 0) {
        take_buffers(w.meta);
        json meta = w.meta.empty() ? json::object() : json::parse(w.meta);
        lease = meta.value("lease", json());
        std::string state = meta.value("lease_state", std::string());
        if (state == "done") {
          done = true;
          finisher = meta.value("finisher", false);
        }
      }
    }
    if (acked) note_finite(!not_finite, steps);
    const double step_wait = seconds_since(wait0);
    wait_seconds += step_wait;
    wait_squares += step_wait * step_wait;
    if (done || stop || opt_.finish_only || (opt_.max_steps > 0 && steps >= opt_.max_steps)) break;
    if (lease.is_null()) {  // all batches are out; some may come back
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
      for (auto& l : links) pull_seq[l->index] = shards_.send_pull(*l, l->index == 0 ? kWantLease : 0);
      continue;
    }
    lease_id = lease["id"];
    const int64_t epoch = lease["epoch"], position = lease["position"], count = lease["count"];
    const auto& order = sampler.epoch_order(epoch);
    if (position < 0 || count < 1 || position + count > static_cast<int64_t>(order.size()))
      throw PeerFailure("shard 0 handed out an invalid batch (epoch " + std::to_string(epoch) + ", position " +
                        std::to_string(position) + ", count " + std::to_string(count) + ")");
    auto compute0 = Clock::now();
    std::vector<int64_t> ids(order.begin() + position, order.begin() + position + count);
    auto batch = data::make_train_batch(train_set, t_.normalization(), ids, epoch, cfg_.loader.augment);

    while (in_flight->load() > 0) std::this_thread::yield();
    const double lv = t_.step().gradient(batch);
    if (cfg_.clip_grad_norm > 0) {  // this learner's own gradient, before the push
      norm_sum += optim::clip_grad_norm(flat.grad(), cfg_.clip_grad_norm);
      norm_n += 1;
    }
    const double step_compute = seconds_since(compute0);
    compute_seconds += step_compute;
    compute_squares += step_compute * step_compute;

    // Each shard checks only its own slice, so a gradient (or loss) that is
    // not finite anywhere is sent as NaN everywhere: every shard refuses it
    // alike, and none applies the finite rest of it.
    if (!std::isfinite(lv) || !flat.grad().isfinite().all().item<bool>()) flat.grad().fill_(NAN);
    const float* g = flat.grad().data_ptr<float>();
    const std::string meta0 = buffers_meta();
    for (auto& l : links)
      push_seq[l->index] = shards_.send_push(*l, g, lease_id, l->index == 0 ? meta0 : std::string(), keep_grad);
    steps += 1;
    samples += count;
    if (cfg_.train.pause_at_step > 0 && steps == cfg_.train.pause_at_step) {
      // Testing aid: stops between batches (the step's gradient sent, no
      // next batch asked for), still sending heartbeats from their thread.
      std::fprintf(stderr, "paused at step %lld\n", static_cast<long long>(steps));
      std::fflush(stderr);
      for (;;) std::this_thread::sleep_for(std::chrono::seconds(1));
    }
    for (auto& l : links) pull_seq[l->index] = shards_.send_pull(*l, l->index == 0 ? kWantLease : 0);
    loss_sum += lv;
    window.add(lv, count);
    if (window.steps() >= opt_.log_every && !metrics.empty()) {
      train::StepRecord rec;
      rec.step = steps;
      rec.epoch = static_cast<double>(epoch);
      rec.samples = samples;
      rec.batch_size = count;
      rec.skipped_steps = nonfinite_;
      if (norm_n > 0) rec.grad_norm = norm_sum / static_cast<double>(norm_n);
      norm_sum = 0;
      norm_n = 0;
      json line = train::step_record(rec, window, "learner");
      line["learner"] = opt_.learner_id;
      line["staleness_mean"] = tau_n ? static_cast<double>(tau_sum) / tau_n : 0.0;
      line["gradients_dropped"] = dropped;
      line["elapsed"] = seconds_since(start);
      append_line(metrics, line.dump());
      window.reset();
    }
  }
  // Outstanding pushes were acknowledged above; leave every shard.
  while (in_flight->load() > 0) std::this_thread::yield();
  bye();
  const double secs = seconds_since(start);
  json summary = {{"learner", opt_.learner_id}, {"steps", steps}, {"samples", samples},
                  {"samples_per_second", secs > 0 ? samples / secs : 0.0}, {"seconds", secs},
                  {"mean_loss", steps ? loss_sum / steps : 0.0}, {"gradients_accepted", accepted},
                  {"gradients_dropped", dropped}, {"gradients_lost", lost}, {"gradients_rejected", rejected},
                  {"skipped_steps", nonfinite_},
                  {"staleness_mean_seen", tau_n ? static_cast<double>(tau_sum) / tau_n : 0.0},
                  {"finisher", finisher},
                  {"compute_seconds_per_step", steps ? compute_seconds / steps : 0.0},
                  {"compute_cv", cv_of(compute_seconds, compute_squares, steps)},
                  {"wait_cv", cv_of(wait_seconds, wait_squares, steps)},
                  {"wait_seconds_per_step", steps ? wait_seconds / steps : 0.0}};
  log_info(tag + ": left after " + std::to_string(steps) + " steps (" + std::to_string(samples) + " samples, " +
           std::to_string(static_cast<int64_t>(secs > 0 ? samples / secs : 0)) + " samples/s)");
  if (!opt_.run_dir.empty())
    write_file_atomic(opt_.run_dir + "/learners/" + std::to_string(opt_.learner_id) + ".summary.json",
                      summary.dump(2) + "\n");
  if ((finisher || opt_.finish_only) && !opt_.run_dir.empty()) {
    if (cfg_.train.writer_dies_at == "eval" && !opt_.finish_only) {  // testing aid: the finisher dies
      std::fprintf(stderr, "testing: the finisher dies before the final weights\n");
      std::fflush(stderr);
      ::kill(::getpid(), SIGKILL);
    }
    // Final weights: answered by each shard once no learner is registered.
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
        take_buffers(w.meta);
      }
    }
    auto ev = t_.evaluate_test();
    train::TrainState st;
    st.step = static_cast<int64_t>(clock0);
    st.cursor = {cfg_.train.epochs, 0};
    st.config_toml = cfg_.config_toml;
    train::save_checkpoint(opt_.run_dir + "/checkpoint.pt", model, t_.optimizer(), st);
    json fin = {{"test_accuracy", std::isnan(ev.accuracy) ? json() : json(ev.accuracy)}, {"test_loss", ev.loss}, {"test_samples", ev.samples},
                {"clock_shard0", clock0}, {"learner", opt_.learner_id}};
    write_file_atomic(opt_.run_dir + "/final.json", fin.dump(2) + "\n");
    log_info(tag + ": final test accuracy " + std::to_string(100 * ev.accuracy) + "%");
    summary["test_accuracy"] = std::isnan(ev.accuracy) ? json() : json(ev.accuracy);
    summary["test_loss"] = ev.loss;
  }
  return summary;
}

}  // namespace

json run_worker(train::Trainer& trainer, const train::TrainerConfig& cfg, const WorkerOptions& opt,
                const CurveKeys& keys, const std::atomic<bool>& stop) {
  if (opt.servers.empty()) throw InvalidInput("a worker needs --servers (the shards' endpoints, in shard order)");
  Learner l(trainer, cfg, opt, keys);
  return l.run(stop);
}

}  // namespace limbo::ps
