#include "train/step.h"

#include <ATen/autocast_mode.h>

#include <cmath>
#include <cstdlib>
#include <fstream>
#include <numeric>
#include <thread>

#include "common/error.h"
#include "common/log.h"
#include "data/tensor_dataset.h"
#include "optim/adam.h"

namespace limbo::train {
namespace nnf = torch::nn::functional;

LossKind parse_loss(const std::string& name) {
  if (name == "cross_entropy") return LossKind::CrossEntropy;
  if (name == "mse") return LossKind::Mse;
  if (name == "module") return LossKind::Module;
  throw InvalidInput("unknown model.loss '" + name + "'; allowed: cross_entropy, mse, module");
}

const char* loss_name(LossKind k) {
  switch (k) {
    case LossKind::CrossEntropy: return "cross_entropy";
    case LossKind::Mse: return "mse";
    case LossKind::Module: return "module";
  }
  return "?";
}

namespace {

// torch.autocast("cpu", dtype=torch.bfloat16) for the current thread; the
// cache of casted weights lives for one forward.
class CpuAutocast {
 public:
  explicit CpuAutocast(bool on) : on_(on) {
    if (!on_) return;
    was_enabled_ = at::autocast::is_cpu_enabled();
    was_dtype_ = at::autocast::get_autocast_cpu_dtype();
    at::autocast::set_cpu_enabled(true);
    at::autocast::set_autocast_cpu_dtype(at::kBFloat16);
    at::autocast::increment_nesting();
  }
  ~CpuAutocast() {
    if (!on_) return;
    if (at::autocast::decrement_nesting() == 0) at::autocast::clear_cache();
    at::autocast::set_cpu_enabled(was_enabled_);
    at::autocast::set_autocast_cpu_dtype(was_dtype_);
  }
  CpuAutocast(const CpuAutocast&) = delete;
  CpuAutocast& operator=(const CpuAutocast&) = delete;

 private:
  bool on_;
  bool was_enabled_ = false;
  at::ScalarType was_dtype_ = at::kBFloat16;
};

torch::Tensor as_float(const torch::Tensor& t) {
  return t.defined() && t.scalar_type() == torch::kBFloat16 ? t.to(torch::kFloat32) : t;
}

}  // namespace

bool cpu_has_bf16() {
  static const bool has = [] {
    if (const char* e = std::getenv("LIMBO_TESTING_NO_BF16"); e && std::string(e) == "1") return false;
    std::ifstream in("/proc/cpuinfo");
    for (std::string line; std::getline(in, line);)
      if (line.rfind("flags", 0) == 0)
        return line.find(" avx512_bf16") != std::string::npos || line.find(" amx_bf16") != std::string::npos;
    return false;
  }();
  return has;
}

torch::Tensor TrainStep::forward(const torch::Tensor& x) {
  CpuAutocast autocast(bf16_);
  return as_float(net_.forward(x));
}

torch::Tensor TrainStep::predict(const torch::Tensor& x) {
  CpuAutocast autocast(bf16_);
  return as_float(net_.predict(x));
}

torch::Tensor TrainStep::module_loss(const torch::Tensor& x, const torch::Tensor& y) {
  CpuAutocast autocast(bf16_);
  return as_float(net_.forward_loss(x, y));
}

TrainStep::TrainStep(models::Net& net, optim::FlatParams& flat, LossKind loss, bool channels_last)
    : net_(net), flat_(flat), loss_(loss), channels_last_(channels_last) {}

bool TrainStep::reports_accuracy() const {
  return loss_ == LossKind::CrossEntropy || (loss_ == LossKind::Module && net_.can_predict());
}

void TrainStep::prepare(torch::Tensor& x) const {
  if (channels_last_ && x.dim() == 4) x = x.contiguous(at::MemoryFormat::ChannelsLast);
}

void TrainStep::check_labels(const torch::Tensor& y, int64_t classes) const {
  if (y.numel() == 0) return;
  const int64_t lo = y.min().item<int64_t>(), hi = y.max().item<int64_t>();
  if (lo < 0 || hi >= classes)
    throw InvalidInput("a batch holds the label " + std::to_string(lo < 0 ? lo : hi) +
                       ", outside [0, " + std::to_string(classes) + ") of the model's " +
                       std::to_string(classes) + " outputs");
}

torch::Tensor TrainStep::loss(const torch::Tensor& x, const torch::Tensor& y) {
  switch (loss_) {
    case LossKind::CrossEntropy: {
      auto out = forward(x);
      if (out.dim() >= 2) check_labels(y, out.size(1));
      return nnf::cross_entropy(out, y);
    }
    case LossKind::Mse: return nnf::mse_loss(forward(x), y);
    case LossKind::Module: return module_loss(x, y);
  }
  throw Error("internal: unknown loss");
}

double TrainStep::gradient(torch::Tensor& x, const torch::Tensor& y, const BeforeBackward& before_backward) {
  flat_.zero_grad();
  prepare(x);
  const int64_t n = x.size(0), parts = std::min<int64_t>(micro_, n);
  double value = 0;
  if (parts <= 1) {
    auto l = loss(x, y);
    value = l.item<double>();
    if (before_backward) before_backward(value);
    l.backward();
  } else {
    const auto xs = x.tensor_split(parts), ys = y.tensor_split(parts);
    for (int64_t k = 0; k < parts; ++k) {
      const double share = static_cast<double>(xs[k].size(0)) / static_cast<double>(n);
      auto l = loss(xs[k], ys[k]);
      value += share * l.item<double>();
      if (k == parts - 1 && before_backward) before_backward(value);
      (l * share).backward();
    }
  }
  if (delay_.count() > 0) std::this_thread::sleep_for(delay_);
  return value;
}

double TrainStep::loss_only(const torch::Tensor& x, const torch::Tensor& y) {
  torch::NoGradGuard no_grad;
  torch::Tensor in = x;
  prepare(in);
  return loss(in, y).item<double>();
}

EvalResult TrainStep::evaluate(const data::Dataset& split, const data::Normalization& norm,
                               int64_t chunk) {
  const bool was_training = net_.is_training();
  net_.eval();
  torch::NoGradGuard no_grad;
  EvalResult r;
  double loss_sum = 0;
  int64_t correct = 0, labels = 0, loss_count = 0;
  std::vector<int64_t> ids;
  try {
    for (int64_t start = 0; start < split.size(); start += chunk) {
      const int64_t n = std::min(chunk, split.size() - start);
      ids.resize(n);
      std::iota(ids.begin(), ids.end(), start);
      auto b = data::make_batch(split, norm, ids);
      torch::Tensor scores;
      if (loss_ == LossKind::Module) {
        loss_sum += module_loss(b.x, b.y).item<double>() * n;
        loss_count += n;
        if (net_.can_predict()) scores = predict(b.x);
      } else {
        scores = forward(b.x);
        if (loss_ == LossKind::CrossEntropy) {
          loss_sum += nnf::cross_entropy(scores, b.y, nnf::CrossEntropyFuncOptions().reduction(torch::kSum))
                          .item<double>();
        } else {
          loss_sum += nnf::mse_loss(scores, b.y, nnf::MSELossFuncOptions().reduction(torch::kSum)).item<double>();
        }
        loss_count += b.y.numel();
      }
      if (scores.defined() && b.y.scalar_type() == torch::kInt64) {
        correct += scores.argmax(1).eq(b.y).sum().item<int64_t>();
        labels += b.y.numel();
      }
    }
  } catch (...) {
    net_.train(was_training);
    throw;
  }
  net_.train(was_training);
  r.samples = split.size();
  r.tokens = split.stream != nullptr && loss_ != LossKind::Mse;
  r.loss = loss_count > 0 ? loss_sum / loss_count : 0.0;
  r.accuracy = labels > 0 ? static_cast<double>(correct) / labels : std::nan("");
  if (!reports_accuracy()) r.accuracy = std::nan("");
  return r;
}

void TrainStep::check_data(const data::DatasetSplits& d, const data::Normalization& norm) {
  const data::Dataset& probe_split = d.test.size() > 0 ? d.test : d.train;
  const int64_t n = std::min<int64_t>(2, probe_split.size());
  if (n == 0) return;
  std::vector<int64_t> ids(n);
  std::iota(ids.begin(), ids.end(), 0);
  auto b = data::make_batch(probe_split, norm, ids);
  const bool labels = data::has_labels(d.train);
  const std::string yfile = d.train.tensors  ? d.train.tensors->y.origin
                            : d.train.stream ? d.train.stream->tokens.origin
                                             : d.train.name;
  if (loss_ == LossKind::Mse && labels)
    throw InvalidInput("model.loss = \"mse\" needs float targets, but '" + yfile +
                       "' holds integer labels; use model.loss = \"cross_entropy\"");
  if (loss_ == LossKind::CrossEntropy && !labels)
    throw InvalidInput("model.loss = \"cross_entropy\" needs integer labels, but '" + yfile +
                       "' holds float targets; use model.loss = \"mse\"");
  const bool was_training = net_.is_training();
  net_.eval();
  torch::NoGradGuard no_grad;
  torch::Tensor scores;
  try {
    if (loss_ == LossKind::Module) {
      module_loss(b.x, b.y);  // throws InvalidInput unless a scalar
      if (net_.can_predict()) scores = predict(b.x);
    } else {
      scores = forward(b.x);
    }
  } catch (const InvalidInput&) {
    net_.train(was_training);
    throw;
  } catch (const std::exception& e) {  // c10::Error, torch::jit::JITException
    net_.train(was_training);
    std::string msg = e.what();
    if (auto at = msg.rfind("RuntimeError: "); at != std::string::npos) msg = msg.substr(at);
    throw InvalidInput("the model cannot run on this data (samples " + c10::str(b.x.sizes()) +
                       ", targets " + c10::str(b.y.sizes()) + "): " + msg.substr(0, 400));
  }
  net_.train(was_training);
  auto shape = [](const torch::Tensor& t) { return c10::str(t.sizes()); };
  if (loss_ == LossKind::Mse) {
    if (scores.sizes() != b.y.sizes())
      throw InvalidInput("model.loss = \"mse\": the model's outputs " + shape(scores) +
                         " differ in shape from the targets " + shape(b.y) + " ('" + yfile + "')");
    return;
  }
  if (!scores.defined() || !labels) return;
  auto ys = b.y.sizes().vec();
  auto os = scores.sizes().vec();
  bool fits = os.size() == ys.size() + 1 && os[0] == ys[0];
  for (size_t i = 1; fits && i < ys.size(); ++i) fits = os[i + 1] == ys[i];
  if (!fits)
    throw InvalidInput(std::string("the model's ") +
                       (loss_ == LossKind::Module ? "predict(x)" : "outputs") + " " + shape(scores) +
                       " do not fit the labels " + shape(b.y) +
                       ": cross_entropy needs outputs [B, C, ...] for labels [B, ...]");
  const int64_t classes = os[1];
  for (const data::Dataset* s : {&d.train, &d.test}) {
    auto bad = data::find_bad_label(*s, classes);
    if (bad.index >= 0)
      throw InvalidInput(data::label_site(*s, bad.index) + (s->stream ? " is " : " has the label ") +
                         std::to_string(bad.label) +
                         ", outside [0, " + std::to_string(classes) + ") of the model's " +
                         std::to_string(classes) + " outputs");
  }
}

nlohmann::json eval_fields(const EvalResult& r) {
  nlohmann::json j = {{"test_loss", r.loss},
                      {"test_accuracy", std::isnan(r.accuracy) ? nlohmann::json() : nlohmann::json(r.accuracy)}};
  if (r.tokens) j["test_perplexity"] = std::exp(r.loss);
  return j;
}

PolicyStep policy_step(optim::BatchSizePolicy& policy, const optim::LrSchedule& schedule, optim::Optimizer& opt,
                       double epoch, int64_t step, int64_t nominal_global_batch,
                       const std::function<void(double)>& scale_momentum) {
  PolicyStep p;
  p.policy = policy.step(step, nominal_global_batch);
  if (p.policy.changed && p.policy.momentum_factor != 1.0) {
    if (scale_momentum) scale_momentum(p.policy.momentum_factor);
    else opt.scale_momentum(p.policy.momentum_factor);
  }
  const bool sqrt_rule = policy.options().rule == optim::ScalingRule::Sqrt;
  opt.set_batch_scale(sqrt_rule ? p.policy.kappa : 1.0);
  if (sqrt_rule && !policy.warned_about_betas()) {
    const std::string w = optim::sqrt_rule_warning(opt.options(), p.policy.kappa);
    if (!w.empty()) {
      log_warn(w);
      policy.set_warned_about_betas();
    }
  }
  p.lr = schedule.lr(epoch, step) * p.policy.multiplier;
  return p;
}

nlohmann::json step_record(const StepRecord& r, const MetricsWindow& window, const char* kind) {
  nlohmann::json j = {{"kind", kind}, {"step", r.step}, {"epoch", r.epoch}, {"loss", window.mean_loss()}};
  if (r.lr) j["lr"] = *r.lr;
  if (r.lr_multiplier) j["lr_multiplier"] = *r.lr_multiplier;
  if (r.grad_norm) j["grad_norm"] = *r.grad_norm;
  if (r.batch_size) j["batch_size"] = *r.batch_size;
  j["samples"] = r.samples;
  if (r.skipped_steps) j["skipped_steps"] = *r.skipped_steps;
  if (r.workers) j["workers"] = *r.workers;
  j["samples_per_second"] = window.samples_per_second();
  return j;
}

}  // namespace limbo::train
