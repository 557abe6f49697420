// Records, checkpoints, the final state and summary (python/core.h).
#include "core.h"

namespace limbo::python {

void Core::checkpoint(const std::string& why) {
  py::gil_scoped_release no_gil;
  session_->checkpoint_now(why);
}

void Core::log(const py::dict& metrics) {
  for (const auto& [k, v] : metrics) user_[py::str(k).cast<std::string>()] = py::float_(v.cast<py::object>()).cast<double>();
}

void Core::record(const std::string& kind, const py::dict& fields) {
  nlohmann::json rec = {{"kind", kind}, {"step", state_.step}, {"epoch", epoch()}};
  for (const auto& [k, v] : fields) rec[py::str(k).cast<std::string>()] = py::float_(v.cast<py::object>()).cast<double>();
  session_->run_dir().append_metrics(rec);
}

bool Core::end_training() {
  py::gil_scoped_release no_gil;
  if (!session_->gather_final(session_->writer())) {
    left_ = true;
    elastic::restore_signals();
    return false;
  }
  session_->training_done();
  // Training is over: Ctrl-C and SIGTERM act as they did before the job
  // (during evaluation or whatever the program does next).
  if (get_leave_) elastic::restore_signals();
  return true;
}

std::string Core::finish(const py::dict& fields) {
  nlohmann::json s = {{"train_loss", std::isnan(last_loss_) ? nlohmann::json() : nlohmann::json(last_loss_)},
                      {"epochs", epoch()},
                      {"steps", state_.step},
                      {"samples", state_.samples},
                      {"skipped_steps", state_.skipped_steps},
                      {"wall_seconds", seconds_since(wall_start_)},
                      {"train_seconds", train_seconds_},
                      {"samples_per_second", train_seconds_ > 0 ? samples_this_run_ / train_seconds_ : 0.0},
                      {"front_end", "python"},
                      {"trainable_parameters", flat_->numel()},
                      {"parameters", flat_->numel() + flat_->frozen_numel()},
                      {"update_rule", rule().name()},
                      {"workers", world()}};
  if (session_->elastic()) {
    s["membership_changes"] = session_->membership_changes();
    s["recovery_seconds"] = session_->recoveries();
  }
  if (auto rs = rule().summary(); !rs.empty()) s["communication"] = rs;
  s["sync"] = outer_steps_ ? "diloco" : "step";
  if (outer_steps_) s.update(outer_steps_->summary());
  nlohmann::json eval = {{"kind", "eval"}, {"step", state_.step}, {"epoch", epoch()}, {"train_seconds", train_seconds_}};
  for (const auto& [k, v] : fields) {
    const std::string key = py::str(k).cast<std::string>();
    if (v.is_none()) s[key] = nullptr;
    else if (py::isinstance<py::str>(v)) s[key] = v.cast<std::string>();
    else s[key] = eval[key] = py::float_(v.cast<py::object>()).cast<double>();
  }
  py::gil_scoped_release no_gil;
  if (!session_->writes_final()) return s.dump();
  if (eval.size() > 4 || session_->took_over()) {
    if (session_->took_over()) eval["taken_over"] = true;
    session_->run_dir().append_metrics(eval);
  }
  session_->checkpoint("final");
  session_->run_dir().write_summary(s);
  session_->final_written();
  return s.dump();
}

void Core::gather_weights() {
  if (!full_) return;
  py::gil_scoped_release no_gil;
  // The session's gather: the weights whole (the rule gathers them first),
  // retried across a re-formation; the optimizer state kept nowhere.
  session_->gather_state("full_state_dict()", false);
}

py::dict Core::optimizer_state() {
  {
    py::gil_scoped_release no_gil;
    session_->gather_state("optimizer_state()", true);
  }
  auto& opt = opt_->optimizer();
  py::dict d;
  const auto names = opt.state_names();
  for (size_t i = 0; i < names.size() && opt.has_state(); ++i) d[py::str(names[i])] = opt.state()[i].clone();
  d["step"] = opt.steps();
  return d;
}

}  // namespace limbo::python
