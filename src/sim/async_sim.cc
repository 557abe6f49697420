#include "sim/async_sim.h"

#include <torch/torch.h>

#include <chrono>
#include <cmath>
#include <map>
#include <queue>
#include <random>
#include <set>

#include "common/error.h"
#include "common/timing.h"
#include "common/log.h"
#include "data/loader.h"
#include "ps/leases.h"
#include "ps/staleness.h"
#include "train/run_dir.h"

namespace limbo::sim {
namespace {

using json = nlohmann::json;

enum class EventKind { PullArrives, WeightsArrive, ComputeDone, PushArrives };

struct Event {
  double time;
  uint64_t order;  // creation order: ties are broken deterministically
  EventKind kind;
  int learner;
  bool operator>(const Event& o) const { return time != o.time ? time > o.time : order > o.order; }
};

struct VirtualLearner {
  double speed = 1.0;  // compute-time multiplier (mixed speeds)
  std::shared_ptr<torch::Tensor> snapshot;  // weights it pulled (shared with the shard)
  uint64_t pulled_clock = 0;
  ps::Lease lease;
  bool has_lease = false;
  bool done = false;
  int64_t steps = 0;
  double busy = 0;  // virtual seconds computing
};

class AsyncSim {
 public:
  AsyncSim(train::Trainer& t, const train::TrainerConfig& cfg, const AsyncSimOptions& opt)
      : t_(t), cfg_(cfg), opt_(opt), agg_(opt.agg), rng_(opt.seed), run_(opt.run_dir, false) {
    if (opt_.learners < 1) throw InvalidInput("sim.learners must be >= 1");
    if (opt_.compute.mean <= 0) throw InvalidInput("sim.compute_mean must be > 0");
    if (opt_.net_delay < 0) throw InvalidInput("sim.net_delay must be >= 0");
    auto& flat = t_.params();
    state_ = std::make_unique<ps::ShardState>(flat.numel(), flat.data().data_ptr<float>(), opt_.update);
    book_ = std::make_unique<ps::LeaseBook>(t_.data().train.size(), cfg_.loader.batch_size, cfg_.train.epochs);
    learners_.resize(static_cast<size_t>(opt_.learners));
    const int slow = static_cast<int>(std::lround(opt_.compute.straggler_fraction * opt_.learners));
    for (int i = 0; i < opt_.learners; ++i) {
      agg_.add_learner(static_cast<uint32_t>(i));
      if (opt_.compute.kind == ComputeKind::Mixed && i < slow) learners_[i].speed = opt_.compute.straggler_factor;
    }
  }

  json run();

 private:
  void schedule(double at, EventKind k, int l) { events_.push({at, next_order_++, k, l}); }

  double compute_time(int l) {
    const ComputeModel& c = opt_.compute;
    double x = c.mean;
    switch (c.kind) {
      case ComputeKind::Constant:
      case ComputeKind::Mixed: break;
      case ComputeKind::Normal: x = std::normal_distribution<double>(c.mean, c.cv * c.mean)(rng_); break;
      case ComputeKind::LongTail: {
        // Lognormal with the given mean: mu = ln(mean) - sigma^2 / 2.
        double sigma = c.cv;
        x = std::lognormal_distribution<double>(std::log(c.mean) - sigma * sigma / 2, sigma)(rng_);
        break;
      }
    }
    return std::max(0.05 * c.mean, x) * learners_[l].speed;
  }

  // The shard answers a learner's pull (weights + its next batch).
  void answer_pull(int l, double now) {
    VirtualLearner& L = learners_[l];
    ps::Lease lease;
    auto r = book_->next(static_cast<uint32_t>(l), lease);
    if (r == ps::LeaseBook::Next::Done) {
      L.done = true;
      agg_.remove_learner(static_cast<uint32_t>(l));  // as a real learner says bye
      after_change(now);
      return;
    }
    if (r == ps::LeaseBook::Next::Wait) {  // all batches out: ask again later
      schedule(now + std::max(opt_.net_delay, 1e-3) * 2, EventKind::PullArrives, l);
      return;
    }
    L.lease = lease;
    L.has_lease = true;
    L.snapshot = state_->weights();
    L.pulled_clock = agg_.clock();
    agg_.on_pull(static_cast<uint32_t>(l));
    track_snapshots();
    schedule(now + opt_.net_delay, EventKind::WeightsArrive, l);
  }

  void start_compute(int l, double now) {
    double c = compute_time(l);
    learners_[l].busy += c;
    if (opt_.cores > 0) busy_cores_ += 1;
    schedule(now + c, EventKind::ComputeDone, l);
  }

  void on_pull(int l, double now) {
    if (agg_.may_pull(static_cast<uint32_t>(l))) answer_pull(l, now);
    else held_.push_back(l);
  }

  void after_change(double now) {
    while (agg_.ready()) {
      auto taus = agg_.commit();
      state_->apply(static_cast<int64_t>(taus.size()));
      record(taus, now);
    }
    for (size_t i = 0; i < held_.size();) {
      int l = held_[i];
      if (agg_.may_pull(static_cast<uint32_t>(l))) {
        held_.erase(held_.begin() + static_cast<long>(i));
        answer_pull(l, now);
      } else {
        ++i;
      }
    }
  }

  // The push of learner l arrives: compute its gradient on the snapshot it
  // pulled, then do exactly what a shard does with a push.
  void on_push(int l, double now) {
    VirtualLearner& L = learners_[l];
    auto& flat = t_.params();
    ps::copy_floats(flat.data().data_ptr<float>(), L.snapshot->data_ptr<float>(),
                    static_cast<size_t>(flat.numel()) * 4);
    auto g0 = Clock::now();
    double loss = gradient_on(L);  // the work a real learner does: batch, forward, backward
    grad_seconds_ += seconds_since(g0);
    L.snapshot.reset();
    track_snapshots();
    L.steps += 1;
    loss_window_ += loss;
    loss_n_ += 1;
    auto offer = agg_.offer(static_cast<uint32_t>(l), L.pulled_clock);
    book_->complete(L.lease.id);
    L.has_lease = false;
    if (offer.outcome == ps::Aggregator::Offer::Dropped) {
      dropped_ += 1;
    } else if (offer.outcome == ps::Aggregator::Offer::Accepted) {
      const bool single = agg_.pending() == 1 && agg_.ready();
      const float* g = t_.params().grad().data_ptr<float>();
      if (single ? !state_->step_single(g, offer.alpha) : !state_->accumulate(g, offer.alpha)) {
        agg_.retract(static_cast<uint32_t>(l), L.pulled_clock);
        rejected_ += 1;
      } else {
        accepted_ += 1;
        if (single) record(agg_.commit(), now);
      }
    } else {
      rejected_ += 1;
    }
    after_change(now);
    // The next pull travels right behind the push (as a real learner's does).
    on_pull(l, now);
  }

  double gradient_on(VirtualLearner& L) {
    const auto& order = sampler_->epoch_order(L.lease.epoch);
    std::vector<int64_t> ids(order.begin() + L.lease.position, order.begin() + L.lease.position + L.lease.count);
    auto batch = data::make_train_batch(t_.data().train, t_.normalization(), ids, L.lease.epoch, cfg_.loader.augment);
    const double loss = t_.step().gradient(batch);
    // A learner clips its own gradient before the push.
    if (cfg_.clip_grad_norm > 0) optim::clip_grad_norm(t_.params().grad(), cfg_.clip_grad_norm);
    return loss;
  }

  void track_snapshots() {
    std::set<const void*> distinct;
    for (const auto& L : learners_)
      if (L.snapshot) distinct.insert(L.snapshot.get());
    distinct.insert(state_->weights().get());
    peak_versions_ = std::max(peak_versions_, static_cast<int64_t>(distinct.size()));
  }

  void record(const std::vector<int64_t>& taus, double now) {
    updates_ += 1;
    window_updates_ += 1;
    for (int64_t t : taus) {
      hist_[t] += 1;
      window_hist_[t] += 1;
    }
    if (window_updates_ >= opt_.log_every) log_window(now);
  }

  void log_window(double now) {
    run_.append_metrics({{"kind", "sim_updates"}, {"virtual_time", now}, {"clock", agg_.clock()},
                         {"updates", window_updates_}, {"epoch", book_->epoch_progress()},
                         {"loss", loss_n_ ? loss_window_ / loss_n_ : 0.0}, {"learners", agg_.learners()},
                         {"c", agg_.c()}, {"staleness_hist", ps::hist_to_json(window_hist_)},
                         {"lr", opt_.agg.alpha0}});
    window_hist_.clear();
    window_updates_ = 0;
    loss_window_ = 0;
    loss_n_ = 0;
  }

  train::Trainer& t_;
  const train::TrainerConfig& cfg_;
  AsyncSimOptions opt_;
  ps::Aggregator agg_;
  std::mt19937_64 rng_;
  train::RunDir run_;
  std::unique_ptr<ps::ShardState> state_;
  std::unique_ptr<ps::LeaseBook> book_;
  std::unique_ptr<data::Sampler> sampler_;
  std::vector<VirtualLearner> learners_;
  std::priority_queue<Event, std::vector<Event>, std::greater<Event>> events_;
  uint64_t next_order_ = 0;
  std::vector<int> held_;
  std::vector<int> waiting_;  // learners waiting for a core
  int busy_cores_ = 0;
  int64_t updates_ = 0, accepted_ = 0, dropped_ = 0, rejected_ = 0, peak_versions_ = 0, window_updates_ = 0;
  int64_t loss_n_ = 0;
  double loss_window_ = 0, grad_seconds_ = 0;
  ps::StalenessHist hist_, window_hist_;
};

json AsyncSim::run() {
  sampler_ = std::make_unique<data::Sampler>(t_.data().train.size(), cfg_.loader.order, cfg_.loader.seed);
  if (run_.enabled()) run_.write_config(cfg_.config_toml);
  auto wall0 = Clock::now();
  for (int l = 0; l < opt_.learners; ++l) schedule(opt_.net_delay, EventKind::PullArrives, l);
  double now = 0;
  while (!events_.empty()) {
    Event e = events_.top();
    events_.pop();
    now = e.time;
    switch (e.kind) {
      case EventKind::PullArrives: on_pull(e.learner, now); break;
      case EventKind::WeightsArrive:
        if (opt_.cores > 0 && busy_cores_ >= opt_.cores) waiting_.push_back(e.learner);
        else start_compute(e.learner, now);
        break;
      case EventKind::ComputeDone:
        schedule(now + opt_.net_delay, EventKind::PushArrives, e.learner);
        if (opt_.cores > 0) {
          busy_cores_ -= 1;
          if (!waiting_.empty()) {
            int next = waiting_.front();
            waiting_.erase(waiting_.begin());
            start_compute(next, now);
          }
        }
        break;
      case EventKind::PushArrives: on_push(e.learner, now); break;
    }
  }
  if (window_updates_ > 0) log_window(now);
  const double wall = seconds_since(wall0);
  // Final weights, evaluated.
  auto& flat = t_.params();
  ps::copy_floats(flat.data().data_ptr<float>(), state_->weights()->data_ptr<float>(),
                  static_cast<size_t>(flat.numel()) * 4);
  auto ev = t_.evaluate_test();
  const ps::StalenessStats st = ps::staleness_stats(hist_);
  json per = json::array();
  for (const auto& L : learners_) per.push_back({{"steps", L.steps}, {"speed", L.speed}, {"busy_virtual_seconds", L.busy}});
  const double bytes = static_cast<double>(flat.numel()) * 4;
  json s = {{"mode", "sim-async"}, {"learners", opt_.learners}, {"protocol", ps::protocol_name(opt_.agg.protocol)},
            {"softsync_n", opt_.agg.softsync_n}, {"staleness_policy", ps::policy_name(opt_.agg.policy)},
            {"updates", updates_}, {"gradients_accepted", accepted_}, {"gradients_dropped", dropped_},
            {"gradients_rejected", rejected_}, {"staleness_mean", st.mean},
            {"staleness_p99", st.p99}, {"staleness_max", st.max}, {"staleness_hist", ps::hist_to_json(hist_)},
            {"virtual_seconds", now},
            {"wall_seconds", wall}, {"gradient_seconds", grad_seconds_},
            {"overhead_fraction", grad_seconds_ > 0 ? (wall - grad_seconds_) / grad_seconds_ : 0.0},
            {"snapshot_versions_peak", peak_versions_}, {"snapshot_bytes_peak", peak_versions_ * bytes},
            {"per_learner", per}, {"epochs", book_->epoch_progress()}};
  s.update(train::eval_fields(ev));
  json rec = {{"kind", "eval"}, {"epoch", book_->epoch_progress()}, {"virtual_time", now}};
  rec.update(train::eval_fields(ev));
  run_.append_metrics(rec);
  if (run_.enabled()) run_.write_summary(s);
  return s;
}

}  // namespace

ComputeKind parse_compute_kind(const std::string& s) {
  if (s == "constant") return ComputeKind::Constant;
  if (s == "normal") return ComputeKind::Normal;
  if (s == "longtail") return ComputeKind::LongTail;
  if (s == "mixed") return ComputeKind::Mixed;
  throw InvalidInput("unknown compute-time distribution '" + s + "' (constant, normal, longtail, mixed)");
}

json run_async_sim(train::Trainer& trainer, const train::TrainerConfig& cfg, const AsyncSimOptions& opt) {
  AsyncSim sim(trainer, cfg, opt);
  return sim.run();
}

}  // namespace limbo::sim
