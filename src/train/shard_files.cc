// A fully sharded checkpoint's shard files: each member's range of the flat
// weights and of the optimizer's state, written by the member that holds it
// and read in place at a resume (docs/sharded_state.md).
#include <caffe2/serialize/inline_container.h>
#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <map>
#include <optional>
#include <tuple>

#include "common/error.h"
#include "common/files.h"
#include "common/log.h"
#include "train/archive_io.h"
#include "train/checkpoint.h"

namespace limbo::train {
namespace {

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

}  // namespace

namespace archive_io {

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

}  // namespace archive_io

using namespace archive_io;

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

}  // namespace limbo::train
