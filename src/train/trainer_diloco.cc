// DiLoCo's outer step in the CLI's trainer (elastic.sync = "diloco"): the
// inner steps on this member's share of train/outer_steps.h's outer step,
// with the trainer's data, model and inner optimizer; records and the
// sample log.
#include <signal.h>
#include <unistd.h>

#include <cmath>
#include <cstdio>

#include "common/error.h"
#include "common/log.h"
#include "train/trainer_run.h"

namespace limbo::train {

namespace {

// The member whose testing aid says so dies here (train.testing_die_at_step
// counts outer steps under DiLoCo).
void die_for_test(const char* where, int rank, int64_t step, bool freeze, bool with_host) {
  std::fprintf(stderr, "testing: rank %d %s %s of outer step %ld%s\n", rank, freeze ? "freezes" : "dies", where,
               static_cast<long>(step + 1), with_host ? " with its host" : "");
  std::fflush(stderr);
  if (with_host) kill_this_host(freeze ? SIGSTOP : SIGKILL);
  ::kill(::getpid(), freeze ? SIGSTOP : SIGKILL);
}

}  // namespace

void Trainer::diloco_state_hooks(SessionParts& parts) {
  // The inner optimizer is each member's own: checkpoints keep the
  // writer's, and a resumed run gives it to every member; state sync does
  // not move it (a joiner's starts afresh). Inner steps run ahead of the
  // last commit (streaming's overlap) are not committed: the checkpoint
  // keeps the state before them, as a resumed run starts that unit afresh.
  parts.save_local = [this](std::map<std::string, torch::Tensor>& extra) {
    auto& inner = opt_->optimizer();
    const auto* ahead = outer_steps_ ? outer_steps_->inner_before_ahead() : nullptr;
    const auto& state = ahead ? ahead->tensors : inner.state();
    extra["diloco_inner/steps"] = torch::tensor({ahead ? ahead->steps : inner.steps()}, torch::kInt64);
    const auto names = inner.state_names();
    for (size_t i = 0; i < state.size() && i < names.size(); ++i) extra["diloco_inner/" + names[i]] = state[i];
  };
  parts.load_local = [this](const std::map<std::string, torch::Tensor>& extra) {
    auto& inner = opt_->optimizer();
    const auto steps = extra.find("diloco_inner/steps");
    if (steps == extra.end()) return;
    std::vector<torch::Tensor> st;
    for (const auto& name : inner.state_names()) {
      const auto it = extra.find("diloco_inner/" + name);
      if (it == extra.end() || it->second.numel() != flat_->numel()) {
        st.clear();
        break;
      }
      st.push_back(it->second.to(torch::kFloat32).contiguous().clone());
    }
    inner.set_state(std::move(st), st.empty() ? 0 : steps->second.item<int64_t>());
  };
}

bool Trainer::outer_step(Run& r) {
  auto& o = *outer_steps_;
  const auto& t = r.t;
  auto work = o.begin();
  if (!work) return false;  // re-formed while agreeing
  const bool dies = t.die_at_step > 0 && !t.die_in_gather && state_.step == t.die_at_step && r.s.rank() == t.die_rank &&
                    r.s.world() > 1 && r.s.membership_changes() == t.die_after_changes;
  auto& inner = *opt_;
  // Inner steps on a unit's batches (this one's, or the next one's first,
  // run ahead while a streaming sync is on the wire).
  auto run_inner = [&](const OuterSteps::Work& w, bool ahead) {
    const int64_t steps = static_cast<int64_t>(w.batches.size());
    for (int64_t i = 0; i < steps; ++i) {
      if (!o.keep_going()) break;
      if (!ahead && dies && !t.die_in_outer && w.first + i >= (w.first + steps) / 2)
        die_for_test("halfway through the inner steps", r.s.rank(), state_.step, t.die_by_freezing, t.die_with_host);
      const auto& ids = w.batches[i];
      auto batch = data::make_train_batch(splits_->train, norm_, ids, w.epoch, cfg_.loader.augment);
      r.lr = schedule_->lr(o.inner_epoch(w.first + i), o.inner_iteration(w.first + i));
      // A step whose gradient is not finite leaves the buffers (BatchNorm's
      // statistics, which its forward moved) as before it.
      std::vector<torch::Tensor> buffers_before;
      if (!flat_->buffer_entries().empty()) buffers_before = flat_->save_buffers();
      const auto t0 = Clock::now();
      const double loss = step_->gradient(batch);
      const double compute = seconds_since(t0);  // forward and backward: the compute share's numerator
      const bool finite = finite_step(flat_->grad(), loss);
      if (finite) inner.apply(flat_->data(), flat_->grad(), r.lr);
      else if (!buffers_before.empty()) flat_->restore_buffers(buffers_before);
      o.inner_step_done(ids, loss, finite, compute);
    }
  };
  run_inner(*work, false);
  const data::Cursor begin = state_.cursor;
  auto c = o.finish(
      [&](bool redo) {
        if (dies && t.die_in_outer && !redo)
          die_for_test("as the outer all-reduce starts", r.s.rank(), state_.step, t.die_by_freezing, t.die_with_host);
      },
      [&](const OuterSteps::Work& ahead) { run_inner(ahead, true); });
  if (!c) return false;  // re-formed: the outer step is redone (or was committed elsewhere)
  r.res = c->res;
  data::BatchPlan& bp = r.batch.plan;
  bp.begin = begin;
  bp.end = c->settled.cursor;
  bp.global_size = c->res.global_batch;
  bp.last_in_epoch = c->settled.last_in_epoch;
  r.epoch_progress = r.epoch_now(state_.cursor);
  if (t.sample_log && !cfg_.run_dir.empty()) {
    std::vector<int64_t> ids;
    const auto& order = o.epoch_order(c->epoch);
    for (int64_t pos : c->settled.committed) ids.push_back(order[pos]);
    log_committed_ids(cfg_.run_dir, state_.step, c->epoch, ids);
    // What this member's inner steps really trained for it (a testing
    // aid: the committed ids above come from the plan).
    log_trained_ids(cfg_.run_dir, state_.step, c->epoch, c->trained);
  }
  r.run_dir.append_metrics(o.record(*c, r.epoch_now(state_.cursor), r.s.world()));
  r.samples_this_run += r.res.global_batch;
  r.last_loss = r.res.loss;
  r.window.add(r.res.loss, r.res.global_batch);
  r.train_seconds += c->wall_seconds;
  r.compute_seconds += c->compute_seconds;
  return true;
}

}  // namespace limbo::train
