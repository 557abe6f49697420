// sync="diloco" from Python: inner steps and the outer step (python/core.h).
#include "core.h"

namespace limbo::python {

py::object Core::plan_inner(int64_t epoch, int64_t position, int64_t k) {
  if (complete()) return py::none();
  if (k == 0) {
    py::gil_scoped_release no_gil;
    work_.reset();
    try {
      work_ = outer_steps_->begin();
    } catch (const train::CompletedElsewhere& e) {
      log_warn(std::string(e.what()) + "; this member ends");
      left_ = true;
    }
  }
  if (!work_ || k >= static_cast<int64_t>(work_->batches.size()) || !outer_steps_->keep_going()) return py::none();
  data::BatchPlan p;
  p.ids = work_->batches[static_cast<size_t>(k)];
  p.begin = p.end = state_.cursor;
  p.global_size = static_cast<int64_t>(p.ids.size());
  py::list ids;
  for (int64_t id : p.ids) ids.append(id);
  plans_.push_back(std::move(p));
  inner_index_ = k;
  return py::make_tuple(ids, epoch, position);
}

bool Core::outer_finish() {
  std::optional<train::OuterSteps::Committed> c;
  {
    py::gil_scoped_release no_gil;
    try {
      c = outer_steps_->finish();
    } catch (const train::CompletedElsewhere& e) {
      log_warn(std::string(e.what()) + " (at outer step " + std::to_string(state_.step) + "); this member ends");
      left_ = true;
      return false;
    }
  }
  work_.reset();
  if (!c) return false;
  const auto& order = outer_steps_->epoch_order(c->epoch);
  committed_epoch_ = c->epoch;
  committed_.clear();
  for (int64_t pos : c->settled.committed) committed_.push_back(order[pos]);
  last_loss_ = c->res.loss;
  last_global_ = c->res.global_batch;
  samples_this_run_ += c->res.global_batch;
  window_.add(c->res.loss, c->res.global_batch);
  train_seconds_ += c->wall_seconds;
  plan_.last_in_epoch = c->settled.last_in_epoch;
  session_->run_dir().append_metrics(outer_steps_->record(*c, epoch(), world()));
  return true;
}

}  // namespace limbo::python
