#include "train/checkpoint.h"

#include <ATen/CPUGeneratorImpl.h>
#include <caffe2/serialize/inline_container.h>
#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <map>
#include <optional>
#include <set>
#include <tuple>

#include "common/error.h"
#include "common/files.h"
#include "common/log.h"

namespace limbo::train {
namespace {

constexpr int64_t kFormatVersion = 1;

torch::Tensor scalar(int64_t v) { return torch::tensor({v}, torch::kInt64); }

torch::Tensor bytes_tensor(const std::string& s) {
  auto t = torch::empty({static_cast<int64_t>(s.size())}, torch::kUInt8);
  if (!s.empty()) std::memcpy(t.data_ptr<uint8_t>(), s.data(), s.size());
  return t;
}

std::string tensor_bytes(const torch::Tensor& t) {
  auto c = t.contiguous();
  return std::string(reinterpret_cast<const char*>(c.data_ptr<uint8_t>()), c.numel());
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

std::vector<std::string> split_lines(const std::string& text) {
  std::vector<std::string> out;
  for (size_t at = 0, nl; (nl = text.find('\n', at)) != std::string::npos; at = nl + 1)
    out.push_back(text.substr(at, nl - at));
  return out;
}

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

// Where a shard file's tensors lie in it. A torch archive stores each
// tensor's elements uncompressed in a record of its own, numbered in the
// order save_shard() wrote them: lo, hi, numel, step, optimizer_steps (8
// bytes each), the weights, then the state tensors by name (hi - lo floats
// each). Nothing when the file is not laid out so (it is then read whole).
struct ShardRecords {
  int64_t lo = 0, hi = 0, numel = 0, step = 0, optimizer_steps = 0;
  std::vector<uint64_t> offsets;  // the weights', then each state tensor's
};

std::optional<ShardRecords> locate_records(const std::string& file) {
  try {
    caffe2::serialize::PyTorchStreamReader reader(file);
    std::map<int64_t, std::string> data;
    for (const auto& name : reader.getAllRecords()) {
      if (name.rfind("data/", 0) != 0) continue;
      const std::string k = name.substr(5);
      if (k.empty() || k.find_first_not_of("0123456789") != std::string::npos) return std::nullopt;
      data[std::stoll(k)] = name;
    }
    if (data.size() < 6 || data.begin()->first != 0 || data.rbegin()->first != static_cast<int64_t>(data.size()) - 1)
      return std::nullopt;
    int64_t v[5];
    for (int i = 0; i < 5; ++i) {
      auto [ptr, size] = reader.getRecord(data[i]);
      if (size != 8) return std::nullopt;
      std::memcpy(&v[i], ptr.get(), 8);
    }
    ShardRecords r{v[0], v[1], v[2], v[3], v[4], {}};
    // (a shard of 2 floats would look like the 8-byte numbers: read whole)
    if (r.lo < 0 || r.hi - r.lo < 3 || r.hi > r.numel) return std::nullopt;
    // Each tensor's record is followed by the next record's header (and
    // the last by the pickle's): its elements fit between the two offsets,
    // with at most a header's room left (never read to be measured: the
    // records are the shard's whole weights and state).
    for (size_t i = 5; i < data.size(); ++i) r.offsets.push_back(reader.getRecordOffset(data[static_cast<int64_t>(i)]));
    if (!reader.hasRecord("data.pkl")) return std::nullopt;
    r.offsets.push_back(reader.getRecordOffset("data.pkl"));
    const uint64_t bytes = 4 * static_cast<uint64_t>(r.hi - r.lo);
    for (size_t i = 0; i + 1 < r.offsets.size(); ++i)
      if (r.offsets[i + 1] < r.offsets[i] + bytes || r.offsets[i + 1] > r.offsets[i] + bytes + 4096) return std::nullopt;
    r.offsets.pop_back();
    return r;
  } catch (const c10::Error&) {
    return std::nullopt;
  }
}

// `count` floats at byte `offset` of `file` into `dst`.
void read_floats(const std::string& file, uint64_t offset, int64_t count, float* dst) {
  const int fd = ::open(file.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) throw Error("cannot open checkpoint shard '" + file + "': " + std::strerror(errno));
  const size_t want = sizeof(float) * static_cast<size_t>(count);
  size_t done = 0;
  while (done < want) {
    const ssize_t n = ::pread(fd, reinterpret_cast<char*>(dst) + done, want - done, static_cast<off_t>(offset + done));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      const std::string why = n < 0 ? std::strerror(errno) : "it ends early";
      ::close(fd);
      throw Error("cannot read checkpoint shard '" + file + "': " + why);
    }
    done += static_cast<size_t>(n);
  }
  ::close(fd);
}

// The weights and state of a fully sharded checkpoint, from its shard
// files: each shard's weights into the parameters it covers, the state
// (when `opt`, and when the shards hold it) whole, or left in the files
// and described in `deferred`.
void load_shards(const std::string& path, torch::serialize::InputArchive& sharded, int64_t step,
                 torch::serialize::InputArchive& root, torch::nn::Module& model, optim::Optimizer* opt,
                 DeferredShardState* deferred) {
  torch::NoGradGuard no_grad;
  const int64_t world = read_int(sharded, "world", path), n = read_int(sharded, "numel", path);
  torch::Tensor names_t, offsets;
  if (!sharded.try_read("names", names_t) || !sharded.try_read("offsets", offsets))
    throw InvalidInput("checkpoint '" + path + "' lacks its sharded layout");
  const auto names = split_lines(tensor_bytes(names_t));
  std::map<std::string, torch::Tensor> params;
  for (const auto& p : model.named_parameters(true)) params[p.key()] = p.value();
  // A parameter's elements in the flat weights are in the writer's memory
  // order (NHWC for a channels-last 4-D weight): each is put together from
  // its shards, then copied into the parameter whatever its own order.
  struct Slot {
    torch::Tensor param;
    int64_t offset, numel;
    bool nhwc;
    torch::Tensor whole;  // while it is put together
  };
  torch::Tensor nhwc_t;
  const bool has_nhwc = sharded.try_read("channels_last", nhwc_t);
  std::vector<Slot> layout;
  for (size_t i = 0; i < names.size(); ++i) {
    auto it = params.find(names[i]);
    const int64_t numel = offsets[static_cast<int64_t>(i)][1].item<int64_t>();
    if (it == params.end() || it->second.numel() != numel)
      throw InvalidInput("checkpoint '" + path + "' was written for another model: its sharded weights hold '" +
                         names[i] + "' of " + std::to_string(numel) + " elements");
    const bool nhwc = has_nhwc && nhwc_t[static_cast<int64_t>(i)].item<int64_t>() != 0 && it->second.dim() == 4;
    layout.push_back({it->second, offsets[static_cast<int64_t>(i)][0].item<int64_t>(), numel, nhwc, {}});
  }
  std::vector<std::string> state_names;
  torch::serialize::InputArchive o;
  torch::Tensor algo_t;
  const bool same_algorithm = opt && root.try_read("optim", o) && o.try_read("algorithm", algo_t) &&
                              tensor_bytes(algo_t) == opt->algorithm();
  if (opt && !same_algorithm)
    log_warn("checkpoint '" + path + "' holds the state of another optimizer; optimizer '" + opt->algorithm() +
             "' starts with none");
  if (same_algorithm) state_names = opt->state_names();
  std::vector<torch::Tensor> state;
  int64_t optimizer_steps = 0;
  bool has_state = !state_names.empty();
  int64_t expect_lo = 0;
  std::vector<std::string> files;
  for (int64_t r = 0; r < world; ++r) {
    files.push_back(shard_file(path, static_cast<int>(r), static_cast<int>(world), step));
    if (!file_exists(files.back()))
      throw InvalidInput("checkpoint '" + path + "' is sharded in " + std::to_string(world) + " and its shard " +
                         std::to_string(r) + " is not beside it ('" + files.back() + "'; a run directory of its own on "
                         "each of three or more hosts holds only the shards of its host and the next: resume "
                         "from a run directory that every host shares)");
  }
  // Each file's tensors read range by range where it is laid out as
  // save_shard() writes it (a shard's weights, never its state, in memory
  // for the parameters; the state read straight into place or left in the
  // files); else each file is read whole.
  std::vector<ShardRecords> records;
  for (const auto& file : files) {
    auto x = locate_records(file);
    if (!x) break;
    records.push_back(std::move(*x));
  }
  const bool in_place = records.size() == files.size();
  DeferredShardState later;
  for (int64_t r = 0; r < world; ++r) {
    const std::string& file = files[static_cast<size_t>(r)];
    std::optional<torch::serialize::InputArchive> ar;
    int64_t lo, hi, file_step, file_n;
    if (in_place) {
      const auto& x = records[static_cast<size_t>(r)];
      std::tie(lo, hi, file_step, file_n) = std::make_tuple(x.lo, x.hi, x.step, x.numel);
    } else {
      ar = open_archive(file);
      lo = read_int(*ar, "lo", file);
      hi = read_int(*ar, "hi", file);
      file_step = read_int(*ar, "step", file);
      file_n = read_int(*ar, "numel", file);
    }
    if (lo != expect_lo || hi < lo || hi > n || file_step != step || file_n != n)
      throw InvalidInput("checkpoint shard '" + file + "' does not continue its checkpoint (range " +
                         std::to_string(lo) + ".." + std::to_string(hi) + " of " + std::to_string(n) + ")");
    expect_lo = hi;
    torch::Tensor w;
    if (!in_place && (!ar->try_read("weights", w) || w.numel() != hi - lo))
      throw InvalidInput("checkpoint shard '" + file + "' lacks its weights");
    for (auto& s : layout) {
      const int64_t a = std::max(lo, s.offset), b = std::min(hi, s.offset + s.numel);
      if (b <= a) continue;
      if (!s.whole.defined()) s.whole = torch::empty({s.numel}, torch::kFloat32);
      if (in_place)
        read_floats(file, records[static_cast<size_t>(r)].offsets[0] + sizeof(float) * static_cast<uint64_t>(a - lo),
                    b - a, s.whole.data_ptr<float>() + (a - s.offset));
      else
        s.whole.narrow(0, a - s.offset, b - a).copy_(w.narrow(0, a - lo, b - a));
      if (b < s.offset + s.numel) continue;  // the rest is in the next shard
      const auto sz = s.param.sizes();
      if (s.nhwc)
        s.param.permute({0, 2, 3, 1}).copy_(s.whole.view({sz[0], sz[2], sz[3], sz[1]}));
      else
        s.param.copy_(s.whole.view(sz));
      s.whole = torch::Tensor();
    }
    if (r == 0) optimizer_steps = in_place ? records[0].optimizer_steps : read_int(*ar, "optimizer_steps", file);
    if (in_place) {
      const auto& x = records[static_cast<size_t>(r)];
      has_state = has_state && x.offsets.size() == 1 + state_names.size();  // none before the first update
      if (!has_state) continue;
      if (deferred) {
        later.shards.push_back({file, lo, hi, std::vector<uint64_t>(x.offsets.begin() + 1, x.offsets.end())});
        continue;
      }
      for (size_t i = 0; i < state_names.size(); ++i) {
        if (state.size() <= i) state.push_back(torch::empty({n}, torch::kFloat32));
        read_floats(file, x.offsets[i + 1], hi - lo, state[i].data_ptr<float>() + lo);
      }
      continue;
    }
    for (size_t i = 0; i < state_names.size() && has_state; ++i) {
      torch::Tensor t;
      if (!ar->try_read(state_names[i], t)) {
        has_state = false;  // written before the first update
        break;
      }
      if (state.size() <= i) state.push_back(torch::zeros({n}, torch::kFloat32));
      state[i].narrow(0, lo, hi - lo).copy_(t);
    }
  }
  if (expect_lo != n) throw InvalidInput("checkpoint '" + path + "': its shards do not cover its weights");
  if (opt && same_algorithm) {
    if (has_state && in_place && deferred) {
      check_same_trainable(o, model, n, path);
      later.step = step;
      later.numel = n;
      later.optimizer_steps = optimizer_steps;
      later.names = state_names;
      *deferred = std::move(later);
      opt->set_state({}, optimizer_steps);
    } else if (has_state && !state.empty()) {
      check_same_trainable(o, model, n, path);
      opt->set_state(std::move(state), optimizer_steps);
    } else {
      opt->set_state({}, optimizer_steps);
    }
  } else if (opt) {
    opt->reset_state();
  }
}

}  // namespace

void DeferredShardState::read(size_t i, int64_t a, int64_t b, float* dst) const {
  for (const auto& s : shards) {
    const int64_t x = std::max(a, s.lo), y = std::min(b, s.hi);
    if (y <= x) continue;
    read_floats(s.file, s.offsets.at(i) + sizeof(float) * static_cast<uint64_t>(x - s.lo), y - x, dst + (x - a));
  }
}

std::string shard_file(const std::string& path, int rank, int world, int64_t step) {
  return path + ".shard-" + std::to_string(rank) + "-of-" + std::to_string(world) + ".step-" + std::to_string(step);
}

void save_shard(const std::string& file, int64_t lo, int64_t hi, int64_t n, int64_t step, const float* weights,
                const std::vector<std::string>& state_names, const std::vector<const float*>& state,
                int64_t optimizer_steps) {
  torch::serialize::OutputArchive root;
  auto view = [&](const float* p) {
    return torch::from_blob(const_cast<float*>(p), {hi - lo}, torch::kFloat32);
  };
  root.write("lo", scalar(lo));
  root.write("hi", scalar(hi));
  root.write("numel", scalar(n));
  root.write("step", scalar(step));
  root.write("optimizer_steps", scalar(optimizer_steps));
  root.write("weights", view(weights));
  for (size_t i = 0; i < state.size() && i < state_names.size(); ++i) root.write(state_names[i], view(state[i]));
  write_archive(root, file);
}

void remove_other_shards(const std::string& path, int world, int64_t step) {
  const auto slash = path.rfind('/');
  const std::string dir = slash == std::string::npos ? "." : path.substr(0, slash);
  const std::string base = (slash == std::string::npos ? path : path.substr(slash + 1)) + ".shard-";
  const std::string keep = ".step-" + std::to_string(step);
  const std::string of = "-of-" + std::to_string(world) + keep;
  std::error_code ec;
  for (const auto& entry : std::filesystem::directory_iterator(dir, ec)) {
    const std::string name = entry.path().filename().string();
    if (name.rfind(base, 0) != 0) continue;
    const bool current = name.size() >= of.size() && name.compare(name.size() - of.size(), of.size(), of) == 0;
    if (!current) std::remove((dir + "/" + name).c_str());
  }
}

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
