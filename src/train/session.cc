#include "train/session.h"

#include <cmath>

#include "common/error.h"
#include "common/files.h"
#include "common/log.h"

namespace limbo::train {

bool recoverable(const Error& e) {
  return dynamic_cast<const PeerFailure*>(&e) != nullptr || dynamic_cast<const Timeout*>(&e) != nullptr;
}

namespace {
constexpr const char* kFrontEndState = "front_end";
}  // namespace

Session::Session(SessionParts parts, std::shared_ptr<UpdateRule> rule, std::unique_ptr<Membership> membership,
                 bool resume, int world, int rank)
    : p_(std::move(parts)),
      rule_(std::move(rule)),
      membership_(std::move(membership)),
      run_dir_(p_.run_dir, resume || membership_ != nullptr),
      world_(world),
      rank_(rank) {
  if (!p_.run_dir.empty()) checkpoint_path_ = p_.run_dir + "/checkpoint.pt";
  shard_path_ = !p_.shard_dir.empty() ? p_.shard_dir + "/checkpoint.pt" : checkpoint_path_;
  if (membership_) storage_ = run_dir_.storage_id();
}

Session::~Session() = default;

void Session::resume() {
  extra_current_ = false;  // the state comes from a checkpoint
  auto& st = p_.state;
  resumed_ = !membership_;
  // A fixed group's member other than 0 has no run directory: it takes
  // member 0's resumed state when the group starts (start()).
  if (checkpoint_path_.empty() && !membership_ && world_ > 1 && rank_ != 0) {
    resumes_from_first_ = true;
    return;
  }
  if (checkpoint_path_.empty() || !file_exists(checkpoint_path_))
    throw InvalidInput("--resume: no checkpoint at '" + checkpoint_path_ + "'");
  const std::string config = st.config_toml;
  // An elastic job whose state is sharded leaves a fully sharded
  // checkpoint's state in its shard files: each member's first re-sharding
  // reads what its new homes need from them (no member holds it whole).
  std::shared_ptr<DeferredShardState> deferred;
  if (membership_ && rule_->takes_deferred_state()) deferred = std::make_shared<DeferredShardState>();
  st = load_checkpoint(checkpoint_path_, p_.model, &p_.opt->optimizer(), deferred.get());
  rule_->set_deferred_state(deferred && deferred->valid() ? deferred : nullptr);
  st.config_toml = config;
  if (auto bp = st.extra.find("batch_policy"); bp != st.extra.end()) p_.policy.load_state(bp->second);
  if (p_.isgd) {
    auto it = st.extra.find("isgd");
    if (it == st.extra.end())
      throw InvalidInput("--resume: checkpoint '" + checkpoint_path_ +
                         "' was written without ISGD state (optim.algorithm differs?)");
    p_.isgd->load_state(it->second);
  }
  if (p_.unpack_extra) {
    auto it = st.extra.find(kFrontEndState);
    if (it == st.extra.end())
      throw InvalidInput("--resume: checkpoint '" + checkpoint_path_ +
                         "' holds no optimizer state of a Python training loop (written by `limbo train`?)");
    p_.unpack_extra(it->second);
  }
  if (p_.load_local) p_.load_local(st.extra);
  log_info("resumed from step " + std::to_string(st.step) + " (epoch " + std::to_string(st.cursor.epoch) +
           ", position " + std::to_string(st.cursor.position) + ")" +
           (deferred && deferred->valid() ? "; the optimizer state is read from its shard files as it is re-sharded"
                                          : ""));
}

void Session::checkpoint(const std::string& why) {
  if (checkpoint_path_.empty() || !writer_) return;
  auto& st = p_.state;
  auto& opt = p_.opt->optimizer();
  if (p_.isgd) st.extra["isgd"] = p_.isgd->state();
  st.extra["batch_policy"] = p_.policy.state();
  if (p_.pack_extra) st.extra[kFrontEndState] = p_.pack_extra();
  if (p_.save_local) p_.save_local(st.extra);
  if (shards_step_ == st.step && rule_->shards_weights()) {
    // The shards are beside it: this file names them, with the flat
    // layout of the weights (every parameter that is a view of it).
    ShardedLayout layout;
    layout.world = shards_world_;  // the group that wrote them (the final gather may have re-formed it since)
    layout.numel = p_.flat.numel();
    const float* base = p_.flat.data().data_ptr<float>();
    for (const auto& p : p_.model.named_parameters(true)) {
      if (p.value().scalar_type() != torch::kFloat32 || p.value().numel() == 0) continue;
      const int64_t at = p.value().data_ptr<float>() - base;
      const auto& t = p.value();
      const bool nhwc = t.dim() == 4 && !t.is_contiguous() && t.is_contiguous(at::MemoryFormat::ChannelsLast);
      if (at >= 0 && at + t.numel() <= layout.numel) layout.params.push_back({p.key(), at, t.numel(), nhwc});
    }
    auto bare = optim::make_optimizer(opt.options());
    bare->set_state({}, opt.steps());
    save_checkpoint(checkpoint_path_, p_.model, *bare, st, &layout);
    remove_other_shards(checkpoint_path_, shards_world_, st.step);
    log_debug("checkpoint (" + why + ") at step " + std::to_string(st.step) + ", in " + std::to_string(shards_world_) +
              " shards");
    return;
  }
  if (opt.has_state() && opt.state()[0].numel() != p_.flat.numel()) {
    // Sharded state that this member does not hold whole (it took over the
    // final files from a writer lost in the job's ending).
    log_warn("checkpoint (" + why + "): this member holds only its shard of the optimizer state; the "
             "checkpoint keeps the weights and the update count without it");
    auto bare = optim::make_optimizer(opt.options());
    bare->set_state({}, opt.steps());
    save_checkpoint(checkpoint_path_, p_.model, *bare, st);
    return;
  }
  save_checkpoint(checkpoint_path_, p_.model, opt, st);
  log_debug("checkpoint (" + why + ") at step " + std::to_string(st.step));
}

void Session::checkpoint_now(const std::string& why) {
  if (write_shards("checkpoint")) {
    checkpoint(why);
    return;
  }
  gather_state("checkpoint", writer_ && !checkpoint_path_.empty());
  checkpoint(why);
  rule_->release_state(p_.opt->optimizer(), p_.state.step);
}

void Session::start() {
  if (membership_) {
    reform("start", Clock::now(), 0.0);
    return;
  }
  if (resumed_) {  // every member of a fixed group resumes alike (--resume): member 0's state to all
    auto& st = p_.state;
    SyncTargets targets{p_.flat.data(), p_.flat.buffers(), p_.opt->optimizer(), st, p_.policy, p_.isgd};
    targets.pack_extra = p_.pack_extra;
    targets.unpack_extra = p_.unpack_extra;
    p_.flat.buffers_to_flat();
    rule_->start_resumed(targets);
    p_.flat.flat_to_buffers();
  } else {
    rule_->start(p_.flat.data(), p_.flat.buffers());
  }
  if (paces_) paces_->reset(world_, p_.state.step);
}

void Session::add_pace_fields(nlohmann::json& record, int64_t step) const {
  if (!paces_ || world_ < 2) return;
  auto rounded = [](std::vector<double> v, double unit) {
    for (double& x : v) x = std::round(x / unit) * unit;
    return v;
  };
  record["shares"] = rounded(paces_->shares_at(step), 1e-4);
  const auto paces = paces_->last_paces();  // samples a second of each member's forward and backward
  if (!paces.empty()) record["paces"] = rounded(paces, 0.1);
}

void Session::reform(const std::string& reason, Clock::time_point detected, double detection) {
  auto& st = p_.state;
  SyncTargets targets{p_.flat.data(), p_.flat.buffers(), p_.opt->optimizer(), st, p_.policy, p_.isgd,
                      storage_, [this] { return run_dir_.read_metrics(); },
                      [this] { return run_dir_.record_count(); }};
  targets.pack_extra = p_.pack_extra;
  targets.unpack_extra = p_.unpack_extra;
  if (p_.extra_only_when_behind) targets.extra_current = &extra_current_;
  p_.flat.buffers_to_flat();  // the module's buffers travel in the state sync
  Membership::Established est;
  std::string why = reason, lost_what;
  for (bool fell_back = false;;) {
    try {
      est = membership_->establish(targets, why);
      break;
    } catch (const StateLost& e) {
      // A second loss ends the job (no checkpoint anywhere, or the
      // checkpoint's holders lost too): never a retry for ever.
      if (fell_back) throw StateLostForGood(lost_what + "; " + e.what());
      fell_back = true;
      lost_what = e.what();
      // Every member saw the same holes: each loads its run directory's
      // newest checkpoint, or forgets its step (the others' is taken).
      const int64_t lost = st.step;
      if (!checkpoint_path_.empty() && file_exists(checkpoint_path_)) {
        resume();
      } else {
        st.step = -1;
      }
      rule_->state_replaced();
      p_.flat.buffers_to_flat();
      std::string what = " (none in this run directory: another member's is taken)";
      if (st.step >= 0)
        what = " (step " + std::to_string(st.step) + " here): " +
               (st.step >= lost ? std::string("no step is lost")
                                : "steps " + std::to_string(st.step + 1) + " to " + std::to_string(lost) +
                                      " are trained again");
      log_warn(std::string(e.what()) + "; falling back to the newest checkpoint" + what);
      why = std::string("optimizer state lost at step ") + std::to_string(lost) +
            ": fell back to the newest checkpoint";
    }
  }
  p_.flat.flat_to_buffers();
  world_ = est.world;
  rank_ = est.rank;
  writer_ = est.writes_run_dir;
  run_dir_.set_writer(writer_);
  run_dir_.replace_records(est.records);  // a copy that was behind now holds the whole run
  if (rank_ == 0) run_dir_.set_mirror([m = membership_.get()](const nlohmann::json& rec) { m->publish_record(rec); });
  else run_dir_.set_mirror(nullptr);
  pending_event_ = est.event;
  pending_event_["detection_seconds"] = detection;
  pending_since_ = detected;
  if (paces_) paces_->reset(world_, st.step);
  if (on_reform_) on_reform_(est);
  std::string shards;
  if (est.event.contains("shard_bytes_received"))
    shards = "; optimizer state: " + std::to_string(est.event["shard_bytes_received"].get<int64_t>()) +
             " bytes received (this worker's shard), " + std::to_string(est.event["shard_bytes_sent"].get<int64_t>()) +
             " bytes of weights and state sent";
  log_info("membership round " + std::to_string(est.event["round"].get<int64_t>()) + ": " +
           std::to_string(world_) + " workers, rank " + std::to_string(rank_) + ", " +
           est.event.value("transport", std::string("gloo")) + " (" + reason + ")" + shards);
}

void Session::gather_state(const std::string& why, bool here) {
  for (;;) {
    const auto t0 = Clock::now();
    try {
      rule_->gather_state(p_.opt->optimizer(), p_.state.step, here);
      return;
    } catch (const Error& e) {
      if (!membership_ || !recoverable(e)) throw;
      log_warn("gathering the optimizer state (" + why + ") failed: " + e.what());
      reform(std::string("failure while gathering the optimizer state: ") + e.what(), t0, seconds_since(t0));
    }
  }
}

bool Session::write_shards(const std::string& why) {
  if (!rule_->shards_weights()) return false;
  for (;;) {
    const auto t0 = Clock::now();
    try {
      if (!rule_->write_shards(shard_path_, p_.state.step)) return false;
      shards_step_ = p_.state.step;
      shards_world_ = world_;
      return true;
    } catch (const Error& e) {
      if (!membership_ || !recoverable(e)) throw;
      log_warn("writing the shards of the checkpoint (" + why + ") failed: " + e.what());
      reform(std::string("failure while writing the checkpoint's shards: ") + e.what(), t0, seconds_since(t0));
    }
  }
}

bool Session::collective(const std::string& what, const std::function<void()>& f) {
  const auto t0 = Clock::now();
  try {
    f();
    return true;
  } catch (const Error& e) {
    if (!membership_ || !recoverable(e)) throw;
    log_warn(what + " failed: " + e.what());
    reform(std::string("failure during ") + what + ": " + e.what(), t0, seconds_since(t0));
    return false;
  }
}

std::optional<StepResult> Session::apply(StepContext& ctx, const std::vector<torch::Tensor>& buffers_before) {
  const auto apply_start = Clock::now();
  try {
    return rule_->apply(ctx);
  } catch (const Error& e) {
    if (!membership_ || !recoverable(e)) throw;
    // The step did not commit here: re-form, take the newest state, redo.
    if (!buffers_before.empty()) p_.flat.restore_buffers(buffers_before);
    log_warn(std::string("step ") + std::to_string(p_.state.step + 1) + " failed: " + e.what());
    reform(std::string("failure: ") + e.what(), apply_start, seconds_since(apply_start));
    return std::nullopt;
  }
}

// A step whose gradient or loss was not finite: the weights did not move
// (on every member alike); the buffers go back to before its forward. Its
// batch counts as seen, as with PyTorch's GradScaler. Too many in a row end
// the run: the model has diverged.
void Session::commit(const StepResult& res, const data::Cursor& end, const std::vector<torch::Tensor>& buffers_before) {
  auto& st = p_.state;
  if (res.skipped) {
    if (!buffers_before.empty()) p_.flat.restore_buffers(buffers_before);
    st.skipped_steps += 1;
    st.skipped_in_a_row += 1;
    const int64_t limit = p_.max_nonfinite_steps;
    log_warn("step " + std::to_string(st.step + 1) + " skipped: the " + (world_ > 1 ? "reduced " : "") +
             "gradient or loss is not finite (loss " + std::to_string(res.loss) + "; " +
             std::to_string(st.skipped_in_a_row) + " in a row)");
    if (limit > 0 && st.skipped_in_a_row >= limit)
      throw Diverged(std::to_string(st.skipped_in_a_row) + " steps in a row (steps " +
                     std::to_string(st.step + 2 - st.skipped_in_a_row) + " to " + std::to_string(st.step + 1) +
                     ") had a gradient or loss that is not finite; "
                     "the model has diverged. Lower optim.lr, check the data for NaN or inf, or use "
                     "comm.compression = \"bf16\" instead of \"fp16\" (train.max_nonfinite_steps "
                     "sets how many are allowed)");
  } else {
    st.skipped_in_a_row = 0;
  }
  // Commit: from here this step counts (state sync takes the newest step).
  st.step += 1;
  st.samples += res.global_batch;
  st.cursor = end;
  if (!pending_event_.is_null()) {
    pending_event_["first_step_seconds"] = seconds_since(pending_since_);
    if (pending_event_["reason"] != "start") {
      changes_ += 1;
      recoveries_.push_back(pending_event_["first_step_seconds"]);
    }
    run_dir_.append_metrics(pending_event_);
    pending_event_ = nullptr;
  }
}

bool Session::after_step(double epoch, bool publish) {
  if (!membership_) return false;
  if (rank0() && publish) membership_->publish_progress(epoch);
  if (!membership_->change_agreed()) return false;
  // Sharded state: every member holds it whole across the change (a
  // leaving member's shard stays with the others; a joiner gets its own).
  // Sharded weights too: never whole; the shards go to disk for a leaving
  // writer's checkpoint, and the state sync re-shards from the homes.
  if (!write_shards("membership change")) gather_state("membership change", true);
  if (membership_->leaving()) {
    // A member leaving at the request of the job (the launcher stopping
    // it: Ctrl-C, SIGTERM) may be the last: the writer checkpoints first.
    checkpoint("leaving after step " + std::to_string(p_.state.step));
    membership_->leave();
    log_info("leaving the job after step " + std::to_string(p_.state.step));
    return true;
  }
  reform("membership change agreed after step " + std::to_string(p_.state.step), Clock::now(), 0.0);
  return false;
}

bool Session::gather_final(bool here) {
  try {
    // Sharded weights: the final checkpoint in shards, then the weights
    // whole on every member (the model the program holds after training).
    if (write_shards("final checkpoint")) {
      here = false;
      rule_->drop_saved_state();  // in the checkpoint now: the whole weights take its place
    }
    gather_state("final checkpoint", here);
    return true;
  } catch (const CompletedElsewhere& e) {
    log_warn(std::string(e.what()) + " (at step " + std::to_string(p_.state.step) +
             ", gathering the state for the final checkpoint); this member ends");
    return false;
  }
}

void Session::training_done() {
  if (!membership_) return;
  membership_->publish_done();  // the launcher ends the job on this
  membership_->leave();         // done: not a failure for the coordinator
}

bool Session::writes_final() {
  if (!membership_ || writer_ || storage_ == 0) return true;
  // The member writing this storage's run directory may die while the
  // job ends: the next member of the storage takes over.
  if (membership_->wait_final(storage_)) return false;
  log_warn("the member writing " + p_.run_dir + " is gone before it wrote the final checkpoint and "
           "summary; this member writes them");
  writer_ = true;
  took_over_ = true;
  run_dir_.set_writer(true);
  return true;
}

void Session::final_written() {
  if (membership_ && writer_) membership_->publish_final(storage_);
}

}  // namespace limbo::train
