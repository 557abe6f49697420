#include "status/board.h"

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <sstream>

namespace limbo::status {

using json = nlohmann::json;

namespace {

// Appends v to the array, halving the array (every other point) when full.
void append(json& arr, const json& v) {
  arr.push_back(v);
  if (arr.size() > Board::kMaxPoints) {
    json thin = json::array();
    for (size_t i = 0; i < arr.size(); i += 2) thin.push_back(arr[i]);
    arr = std::move(thin);
  }
}

json opt(const std::optional<double>& v) { return v ? json(*v) : json(); }

std::string num(double v) {
  if (std::isnan(v)) return "NaN";
  if (std::isinf(v)) return v > 0 ? "+Inf" : "-Inf";
  char b[64];
  std::snprintf(b, sizeof b, "%.17g", v);
  return b;
}

// One metric family: HELP, TYPE, then its samples.
void family(std::string& out, const std::string& name, const char* type, const char* help) {
  out += "# HELP " + name + " " + help + "\n# TYPE " + name + " " + type + "\n";
}
void sample(std::string& out, const std::string& name, double v, const std::string& labels = "") {
  out += name + (labels.empty() ? "" : "{" + labels + "}") + " " + num(v) + "\n";
}

std::optional<double> number(const json& r, const char* key) {
  auto it = r.find(key);
  if (it == r.end() || !it->is_number()) return std::nullopt;
  const double v = it->get<double>();
  if (!std::isfinite(v)) return std::nullopt;
  return v;
}

// A field of a record, or `fallback` when it is missing, null (a NaN was
// written as null) or of another type: records never stop the board.
double real(const json& r, const char* key, double fallback) { return number(r, key).value_or(fallback); }
int64_t integer(const json& r, const char* key, int64_t fallback) {
  auto it = r.find(key);
  if (it == r.end() || !it->is_number_integer()) return fallback;
  return it->get<int64_t>();
}
std::string text(const json& r, const char* key) {
  auto it = r.find(key);
  return it != r.end() && it->is_string() ? it->get<std::string>() : std::string();
}

}  // namespace

Board::Board(std::string job) : job_(std::move(job)), start_(std::chrono::steady_clock::now()) {
  series_ = {{"t", json::array()}, {"members", json::array()}, {"samples_per_second", json::array()},
             {"loss", json::array()}, {"lr", json::array()}, {"lr_multiplier", json::array()}, {"grad_norm", json::array()},
             {"batch_size", json::array()}, {"isgd_triggers", json::array()}, {"updates_per_second", json::array()},
             {"pseudo_gradient_norm", json::array()}, {"compute_share", json::array()}};
  accuracy_ = {{"t", json::array()}, {"test_accuracy", json::array()}, {"test_loss", json::array()},
               {"test_perplexity", json::array()}};
  if (job_ == "train") members_ = 1;
}

double Board::now() const {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
}

void Board::push_point() {
  append(series_["t"], now());
  append(series_["members"], members_);
  append(series_["samples_per_second"], opt(samples_per_second_));
  append(series_["loss"], opt(loss_));
  append(series_["lr"], opt(lr_));
  append(series_["lr_multiplier"], opt(lr_multiplier_));
  append(series_["grad_norm"], opt(grad_norm_));
  append(series_["batch_size"], batch_size_ ? json(*batch_size_) : json());
  append(series_["isgd_triggers"], isgd_triggers_);
  double ups = 0;
  for (const auto& [k, s] : shards_) ups += s.updates_per_second;
  append(series_["updates_per_second"], ps_ ? json(ups) : json());
  append(series_["pseudo_gradient_norm"], opt(pseudo_norm_));
  append(series_["compute_share"], opt(compute_share_));
}

void Board::add_record(const json& r) {
  if (!r.is_object()) return;
  const std::string kind = text(r, "kind");
  std::lock_guard<std::mutex> lock(mu_);
  if (kind == "train") {
    const int64_t step = integer(r, "step", step_);
    const int64_t batch = integer(r, "batch_size", batch_size_.value_or(0));
    if (integer(r, "samples", -1) >= 0)
      samples_total_ = std::max(samples_total_, integer(r, "samples", 0));
    else if (step > step_)
      samples_total_ += (step - step_) * batch;
    step_ = std::max(step_, step);
    epoch_ = real(r, "epoch", epoch_);
    batch_size_ = batch;
    if (auto v = number(r, "loss")) loss_ = v;
    if (auto v = number(r, "lr")) lr_ = v;
    if (auto v = number(r, "lr_multiplier")) lr_multiplier_ = v;
    if (auto v = number(r, "grad_norm")) grad_norm_ = v;
    if (auto v = number(r, "samples_per_second")) samples_per_second_ = v;
    if (r.contains("shares") && r["shares"].is_array()) shares_ = r["shares"];
    if (r.contains("paces") && r["paces"].is_array()) paces_ = r["paces"];
    skipped_steps_ = std::max(skipped_steps_, integer(r, "skipped_steps", 0));
    push_point();
  } else if (kind == "eval") {
    if (auto v = number(r, "test_accuracy")) test_accuracy_ = v;
    if (auto v = number(r, "test_loss")) test_loss_ = v;
    if (auto v = number(r, "test_perplexity")) test_perplexity_ = v;
    append(accuracy_["t"], now());
    append(accuracy_["test_accuracy"], opt(test_accuracy_));
    append(accuracy_["test_loss"], opt(test_loss_));
    append(accuracy_["test_perplexity"], opt(test_perplexity_));
  } else if (kind == "membership") {
    if (launcher_members_) return;
    members_ = static_cast<int>(integer(r, "world", members_));
    const std::string reason = text(r, "reason");
    const std::string k = reason == "start" ? "start" : reason.rfind("failure", 0) == 0 ? "crash" : "change";
    changes_[k] += 1;
    events_.push_back({{"t", now()}, {"kind", k}, {"members", members_}, {"detail", reason}});
    if (events_.size() > kMaxEvents) events_.pop_front();
    push_point();
  } else if (kind == "outer") {
    // DiLoCo's outer step (the writer's): progress, and what it cost.
    diloco_ = true;
    const int64_t step = integer(r, "step", step_);
    if (step > outer_steps_) payload_total_ += integer(r, "payload_bytes", 0) * (step - outer_steps_);
    outer_steps_ = std::max(outer_steps_, step);
    step_ = std::max(step_, step);
    epoch_ = real(r, "epoch", epoch_);
    samples_total_ += integer(r, "samples", 0);
    owed_ = integer(r, "owed", owed_);
    if (auto v = number(r, "loss")) loss_ = v;
    if (auto v = number(r, "pseudo_gradient_norm")) pseudo_norm_ = v;
    if (auto v = number(r, "compute_share")) compute_share_ = v;
    const double wall = real(r, "wall_seconds", 0);
    if (wall > 0) samples_per_second_ = static_cast<double>(integer(r, "samples", 0)) / wall;
    push_point();
  } else if (kind == "isgd_epoch") {
    isgd_ = true;
    isgd_triggers_ += integer(r, "triggered", 0);
    isgd_extra_ += integer(r, "extra_iterations", 0);
    push_point();
  } else if (kind == "ps_updates") {
    ps_ = true;
    const int64_t shard = integer(r, "shard", 0);
    Shard& s = shards_[shard];
    s.updates_per_second = real(r, "updates_per_second", 0.0);
    s.busy_fraction = real(r, "busy_fraction", 0.0);
    s.clock = integer(r, "clock", s.clock);
    s.accepted = integer(r, "accepted", s.accepted);
    s.dropped = integer(r, "dropped", s.dropped);
    s.rejected = integer(r, "rejected", s.rejected);
    s.learners = integer(r, "learners", s.learners);
    // Every shard sees every gradient: count staleness from shard 0 only.
    if (shard == 0 && r.contains("staleness_hist") && r["staleness_hist"].is_object())
      for (const auto& [tau, n] : r["staleness_hist"].items()) {
        char* end = nullptr;
        const long long t = std::strtoll(tau.c_str(), &end, 10);
        if (n.is_number_integer() && end && *end == '\0' && !tau.empty() && t >= 0) staleness_[t] += n.get<int64_t>();
      }
    if (!launcher_members_) members_ = static_cast<int>(shards_.begin()->second.learners);
    push_point();
  } else if (kind == "learner") {
    ps_ = true;
    Learner& l = learners_[integer(r, "learner", 0)];
    l.steps = integer(r, "step", l.steps);
    l.samples = integer(r, "samples", l.samples);
    l.samples_per_second = real(r, "samples_per_second", l.samples_per_second);
    l.loss = real(r, "loss", l.loss);
    l.staleness_mean = real(r, "staleness_mean", l.staleness_mean);
    double rate = 0, loss = 0;
    int64_t samples = 0;
    for (const auto& [id, x] : learners_) {
      rate += x.samples_per_second;
      loss += x.loss;
      samples += x.samples;
    }
    samples_per_second_ = rate;
    loss_ = loss / static_cast<double>(learners_.size());
    samples_total_ = std::max(samples_total_, samples);
    epoch_ = real(r, "epoch", epoch_);
    push_point();
  }
}

void Board::member_event(int members, const std::string& kind, const std::string& detail) {
  std::lock_guard<std::mutex> lock(mu_);
  launcher_members_ = true;
  members_ = members;
  changes_[kind] += 1;
  events_.push_back({{"t", now()}, {"kind", kind}, {"members", members}, {"detail", detail}});
  if (events_.size() > kMaxEvents) events_.pop_front();
  push_point();
}

json Board::snapshot() const {
  std::lock_guard<std::mutex> lock(mu_);
  json s = {{"job", job_},
            {"uptime_seconds", now()},
            {"time", std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count()},
            {"members", members_},
            {"step", step_},
            {"epoch", epoch_},
            {"samples_total", samples_total_},
            {"skipped_steps", skipped_steps_},
            {"samples_per_second", opt(samples_per_second_)},
            {"loss", opt(loss_)},
            {"lr", opt(lr_)},
            {"lr_multiplier", opt(lr_multiplier_)},
            {"grad_norm", opt(grad_norm_)},
            {"shares", shares_.is_array() ? shares_ : json()},
            {"paces", paces_.is_array() ? paces_ : json()},
            {"batch_size", batch_size_ ? json(*batch_size_) : json()},
            {"test_accuracy", opt(test_accuracy_)},
            {"test_loss", opt(test_loss_)},
            {"test_perplexity", opt(test_perplexity_)},
            {"membership_changes", changes_},
            {"series", series_},
            {"accuracy", accuracy_},
            {"events", json(std::vector<json>(events_.begin(), events_.end()))}};
  if (diloco_)
    s["diloco"] = {{"outer_steps", outer_steps_}, {"pseudo_gradient_norm", opt(pseudo_norm_)},
                   {"compute_share", opt(compute_share_)}, {"pseudo_gradient_bytes_total", payload_total_},
                   {"owed_samples", owed_}};
  else s["diloco"] = nullptr;
  if (isgd_) s["isgd"] = {{"triggers_total", isgd_triggers_}, {"extra_iterations_total", isgd_extra_}};
  else s["isgd"] = nullptr;
  if (ps_) {
    json hist = json::object();
    for (const auto& [tau, n] : staleness_) hist[std::to_string(tau)] = n;
    json shards = json::array();
    double ups = 0;
    int64_t dropped = 0, rejected = 0, updates = 0;
    for (const auto& [k, x] : shards_) {
      shards.push_back({{"shard", k}, {"updates_per_second", x.updates_per_second},
                        {"busy_fraction", x.busy_fraction}, {"clock", x.clock}});
      ups += x.updates_per_second;
      rejected += x.rejected;
      if (k == 0) dropped = x.dropped, updates = x.clock;
    }
    json learners = json::array();
    for (const auto& [id, l] : learners_)
      learners.push_back({{"learner", id}, {"steps", l.steps}, {"samples_per_second", l.samples_per_second},
                          {"loss", l.loss}, {"staleness_mean", l.staleness_mean}});
    s["ps"] = {{"staleness_hist", hist}, {"updates_per_second", ups}, {"updates_total", updates},
               {"gradients_dropped", dropped}, {"gradients_rejected", rejected}, {"shards", shards},
               {"learners", learners}};
  } else {
    s["ps"] = nullptr;
  }
  return s;
}

std::string Board::prometheus() const {
  const json s = snapshot();
  std::string o;
  const std::string job = "job=\"" + job_ + "\"";
  // A family of one sample (left out when the value is not known yet).
  auto single = [&](const char* name, const char* type, const json& v, const char* help) {
    if (!v.is_number()) return;
    family(o, name, type, help);
    sample(o, name, v.get<double>(), job);
  };
  auto gauge = [&](const char* name, const char* key, const char* help) { single(name, "gauge", s[key], help); };
  single("limbo_members", "gauge", s["members"], "Members of the job now (workers, or learners registered at shard 0).");
  single("limbo_samples_total", "counter", s["samples_total"], "Training samples processed.");
  single("limbo_steps_total", "counter", s["step"], "Optimizer steps taken (data-parallel jobs).");
  single("limbo_skipped_steps_total", "counter", s["skipped_steps"],
         "Steps skipped by every member because the gradient or loss was not finite.");
  single("limbo_epoch", "gauge", s["epoch"], "Training progress in epochs.");
  gauge("limbo_samples_per_second", "samples_per_second", "Training throughput over the last logged window.");
  gauge("limbo_loss", "loss", "Training loss over the last logged window.");
  gauge("limbo_learning_rate", "lr", "Learning rate of the last logged step.");
  gauge("limbo_lr_multiplier", "lr_multiplier", "Dynamic SGD / batch-size policy multiplier of the learning rate.");
  gauge("limbo_grad_norm", "grad_norm",
        "Global L2 norm of the gradient before clipping (optim.clip_grad_norm), mean over the last logged window.");
  gauge("limbo_global_batch_size", "batch_size", "Global batch size of the last logged step.");
  gauge("limbo_test_accuracy", "test_accuracy", "Test accuracy of the last evaluation (0-1).");
  gauge("limbo_test_loss", "test_loss", "Test (validation) loss of the last evaluation.");
  gauge("limbo_test_perplexity", "test_perplexity",
        "Validation perplexity exp(test loss) of the last evaluation (token-stream data).");
  family(o, "limbo_membership_changes_total", "counter", "Membership events by kind.");
  for (const auto& [k, n] : s["membership_changes"].items())
    sample(o, "limbo_membership_changes_total", n.get<double>(), job + ",kind=\"" + k + "\"");
  if (!s["diloco"].is_null()) {
    const json& d = s["diloco"];
    single("limbo_diloco_outer_steps_total", "counter", d["outer_steps"], "DiLoCo outer steps committed.");
    single("limbo_diloco_pseudo_gradient_norm", "gauge", d["pseudo_gradient_norm"],
           "L2 norm of the writer's pseudo-gradient (global - local) at the last outer step.");
    single("limbo_diloco_compute_share", "gauge", d["compute_share"],
           "Share of the writer's last outer step spent in its own forward and backward.");
    single("limbo_diloco_pseudo_gradient_bytes_total", "counter", d["pseudo_gradient_bytes_total"],
           "Pseudo-gradient bytes the writer contributed to outer all-reduces (as encoded on the wire).");
    single("limbo_diloco_owed_samples", "gauge", d["owed_samples"],
           "Samples of the epoch owed (a member lost or stopped at the bounded wait), dealt next.");
  }
  if (!s["isgd"].is_null())
    single("limbo_isgd_triggers_total", "counter", s["isgd"]["triggers_total"],
           "ISGD batches found under-trained (extra updates given).");
  if (!s["ps"].is_null()) {
    const json& p = s["ps"];
    // Staleness: cumulative buckets at powers of two, as Prometheus expects.
    family(o, "limbo_staleness", "histogram", "Staleness (tau) of the gradients applied at shard 0.");
    std::map<int64_t, int64_t> h;
    for (const auto& [tau, n] : p["staleness_hist"].items()) h[std::stoll(tau)] = n.get<int64_t>();
    double sum = 0;
    int64_t count = 0;
    for (const auto& [tau, n] : h) sum += static_cast<double>(tau * n), count += n;
    for (int64_t le : {0, 1, 2, 4, 8, 16, 32, 64, 128}) {
      int64_t c = 0;
      for (const auto& [tau, n] : h)
        if (tau <= le) c += n;
      sample(o, "limbo_staleness_bucket", static_cast<double>(c), job + ",le=\"" + std::to_string(le) + "\"");
    }
    sample(o, "limbo_staleness_bucket", static_cast<double>(count), job + ",le=\"+Inf\"");
    sample(o, "limbo_staleness_sum", sum, job);
    sample(o, "limbo_staleness_count", static_cast<double>(count), job);
    single("limbo_ps_updates_total", "counter", p["updates_total"], "Model updates made by shard 0.");
    single("limbo_ps_gradients_dropped_total", "counter", p["gradients_dropped"],
           "Gradients dropped for exceeding the staleness bound.");
    single("limbo_ps_gradients_rejected_total", "counter", p["gradients_rejected"],
           "Malformed or non-finite gradients refused, all shards.");
    auto per_shard = [&](const char* name, const char* key, const char* help) {
      family(o, name, "gauge", help);
      for (const auto& sh : p["shards"])
        sample(o, name, sh[key].get<double>(), job + ",shard=\"" + std::to_string(sh["shard"].get<int64_t>()) + "\"");
    };
    per_shard("limbo_ps_shard_updates_per_second", "updates_per_second", "Updates per second by shard.");
    per_shard("limbo_ps_shard_busy_ratio", "busy_fraction", "Fraction of time each shard spent on messages.");
  }
  return o;
}

std::vector<json> Tail::read() {
  std::vector<json> out;
  std::ifstream f(path_, std::ios::binary);
  if (!f) return out;
  f.seekg(0, std::ios::end);
  const int64_t size = f.tellg();
  if (size < offset_) offset_ = 0;  // the file was replaced: read it again
  if (size == offset_) return out;
  f.seekg(offset_);
  std::string chunk(static_cast<size_t>(size - offset_), '\0');
  f.read(chunk.data(), static_cast<std::streamsize>(chunk.size()));
  const size_t end = chunk.rfind('\n');
  if (end == std::string::npos) return out;  // no complete line yet
  offset_ += static_cast<int64_t>(end + 1);
  std::istringstream lines(chunk.substr(0, end + 1));
  for (std::string line; std::getline(lines, line);) {
    if (line.empty()) continue;
    try {
      out.push_back(json::parse(line));
    } catch (const std::exception&) {
      // a torn or foreign line: skipped
    }
  }
  return out;
}

}  // namespace limbo::status
