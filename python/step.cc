// The data plan, the step and its reduction, the commit (python/core.h).
#include "core.h"

namespace limbo::python {

bool Core::start() {
  py::gil_scoped_release no_gil;
  if (resume_) session_->resume();
  try {
    session_->start();
  } catch (const train::CompletedElsewhere& e) {
    log_warn(std::string(e.what()) + "; nothing left to train");
    left_ = true;
    return false;
  }
  session_->run_dir().write_config(state_.config_toml);
  window_.reset();
  wall_start_ = Clock::now();
  return true;
}

py::object Core::plan(int64_t epoch, int64_t position, int64_t first_step, int64_t steps_ahead) {
  if (outer_steps_) return plan_inner(epoch, position, steps_ahead);
  if (epoch >= epochs_ || (max_steps_ > 0 && first_step + steps_ahead >= max_steps_)) return py::none();
  std::vector<int64_t> weights;
  if (paces_ && world() > 1) {
    auto w = paces_->weights_for(first_step + steps_ahead);
    if (!w)
      throw InvalidInput("the loader asked for the batch " + std::to_string(steps_ahead) + " steps ahead; with "
                         "shares=\"pace\" and read_ahead=" + std::to_string(paces_->options().lag - 1) +
                         " a batch's share is known " + std::to_string(paces_->options().lag) +
                         " steps ahead: read fewer batches ahead (a DataLoader's num_workers x prefetch_factor), "
                         "limbo.Job(read_ahead=N) for a loader N batches ahead (here at least " +
                         std::to_string(steps_ahead) + "), or shares=\"equal\"");
    weights = std::move(*w);
  }
  auto p = data::plan_batch(*sampler_, {epoch, position}, batch_size_, world(), rank(), drop_last_, weights);
  py::list ids;
  for (int64_t id : p.ids) ids.append(id);
  plans_.push_back(std::move(p));
  return py::make_tuple(ids, plans_.back().end.epoch, plans_.back().end.position);
}

void Core::begin_step() {
  if (plans_.empty()) throw Error("internal: a batch arrived that no plan of this member's sampler made");
  if (in_step_) throw InvalidInput("the previous batch's step was not taken: call job.step() once for every batch");
  plan_ = std::move(plans_.front());
  plans_.pop_front();
  if (!(plan_.begin == state_.cursor) && plan_.begin.position != 0)
    throw Error("internal: the batch does not start at the committed cursor");
  check_model();
  if (full_) units_between_steps();  // the homes hold the committed step; every unit is gathered again
  in_step_ = true;
  step_start_ = Clock::now();
  backward_started_ = false;
  backwards_ = 0;
  // The buffers as before the forward: a step (an inner step too) whose
  // gradient is not finite leaves them so.
  buffers_before_.clear();
  if (!flat_->buffer_entries().empty()) buffers_before_ = flat_->save_buffers();
  if (outer_steps_) return;  // an inner step: no batch policy
  policy_step_ = policy_->step(state_.step, batch_size_ * world());
  if (own_) {
    // Limbo's optimizer: the momentum at a batch change (elastic.momentum)
    // and the square-root rule's betas, as the CLI's steps do.
    auto& opt = opt_->optimizer();
    if (policy_step_.changed && policy_step_.momentum_factor != 1.0)
      rule().scale_momentum(opt, policy_step_.momentum_factor, state_.step);
    opt.set_batch_scale(policy_->options().rule == optim::ScalingRule::Sqrt ? policy_step_.kappa : 1.0);
  }
  // One backward a step: the reduction is armed before forward, so a
  // plain loss.backward() reduces during backward as job.backward() does
  // (the loss, unknown until job.backward() tells it, rides as 0).
  if (accumulate_ == 1) arm(0.0);
}

void Core::backward_starts(double loss, double lr) {
  lr_ = lr;
  need_step("job.backward()");
  if (backwards_ >= accumulate_)
    throw InvalidInput("job.backward() was called " + std::to_string(backwards_ + 1) + " times in one step; "
                       "the job takes " + std::to_string(accumulate_) + " (limbo.Job(accumulate=K) for K "
                       "micro-batches a step)");
  if (backwards_ == 0) {
    // Autograd's gradients land in fresh tensors; the reducer's hook (as
    // each is ready) or the step copies them into the flat gradient.
    flat_->release_grads();
    loss_sum_ = 0;
  }
  backwards_ += 1;
  loss_sum_ += loss;
  if (backward_started_) {  // armed before forward: the loss is known now
    ctx_->loss = loss_sum_;
    rule().set_step_loss(loss_sum_);
    return;
  }
  if (backwards_ < accumulate_ || outer_steps_) return;  // DiLoCo's inner steps reduce nothing
  arm(loss_sum_);
}

void Core::arm(double loss) {
  backward_started_ = true;
  ctx_ = std::make_unique<train::StepContext>(context(loss));
  rule().backward_starts(*ctx_);
}

int Core::step(double loss, double lr) {
  need_step("job.step()");
  lr_ = lr;
  if (backwards_ > 0 && backwards_ < accumulate_)
    throw InvalidInput("job.step() after " + std::to_string(backwards_) + " of the step's " +
                       std::to_string(accumulate_) + " job.backward() calls (accumulate=" +
                       std::to_string(accumulate_) + ")");
  in_step_ = false;
  if (outer_steps_) {
    flat_->attach_grads(/*keep=*/true);
    const bool finite = train::finite_step(flat_->grad(), loss);
    if (finite) {
      py::gil_scoped_release no_gil;  // the user's optimizer takes the GIL back
      opt_->apply(flat_->data(), flat_->grad(), own_ ? lr_ : 1.0);
    } else if (!buffers_before_.empty()) {
      flat_->restore_buffers(buffers_before_);
    }
    outer_steps_->inner_step_done(plan_.ids, loss, finite, seconds_since(step_start_));
    return 2;
  }
  // The user's own loss.backward() (no job.backward()): the loss is not
  // known; the gradient and the step are as with job.backward().
  const bool loss_known = backwards_ > 0;
  if (!loss_known) loss = 0.0;
  // A gradient autograd put elsewhere (zero_grad(set_to_none=True), with
  // no reduction in backward: alone, or not armed) is taken from there; a
  // reduction finished in backward already left every `.grad` the view.
  if (!grads_in_place_) flat_->attach_grads(/*keep=*/true);
  if (!backward_started_) ctx_ = std::make_unique<train::StepContext>(context(loss));
  if (paces_ && plan_.samples() > 0) {  // this member's pace: its forward and backward, not its waits
    auto end = rule().backward_ended();
    if (!end || *end < step_start_) end = Clock::now();
    paces_->record(plan_.samples(), std::chrono::duration<double>(*end - step_start_).count());
  }
  if (grads_in_place_) ctx_->grad_finite = [this] { return flat_->grads_finite(); };
  ctx_->lr = rate();  // armed before forward: this step's rate is known now
  std::optional<train::StepResult> res;
  {
    py::gil_scoped_release no_gil;
    try {
      res = session_->apply(*ctx_, buffers_before_);
    } catch (const train::CompletedElsewhere& e) {
      log_warn(std::string(e.what()) + " (at step " + std::to_string(state_.step) + "); this member ends");
      left_ = true;
      return 0;
    }
  }
  ctx_.reset();
  if (!res) return 0;
  session_->commit(*res, plan_.end, buffers_before_);
  if (!loss_known) res->loss = NAN;
  last_loss_ = res->loss;
  last_global_ = res->global_batch;
  samples_this_run_ += res->global_batch;
  window_.add(res->loss, res->global_batch);
  train_seconds_ += seconds_since(step_start_);  // from the batch's arrival: forward, backward, update
  return 1;
}

bool Core::after_step() {
  log_step();
  py::gil_scoped_release no_gil;
  try {
    if (session_->after_step(epoch(), state_.step % 10 == 0 || plan_.last_in_epoch)) {
      left_ = true;
      elastic::restore_signals();  // it left: a second Ctrl-C acts as before the job
    }
  } catch (const train::CompletedElsewhere& e) {
    log_warn(std::string(e.what()) + "; this member ends");
    left_ = true;
  }
  return left_;
}

std::vector<int64_t> Core::global_ids() {
  const auto& order = sampler_->epoch_order(plan_.begin.epoch);
  return {order.begin() + plan_.begin.position, order.begin() + plan_.begin.position + plan_.global_size};
}

void Core::need_step(const char* what) const {
  if (!in_step_)
    throw InvalidInput(std::string(what) + " outside the training loop: call it for a batch of "
                       "`for batch in job.batches(loader)`, once a batch");
}

train::StepContext Core::context(double loss) {
  return {flat_->data(), flat_->grad(), flat_->grad_with_slot(), loss, plan_.samples(), plan_.global_size,
          rate(), state_.step, {}, {}};
}

void Core::log_step() {
  if (!((window_.steps() > 0 && state_.step % log_every_ == 0) || plan_.last_in_epoch)) return;
  train::StepRecord rec;
  rec.step = state_.step;
  rec.epoch = epoch();
  rec.samples = state_.samples;
  rec.lr_multiplier = policy_step_.multiplier;
  rec.batch_size = last_global_;
  rec.skipped_steps = state_.skipped_steps;
  rec.workers = world();
  if (opt_->clip_norm() > 0 && !std::isnan(opt_->last_norm())) rec.grad_norm = opt_->last_norm();
  auto j = train::step_record(rec, window_);
  session_->add_pace_fields(j, state_.step);
  for (const auto& [k, v] : user_) j[k] = v;
  session_->run_dir().append_metrics(j);
  window_.reset();
  user_.clear();  // job.log()'s numbers go on one line: the next one's are the next steps
}

}  // namespace limbo::python
