#include "data/tensor_dataset.h"

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <map>
#include <regex>

#include "common/error.h"
#include "common/files.h"
#include "data/token_dataset.h"

namespace limbo::data {
namespace {

std::string shape_str(const std::vector<int64_t>& s, size_t from = 0) {
  std::string out = "[";
  for (size_t i = from; i < s.size(); ++i) out += (i > from ? ", " : "") + std::to_string(s[i]);
  return out + "]";
}

MappedTensor take(std::map<std::string, MappedTensor>& all, const std::string& name,
                  const std::string& file) {
  auto it = all.find(name);
  if (it == all.end()) {
    std::string have;
    for (const auto& [k, v] : all) have += (have.empty() ? "" : ", ") + k;
    throw InvalidInput("'" + file + "' has no tensor '" + name + "' (it holds: " +
                       (have.empty() ? "nothing" : have) + "); a tensor dataset needs x and y");
  }
  return it->second;
}

// Applies the checks that concern one split; fills everything but num_classes.
Dataset make_split(MappedTensor x, MappedTensor y, const std::string& name) {
  if (x.shape.empty())
    throw InvalidInput("'" + x.origin + "' is a scalar; x needs a first dimension of samples");
  if (y.shape.empty())
    throw InvalidInput("'" + y.origin + "' is a scalar; y needs a first dimension of samples");
  if (x.shape[0] != y.shape[0])
    throw InvalidInput("x and y lengths differ: '" + x.origin + "' holds " +
                       std::to_string(x.shape[0]) + " samples, '" + y.origin + "' holds " +
                       std::to_string(y.shape[0]));
  Dataset d;
  d.name = name;
  const auto& s = x.shape;
  if (s.size() >= 4) d.shape = {s[1], s[2], s[3]};
  else if (s.size() == 3) d.shape = {1, s[1], s[2]};
  else if (s.size() == 2) d.shape = {s[1], 1, 1};
  else d.shape = {1, 1, 1};
  d.tensor_rows = x.shape[0];
  d.tensors = std::make_shared<const TensorPair>(TensorPair{std::move(x), std::move(y)});
  return d;
}

// The shards of a split in `dir`, in shard order: safetensors files
// "SPLIT-00000-of-00016.safetensors" ... (each with x and y; every index
// below the count present) or numpy pairs "SPLIT_x-00000.npy" +
// "SPLIT_y-00000.npy" ... (numbered from 0 without a gap). Empty when the
// folder holds none; InvalidInput naming a missing shard.
struct Shards {
  std::vector<std::string> x, y;  // y empty for safetensors (x and y in one file)
};

Shards find_shards(const std::string& dir, const std::string& split) {
  const std::regex st("^" + split + R"(-(\d+)-of-(\d+)\.safetensors$)");
  const std::regex np("^" + split + R"(_([xy])-(\d+)\.npy$)");
  std::map<int64_t, std::string> st_files, xs, ys;
  std::map<int64_t, int64_t> counts;  // "-of-N" -> files naming it
  int64_t of = -1;
  std::error_code ec;
  for (const auto& e : std::filesystem::directory_iterator(dir, ec)) {
    const std::string name = e.path().filename().string();
    std::smatch m;
    if (std::regex_match(name, m, st)) {
      of = std::stoll(m[2]);
      counts[of] += 1;
      st_files[std::stoll(m[1])] = e.path().string();
    } else if (std::regex_match(name, m, np)) {
      (m[1] == "x" ? xs : ys)[std::stoll(m[2])] = e.path().string();
    }
  }
  if (!st_files.empty() && (!xs.empty() || !ys.empty()))
    throw InvalidInput("tensor dataset folder '" + dir + "' holds both safetensors and numpy shards of the " + split +
                       " split; keep one kind");
  Shards out;
  if (!st_files.empty()) {
    if (counts.size() > 1)
      throw InvalidInput("tensor dataset folder '" + dir + "': the " + split + " shards disagree on their count (" +
                         std::to_string(counts.begin()->first) + " and " + std::to_string(counts.rbegin()->first) +
                         " in their names)");
    for (int64_t k = 0; k < of; ++k) {
      auto it = st_files.find(k);
      if (it == st_files.end()) {
        char name[96];
        std::snprintf(name, sizeof name, "%s-%05lld-of-%05lld.safetensors", split.c_str(), static_cast<long long>(k),
                      static_cast<long long>(of));
        throw InvalidInput("tensor dataset: shard '" + dir + "/" + name + "' is missing (" +
                           std::to_string(st_files.size()) + " of " + std::to_string(of) + " " + split +
                           " shards are there)");
      }
      out.x.push_back(it->second);
    }
    if (static_cast<int64_t>(st_files.size()) != of)
      throw InvalidInput("tensor dataset folder '" + dir + "': a " + split + " shard is numbered beyond its count " +
                         std::to_string(of));
    return out;
  }
  const int64_t n = std::max(xs.empty() ? 0 : xs.rbegin()->first + 1, ys.empty() ? 0 : ys.rbegin()->first + 1);
  for (int64_t k = 0; k < n; ++k) {
    for (auto* m : {&xs, &ys})
      if (!m->count(k)) {
        char name[96];
        std::snprintf(name, sizeof name, "%s_%s-%05lld.npy", split.c_str(), m == &xs ? "x" : "y",
                      static_cast<long long>(k));
        throw InvalidInput("tensor dataset: shard '" + dir + "/" + name + "' is missing (the " + split +
                           " shards go up to " + std::to_string(n - 1) + ")");
      }
    out.x.push_back(xs[k]);
    out.y.push_back(ys[k]);
  }
  return out;
}

// The shards' x and y, each as one array of all their rows.
Dataset load_shards(const Shards& sh, const std::string& name) {
  std::vector<MappedTensor> xs, ys;
  for (size_t k = 0; k < sh.x.size(); ++k) {
    if (sh.y.empty()) {
      auto all = read_safetensors(sh.x[k]);
      xs.push_back(take(all, "x", sh.x[k]));
      ys.push_back(take(all, "y", sh.x[k]));
    } else {
      xs.push_back(read_npy(sh.x[k]));
      ys.push_back(read_npy(sh.y[k]));
    }
    if (xs.back().rows() != ys.back().rows() || xs.back().shape.empty() || ys.back().shape.empty())
      throw InvalidInput("x and y lengths differ in a shard: '" + xs.back().origin + "' holds " +
                         std::to_string(xs.back().rows()) + " samples, '" + ys.back().origin + "' holds " +
                         std::to_string(ys.back().rows()));
  }
  const std::string pattern = sh.y.empty() ? name + "-*-of-" + std::to_string(sh.x.size()) + ".safetensors"
                                           : name + "_*-*.npy";
  return make_split(concat_rows(xs, pattern + (sh.y.empty() ? ":x" : " (x)")),
                    concat_rows(ys, pattern + (sh.y.empty() ? ":y" : " (y)")), name);
}

// Smallest and largest label (integer targets only).
std::pair<int64_t, int64_t> label_range(const Dataset& d, int64_t* min_at, int64_t* max_at = nullptr) {
  const MappedTensor& y = d.tensors->y;
  int64_t lo = 0, hi = -1;
  std::vector<int64_t> row(y.row_numel());
  for (int64_t i = 0; i < d.size(); ++i) {
    to_int64(y.dtype, y.row(i), y.row_numel(), row.data());
    for (int64_t v : row) {
      if (hi < lo) {
        lo = hi = v;
        *min_at = i;
        if (max_at) *max_at = i;
      }
      if (v < lo) {
        lo = v;
        *min_at = i;
      }
      if (v > hi) {
        hi = v;
        if (max_at) *max_at = i;
      }
    }
  }
  return {lo, hi};
}

// Auto-sizing (classes = 1 + the largest label) is refused when a label
// below the largest never occurs in the training split.
void check_dense_labels(const Dataset& train, const Dataset& holder, int64_t hi, int64_t hi_at) {
  const auto stray = [&](const std::string& why) {
    throw InvalidInput(holder.tensors->y.sample_name(hi_at) + " has the label " +
                       std::to_string(hi) + ", " + why + "; a stray label? If the model should have " +
                       std::to_string(hi + 1) + " outputs, set model.classes = " + std::to_string(hi + 1));
  };
  if (hi + 1 > train.size() * train.tensors->y.row_numel())
    stray("more classes than the training split has labels (" + std::to_string(train.size()) + " samples)");
  std::vector<char> seen(static_cast<size_t>(hi + 1), 0);
  const MappedTensor& y = train.tensors->y;
  std::vector<int64_t> row(y.row_numel());
  for (int64_t i = 0; i < train.size(); ++i) {
    to_int64(y.dtype, y.row(i), y.row_numel(), row.data());
    for (int64_t v : row) seen[static_cast<size_t>(v)] = 1;
  }
  int64_t missing = 0, first = -1;
  for (int64_t c = 0; c <= hi; ++c)
    if (!seen[static_cast<size_t>(c)]) {
      ++missing;
      if (first < 0) first = c;
    }
  if (missing > 0)
    stray(std::to_string(missing) + " of the labels below it (the first: " + std::to_string(first) +
          ") never occur in the training split");
}

}  // namespace

std::vector<int64_t> sample_shape(const Dataset& d) {
  if (d.stream) return {d.stream->context};
  if (!d.tensors) return {d.shape.channels, d.shape.height, d.shape.width};
  const auto& s = d.tensors->x.shape;
  return {s.begin() + 1, s.end()};
}

std::vector<int64_t> target_shape(const Dataset& d) {
  if (d.stream) return {d.stream->context};
  if (!d.tensors) return {};
  const auto& s = d.tensors->y.shape;
  return {s.begin() + 1, s.end()};
}

bool has_labels(const Dataset& d) { return !d.tensors || is_integer(d.tensors->y.dtype); }

LabelProblem find_bad_label(const Dataset& d, int64_t num_classes) {
  LabelProblem p;
  if (!has_labels(d)) return p;
  if (d.stream) {
    const TokenProblem bad = find_bad_token(*d.stream, num_classes);
    return {bad.position, bad.value};
  }
  if (!d.tensors) {
    for (int64_t i = 0; i < d.size(); ++i)
      if (d.labels[i] >= num_classes) return {i, d.labels[i]};
    return p;
  }
  const MappedTensor& y = d.tensors->y;
  std::vector<int64_t> row(y.row_numel());
  for (int64_t i = 0; i < d.size(); ++i) {
    to_int64(y.dtype, y.row(i), y.row_numel(), row.data());
    for (int64_t v : row)
      if (v < 0 || v >= num_classes) return {i, v};
  }
  return p;
}

std::string label_site(const Dataset& d, int64_t index) {
  if (d.stream) return token_site(*d.stream, index);
  if (d.tensors) return d.tensors->y.sample_name(index);
  return "'" + d.name + "': sample " + std::to_string(index);
}

DatasetSplits load_tensor_dataset(const std::string& dir, int64_t classes, bool sized_by_model) {
  if (dir.empty())
    throw InvalidInput("data.dataset = \"tensors\" needs data.path = a folder holding "
                       "train.safetensors and test.safetensors, or train_x.npy, train_y.npy, "
                       "test_x.npy and test_y.npy");
  DatasetSplits s;
  const std::string st_train = dir + "/train.safetensors", st_test = dir + "/test.safetensors";
  const std::string names[4] = {"train_x.npy", "train_y.npy", "test_x.npy", "test_y.npy"};
  bool any_npy = false;
  for (const auto& n : names) any_npy = any_npy || file_exists(dir + "/" + n);
  if (file_exists(st_train) || file_exists(st_test)) {
    for (const auto* f : {&st_train, &st_test})
      if (!file_exists(*f)) throw InvalidInput("tensor dataset: '" + *f + "' does not exist");
    auto train = read_safetensors(st_train);
    auto test = read_safetensors(st_test);
    s.train = make_split(take(train, "x", st_train), take(train, "y", st_train), dir + "/train");
    s.test = make_split(take(test, "x", st_test), take(test, "y", st_test), dir + "/test");
  } else if (any_npy) {
    for (const auto& n : names)
      if (!file_exists(dir + "/" + n))
        throw InvalidInput("tensor dataset: '" + dir + "/" + n + "' does not exist");
    s.train = make_split(read_npy(dir + "/train_x.npy"), read_npy(dir + "/train_y.npy"), dir + "/train");
    s.test = make_split(read_npy(dir + "/test_x.npy"), read_npy(dir + "/test_y.npy"), dir + "/test");
  } else {
    const Shards train = find_shards(dir, "train"), test = find_shards(dir, "test");
    if (train.x.empty() && test.x.empty())
      throw InvalidInput("tensor dataset folder '" + dir +
                         "' holds neither train.safetensors + test.safetensors nor "
                         "train_x.npy, train_y.npy, test_x.npy, test_y.npy, nor shards of them "
                         "(train-00000-of-00016.safetensors ..., or train_x-00000.npy + "
                         "train_y-00000.npy ...)");
    for (const auto* sh : {&train, &test})
      if (sh->x.empty())
        throw InvalidInput("tensor dataset folder '" + dir + "' holds shards of the " +
                           (sh == &train ? "test split but none of the train split" : "train split but none of the test split") +
                           " (" + (sh == &train ? "train" : "test") + "-00000-of-0000N.safetensors ... or " +
                           (sh == &train ? "train" : "test") + "_x-00000.npy ...)");
    s.train = load_shards(train, dir + "/train");
    s.test = load_shards(test, dir + "/test");
  }
  const auto& trx = s.train.tensors->x;
  const auto& tex = s.test.tensors->x;
  const auto& try_ = s.train.tensors->y;
  const auto& tey = s.test.tensors->y;
  if (sample_shape(s.train) != sample_shape(s.test))
    throw InvalidInput("train and test samples differ in shape: '" + trx.origin + "' has " +
                       shape_str(trx.shape, 1) + ", '" + tex.origin + "' has " +
                       shape_str(tex.shape, 1));
  if (target_shape(s.train) != target_shape(s.test) || has_labels(s.train) != has_labels(s.test))
    throw InvalidInput("train and test targets differ: '" + try_.origin + "' is " +
                       dtype_name(try_.dtype) + " " + shape_str(try_.shape, 1) + ", '" +
                       tey.origin + "' is " + dtype_name(tey.dtype) + " " +
                       shape_str(tey.shape, 1));
  if (has_labels(s.train)) {
    int64_t hi = -1, hi_at = -1;
    const Dataset* holder = &s.train;
    for (Dataset* d : {&s.train, &s.test}) {
      int64_t at = 0, top_at = 0;
      auto [lo, h] = label_range(*d, &at, &top_at);
      if (lo < 0)
        throw InvalidInput(d->tensors->y.sample_name(at) + " has the negative label " + std::to_string(lo));
      if (h > hi) {
        hi = h;
        hi_at = top_at;
        holder = d;
      }
    }
    if (classes <= 0 && hi >= 0 && !sized_by_model) check_dense_labels(s.train, *holder, hi, hi_at);
    s.train.num_classes = s.test.num_classes = classes > 0 ? classes : hi + 1;
  }
  return s;
}

}  // namespace limbo::data
