#include "train/checkpoint.h"

#include <ATen/CPUGeneratorImpl.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <set>

#include "common/error.h"
#include "common/files.h"
#include "common/log.h"
#include "train/archive_io.h"

namespace limbo::train {
namespace {

constexpr int64_t kFormatVersion = 1;

}  // namespace

namespace archive_io {

torch::Tensor scalar(int64_t v) { return torch::tensor({v}, torch::kInt64); }

std::string tensor_bytes(const torch::Tensor& t) {
  auto c = t.contiguous();
  return std::string(reinterpret_cast<const char*>(c.data_ptr<uint8_t>()), c.numel());
}

int64_t read_int(torch::serialize::InputArchive& ar, const std::string& key,
                 const std::string& file) {
  torch::Tensor t;
  if (!ar.try_read(key, t)) throw InvalidInput("checkpoint '" + file + "' lacks state/" + key);
  return t.item<int64_t>();
}

torch::serialize::InputArchive open_archive(const std::string& path) {
  if (!file_exists(path)) throw InvalidInput("checkpoint '" + path + "' does not exist");
  torch::serialize::InputArchive ar;
  try {
    ar.load_from(path);
  } catch (const c10::Error& e) {
    throw InvalidInput("checkpoint '" + path + "' is not a readable Limbo checkpoint: " +
                       e.msg().substr(0, 200));
  }
  return ar;
}

std::vector<std::string> split_lines(const std::string& text) {
  std::vector<std::string> out;
  for (size_t at = 0, nl; (nl = text.find('\n', at)) != std::string::npos; at = nl + 1)
    out.push_back(text.substr(at, nl - at));
  return out;
}

namespace {

// The names of the trainable parameters (requires_grad), in the flat
// buffer's order: the optimizer's state covers exactly these.
std::vector<std::string> trainable_names(torch::nn::Module& m) {
  std::vector<std::string> out;
  for (const auto& p : m.named_parameters(true))
    if (p.value().requires_grad()) out.push_back(p.key());
  return out;
}

int64_t trainable_numel(torch::nn::Module& m) {
  int64_t n = 0;
  for (const auto& p : m.parameters(true))
    if (p.requires_grad()) n += p.numel();
  return n;
}

}  // namespace

// The state was saved for another set of trainable parameters (a parameter
// frozen or unfrozen since): refused by name, as resuming it would step
// the wrong slices, or write past the end of the state.
void check_same_trainable(torch::serialize::InputArchive& o, torch::nn::Module& model, int64_t state_numel,
                          const std::string& path) {
  const auto now = trainable_names(model);
  torch::Tensor saved_t;
  std::string changed;
  if (o.try_read("trainable", saved_t)) {
    const auto saved = split_lines(tensor_bytes(saved_t));
    if (saved == now && state_numel == trainable_numel(model)) return;
    const std::set<std::string> was(saved.begin(), saved.end()), is(now.begin(), now.end());
    int listed = 0, more = 0;
    auto note = [&](const std::string& name, const char* how) {
      if (++listed > 8) return void(++more);
      changed += (changed.empty() ? "" : ", ") + name + " (" + how + ")";
    };
    for (const auto& p : model.named_parameters(true)) {
      const bool a = was.count(p.key()) > 0, b = is.count(p.key()) > 0;
      if (a && !b) note(p.key(), "trainable then, frozen now");
      if (!a && b) note(p.key(), "frozen then, trainable now");
    }
    if (more > 0) changed += " and " + std::to_string(more) + " more";
    if (changed.empty()) changed = "the trainable parameters differ in order or size";
    else changed = "requires_grad changed for " + changed;
  } else {
    // A checkpoint from before the list was kept: only the sizes can tell.
    if (state_numel == trainable_numel(model)) return;
    changed = "its state covers " + std::to_string(state_numel) + " floats, the trainable parameters now " +
              std::to_string(trainable_numel(model)) + " (requires_grad changed for some parameter)";
  }
  throw InvalidInput("checkpoint '" + path + "' holds the optimizer state of other trainable parameters: " +
                     changed + ". Resume with the parameters frozen as they were, or start a new run from "
                     "these weights (limbo export --checkpoint " + path +
                     " --format torchscript, then model.path) with a fresh optimizer");
}

// Flush to disk before the rename (and the directory after it), so a crash
// leaves the old or the new file, never a torn one; a failed flush leaves
// the old one in place and stops the run.
void write_archive(torch::serialize::OutputArchive& root, const std::string& path) {
  std::string tmp = temp_name(path);
  try {
    root.save_to(tmp);
    fsync_file(tmp);
    rename_durably(tmp, path);
  } catch (const c10::Error& e) {
    std::remove(tmp.c_str());
    throw Error("cannot write checkpoint '" + path + "': " + e.what_without_backtrace());
  } catch (...) {
    std::remove(tmp.c_str());
    throw;
  }
}

namespace {

torch::Tensor bytes_tensor(const std::string& s) {
  auto t = torch::empty({static_cast<int64_t>(s.size())}, torch::kUInt8);
  if (!s.empty()) std::memcpy(t.data_ptr<uint8_t>(), s.data(), s.size());
  return t;
}

// A tensor as a file should hold it: an archive writes a tensor's whole
// storage, and a float32 buffer is a view into the flat region that also
// holds the whole gradient (optim/flat_params.h), so it is written as a
// copy of its own elements.
torch::Tensor own_elements(const torch::Tensor& t) {
  if (!t.defined() || t.storage_offset() != 0 ||
      t.storage().nbytes() > static_cast<size_t>(t.numel()) * t.element_size())
    return t.clone();
  return t;
}

// Like nn::Module::save (`params`: false for a fully sharded checkpoint,
// whose weights are in its shards), each buffer's elements alone. The
// parameters are views of the flat weights, which they fill: written once.
void save_module(torch::nn::Module& m, torch::serialize::OutputArchive& ar, bool params) {
  if (params)
    for (auto& p : m.named_parameters(false)) ar.write(p.key(), p.value());
  for (auto& b : m.named_buffers(false)) ar.write(b.key(), own_elements(b.value()), /*is_buffer=*/true);
  for (auto& c : m.named_children()) {
    if (!c.value()->is_serializable()) continue;  // (as nn::Module::save: a Functional, say)
    torch::serialize::OutputArchive child;
    save_module(*c.value(), child, params);
    ar.write(c.key(), child);
  }
}

// Like nn::Module::load, but copies values into the existing tensors instead
// of swapping their storage (`params`: the parameters too).
void load_into(torch::nn::Module& m, torch::serialize::InputArchive& ar, const std::string& file,
               const std::string& prefix, bool params = true) {
  torch::NoGradGuard no_grad;
  auto copy = [&](const std::string& key, torch::Tensor& dst, bool is_buffer) {
    torch::Tensor src;
    if (!ar.try_read(key, src, is_buffer))
      throw InvalidInput("checkpoint '" + file + "' lacks tensor '" + prefix + key + "'");
    if (src.sizes() != dst.sizes())
      throw InvalidInput("checkpoint '" + file + "': tensor '" + prefix + key + "' has shape " +
                         c10::str(src.sizes()) + ", the model expects " + c10::str(dst.sizes()) +
                         " (was it written for another model or dataset?)");
    dst.copy_(src);
  };
  if (params)
    for (auto& p : m.named_parameters(false)) copy(p.key(), p.value(), false);
  for (auto& b : m.named_buffers(false)) copy(b.key(), b.value(), true);
  for (auto& c : m.named_children()) {
    torch::serialize::InputArchive child;
    if (!ar.try_read(c.key(), child))
      throw InvalidInput("checkpoint '" + file + "' lacks submodule '" + prefix + c.key() + "'");
    load_into(*c.value(), child, file, prefix + c.key() + ".", params);
  }
}

// The first entry where two model descriptions differ, for messages.
std::string first_difference(const std::vector<std::string>& a, const std::vector<std::string>& b) {
  for (size_t i = 0; i < std::max(a.size(), b.size()); ++i) {
    const std::string x = i < a.size() ? a[i] : "(nothing)", y = i < b.size() ? b[i] : "(nothing)";
    if (x != y) return "the checkpoint has " + x + " where this model has " + y;
  }
  return "";
}

// The optimizer's section: every state tensor its configuration names, or
// none (a checkpoint before the first update, or of another algorithm).
void load_optimizer(torch::serialize::InputArchive& root, optim::Optimizer& opt, torch::nn::Module& model,
                    const std::string& path) {
  torch::serialize::InputArchive o;
  if (!root.try_read("optim", o)) {
    opt.reset_state();
    return;
  }
  // (try_read into a defined tensor resizes it in place: a fresh one each time)
  torch::Tensor step_t, algo_t;
  const int64_t steps = o.try_read("step", step_t) ? step_t.item<int64_t>() : 0;
  const std::string algorithm = o.try_read("algorithm", algo_t) ? tensor_bytes(algo_t) : std::string("sgd");
  std::vector<torch::Tensor> tensors;
  for (const auto& name : opt.state_names()) {
    torch::Tensor t;
    if (!o.try_read(name, t)) break;
    tensors.push_back(t);
  }
  if (algorithm != opt.algorithm()) {
    log_warn("checkpoint '" + path + "' holds the state of optimizer '" + algorithm + "'; optimizer '" +
             opt.algorithm() + "' starts with none");
    opt.reset_state();
  } else if (tensors.size() != opt.state_names().size()) {
    // No moments: the update count restarts with them (Adam's bias
    // correction at t = N + 1 with zero moments would move the first steps
    // about 3x too far; PyTorch starts a fresh state at step 0).
    if (steps > 0 && !opt.state_names().empty())
      log_warn("checkpoint '" + path + "' holds no optimizer state (" + std::to_string(steps) +
               " updates were made; its writer held only a shard of a sharded state, or it was written "
               "without it): the optimizer starts afresh at update 0");
    opt.set_state({}, 0);
  } else {
    if (!tensors.empty()) check_same_trainable(o, model, tensors[0].numel(), path);
    opt.set_state(std::move(tensors), steps);
  }
}

}  // namespace

}  // namespace archive_io

using namespace archive_io;

void save_checkpoint(const std::string& path, torch::nn::Module& model, const optim::Optimizer& opt,
                     const TrainState& st, const ShardedLayout* sharded) {
  torch::serialize::OutputArchive root, m, o, s;
  if (sharded) {
    save_module(model, m, /*params=*/false);
    torch::serialize::OutputArchive sh;
    sh.write("world", scalar(sharded->world));
    sh.write("numel", scalar(sharded->numel));
    std::string names;
    auto offsets = torch::empty({static_cast<int64_t>(sharded->params.size()), 2}, torch::kInt64);
    auto nhwc = torch::zeros({static_cast<int64_t>(sharded->params.size())}, torch::kInt64);
    for (size_t i = 0; i < sharded->params.size(); ++i) {
      names += sharded->params[i].name + "\n";
      offsets[static_cast<int64_t>(i)][0] = sharded->params[i].offset;
      offsets[static_cast<int64_t>(i)][1] = sharded->params[i].numel;
      nhwc[static_cast<int64_t>(i)] = sharded->params[i].channels_last ? 1 : 0;
    }
    sh.write("names", bytes_tensor(names));
    sh.write("offsets", offsets);
    sh.write("channels_last", nhwc);
    root.write("sharded", sh);
  } else {
    save_module(model, m, /*params=*/true);
  }
  if (opt.has_state() && !sharded) {
    const auto names = opt.state_names();
    for (size_t i = 0; i < names.size(); ++i) o.write(names[i], opt.state()[i]);
  }
  o.write("step", scalar(opt.steps()));
  o.write("algorithm", bytes_tensor(opt.algorithm()));
  std::string trainable;
  for (const auto& name : trainable_names(model)) trainable += name + "\n";
  o.write("trainable", bytes_tensor(trainable));
  s.write("format_version", scalar(kFormatVersion));
  s.write("step", scalar(st.step));
  s.write("epoch", scalar(st.cursor.epoch));
  s.write("position", scalar(st.cursor.position));
  s.write("samples", scalar(st.samples));
  if (!st.owed.empty()) {
    auto owed = torch::empty({static_cast<int64_t>(st.owed.size()), 2}, torch::kInt64);
    for (size_t i = 0; i < st.owed.size(); ++i) {
      owed[static_cast<int64_t>(i)][0] = st.owed[i].first;
      owed[static_cast<int64_t>(i)][1] = st.owed[i].second;
    }
    s.write("owed", owed);
  }
  {
    auto gen = at::detail::getDefaultCPUGenerator();
    std::lock_guard<std::mutex> lock(gen.mutex());
    s.write("rng", gen.get_state());
  }
  s.write("config", bytes_tensor(st.config_toml));
  std::string desc;
  for (const auto& e : model_description(model)) desc += e + "\n";
  s.write("model_description", bytes_tensor(desc));
  if (!st.extra.empty()) {
    torch::serialize::OutputArchive e;
    for (const auto& [name, t] : st.extra) e.write(name, t);
    root.write("extra", e);
  }
  root.write("model", m);
  root.write("optim", o);
  root.write("state", s);
  write_archive(root, path);
}

TrainState load_checkpoint(const std::string& path, torch::nn::Module& model, optim::Optimizer* opt,
                           DeferredShardState* deferred) {
  auto root = open_archive(path);
  torch::serialize::InputArchive m, o, s;
  if (!root.try_read("model", m) || !root.try_read("state", s))
    throw InvalidInput("checkpoint '" + path + "' lacks its model/ or state/ section");
  if (read_int(s, "format_version", path) != kFormatVersion)
    throw InvalidInput("checkpoint '" + path + "' has an unsupported format version");
  torch::Tensor stored_desc;
  if (s.try_read("model_description", stored_desc)) {  // absent in older checkpoints
    const std::vector<std::string> stored = split_lines(tensor_bytes(stored_desc));
    auto diff = first_difference(stored, model_description(model));
    if (!diff.empty())
      throw InvalidInput("checkpoint '" + path + "' was written for another model: " + diff +
                         " (another model.path, model or dataset?)");
  }
  torch::serialize::InputArchive sharded;
  TrainState st;
  st.step = read_int(s, "step", path);
  if (root.try_read("sharded", sharded)) {
    load_into(model, m, path, "", /*params=*/false);
    load_shards(path, sharded, st.step, root, model, opt, deferred);
  } else {
    load_into(model, m, path, "");
    if (opt) load_optimizer(root, *opt, model, path);
  }
  st.cursor.epoch = read_int(s, "epoch", path);
  st.cursor.position = read_int(s, "position", path);
  st.samples = read_int(s, "samples", path);
  torch::Tensor rng, cfg, owed;
  if (s.try_read("owed", owed) && owed.dim() == 2 && owed.size(1) == 2)
    for (int64_t i = 0; i < owed.size(0); ++i) st.owed.push_back({owed[i][0].item<int64_t>(), owed[i][1].item<int64_t>()});
  if (s.try_read("rng", rng)) {
    auto gen = at::detail::getDefaultCPUGenerator();
    std::lock_guard<std::mutex> lock(gen.mutex());
    gen.set_state(rng);
  }
  if (s.try_read("config", cfg)) st.config_toml = tensor_bytes(cfg);
  torch::serialize::InputArchive e;
  if (root.try_read("extra", e))
    for (const auto& key : e.keys()) {
      torch::Tensor t;
      if (e.try_read(key, t)) st.extra[key] = t;
    }
  return st;
}

std::vector<std::string> model_description(torch::nn::Module& m) {
  std::vector<std::string> out;
  auto add = [&](const std::string& kind, const std::string& name, const torch::Tensor& t) {
    out.push_back(kind + " " + name + c10::str(t.sizes()) + ":" + std::string(c10::toString(t.scalar_type())));
  };
  for (const auto& p : m.named_parameters(true)) add("parameter", p.key(), p.value());
  for (const auto& b : m.named_buffers(true)) add("buffer", b.key(), b.value());
  return out;
}

std::string read_checkpoint_config(const std::string& path) {
  auto root = open_archive(path);
  torch::serialize::InputArchive s;
  torch::Tensor cfg;
  if (!root.try_read("state", s) || !s.try_read("config", cfg))
    throw InvalidInput("checkpoint '" + path + "' holds no configuration");
  return tensor_bytes(cfg);
}

}  // namespace limbo::train
