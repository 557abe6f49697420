#include "data/token_dataset.h"

#include <algorithm>
#include <filesystem>
#include <map>
#include <regex>

#include "common/error.h"
#include "common/files.h"
#include "data/mix.h"

namespace limbo::data {

// --- TokenStream ---------------------------------------------------------------

namespace {

// Windows per epoch and the room left for the training phase.
struct Layout {
  int64_t windows = 0, max_phase = 0;
};

Layout layout(const TokenStream& s) {
  const int64_t len = s.tokens.rows(), t = s.context;
  if (t <= 0 || len < t + 1) return {};
  const int64_t full = (len - 1) / t;  // windows at phase 0
  Layout l;
  // Training gives up one window so that every phase in [0, T) fits.
  l.windows = s.fixed || full < 2 ? full : full - 1;
  l.max_phase = s.fixed ? 0 : std::min(t - 1, (len - 1) - l.windows * t);
  return l;
}

}  // namespace

int64_t TokenStream::windows() const { return layout(*this).windows; }

int64_t TokenStream::offset(int64_t epoch, int64_t id) const {
  const Layout l = layout(*this);
  if (l.max_phase == 0) return id * context;
  const uint64_t draw = splitmix(seed ^ splitmix(static_cast<uint64_t>(epoch) * 0x9e3779b97f4a7c15ULL + 0x746f6b656eULL));
  return id * context + static_cast<int64_t>(draw % static_cast<uint64_t>(l.max_phase + 1));
}

void TokenStream::read(int64_t start, int64_t n, int64_t* out) const {
  if (tokens.shards.empty()) {
    to_int64(tokens.dtype, tokens.row(start), n, out);
    return;
  }
  while (n > 0) {  // runs within one shard
    const uint8_t* p = tokens.row(start);
    auto next = std::upper_bound(tokens.shards.begin(), tokens.shards.end(), start,
                                 [](int64_t v, const MappedTensor::Shard& s) { return v < s.first_row; });
    const int64_t end = next == tokens.shards.end() ? tokens.rows() : next->first_row;
    const int64_t k = std::min(n, end - start);
    to_int64(tokens.dtype, p, k, out);
    start += k;
    out += k;
    n -= k;
  }
}

// --- files ---------------------------------------------------------------------

namespace {

// The one tensor of a safetensors token file: "tokens", or the only one.
MappedTensor token_tensor(const std::string& path) {
  auto all = read_safetensors(path);
  if (auto it = all.find("tokens"); it != all.end()) return it->second;
  if (all.size() == 1) return all.begin()->second;
  std::string have;
  for (const auto& [k, v] : all) have += (have.empty() ? "" : ", ") + k;
  throw InvalidInput("'" + path + "' holds " + (all.empty() ? std::string("no tensor") : "the tensors " + have) +
                     "; a token file holds one 1-D tensor (named \"tokens\" when there are several)");
}

MappedTensor read_token_file(const std::string& path) {
  MappedTensor t = path.size() > 4 && path.substr(path.size() - 4) == ".npy" ? read_npy(path) : token_tensor(path);
  if (t.shape.size() != 1) {
    std::string s = "[";
    for (size_t i = 0; i < t.shape.size(); ++i) s += (i ? ", " : "") + std::to_string(t.shape[i]);
    throw InvalidInput("'" + t.origin + "' has shape " + s + "]; a token stream is a 1-D array "
                       "(np.save(f, tokens.ravel()))");
  }
  if (!is_integer(t.dtype))
    throw InvalidInput("'" + t.origin + "' holds " + dtype_name(t.dtype) +
                       "; token ids are integers (uint8, int8, uint16, int16, int32 or int64)");
  return t;
}

// The stream of one split: SPLIT.npy, SPLIT.safetensors, or its shards.
MappedTensor read_split(const std::string& dir, const std::string& split) {
  std::vector<std::string> single;
  for (const char* ext : {".npy", ".safetensors"})
    if (file_exists(dir + "/" + split + ext)) single.push_back(dir + "/" + split + ext);
  const std::regex shard_re("^" + split + R"(-(\d+)-of-(\d+)\.(npy|safetensors)$)");
  std::map<int64_t, std::string> shards;
  std::map<std::string, int> kinds;  // "of-N.ext" -> files naming it
  int64_t of = 0;
  std::error_code ec;
  for (const auto& e : std::filesystem::directory_iterator(dir, ec)) {
    const std::string name = e.path().filename().string();
    std::smatch m;
    if (!std::regex_match(name, m, shard_re)) continue;
    of = std::stoll(m[2]);
    kinds[std::string(m[2]) + "." + std::string(m[3])] += 1;
    shards[std::stoll(m[1])] = e.path().string();
  }
  if (ec) throw InvalidInput("cannot read the token folder '" + dir + "': " + ec.message());
  const std::string forms = split + ".npy, " + split + ".safetensors, or shards " + split + "-00000-of-0000N.npy ...";
  if (single.size() + (shards.empty() ? 0 : 1) > 1)
    throw InvalidInput("token folder '" + dir + "' holds the " + split + " split more than once (" + forms +
                       "); keep one");
  if (!single.empty()) return read_token_file(single[0]);
  if (shards.empty())
    throw InvalidInput("token folder '" + dir + "' has no " + split + " split: expected " + forms);
  if (kinds.size() > 1)
    throw InvalidInput("token folder '" + dir + "': the " + split +
                       " shards disagree on their count or kind (e.g. -of-00004 and -of-00005, or .npy and "
                       ".safetensors)");
  std::vector<MappedTensor> parts;
  for (int64_t k = 0; k < of; ++k) {
    auto it = shards.find(k);
    if (it == shards.end())
      throw InvalidInput("token folder '" + dir + "': shard " + std::to_string(k) + " of the " + split + " split's " +
                         std::to_string(of) + " is missing (" + std::to_string(shards.size()) + " are there)");
    parts.push_back(read_token_file(it->second));
  }
  if (static_cast<int64_t>(shards.size()) != of)
    throw InvalidInput("token folder '" + dir + "': a " + split + " shard is numbered beyond its count " +
                       std::to_string(of));
  if (parts.size() == 1) return parts[0];
  return concat_rows(parts, dir + "/" + split + "-*-of-" + std::to_string(of));
}

// Smallest and largest token, with the position of each.
struct Range {
  int64_t lo = 0, hi = -1, lo_at = -1, hi_at = -1;
};

Range token_range(const TokenStream& s) {
  Range r;
  const int64_t len = s.tokens.rows(), chunk = 1 << 16;
  std::vector<int64_t> buf(chunk);
  for (int64_t at = 0; at < len; at += chunk) {
    const int64_t n = std::min(chunk, len - at);
    s.read(at, n, buf.data());
    for (int64_t i = 0; i < n; ++i) {
      const int64_t v = buf[i];
      if (r.hi_at < 0 || v < r.lo) r.lo = v, r.lo_at = at + i;
      if (r.hi_at < 0 || v > r.hi) r.hi = v, r.hi_at = at + i;
    }
  }
  return r;
}

}  // namespace

TokenProblem find_bad_token(const TokenStream& s, int64_t vocab) {
  const int64_t len = s.tokens.rows(), chunk = 1 << 16;
  std::vector<int64_t> buf(chunk);
  for (int64_t at = 0; at < len; at += chunk) {
    const int64_t n = std::min(chunk, len - at);
    s.read(at, n, buf.data());
    for (int64_t i = 0; i < n; ++i)
      if (buf[i] < 0 || buf[i] >= vocab) return {at + i, buf[i]};
  }
  return {};
}

std::string token_site(const TokenStream& s, int64_t position) {
  const MappedTensor& t = s.tokens;
  if (t.shards.empty()) return "'" + t.origin + "': the token at position " + std::to_string(position);
  auto it = std::upper_bound(t.shards.begin(), t.shards.end(), position,
                             [](int64_t v, const MappedTensor::Shard& sh) { return v < sh.first_row; }) - 1;
  return "'" + it->origin + "': the token at position " + std::to_string(position - it->first_row) +
         " (position " + std::to_string(position) + " of the stream)";
}

DatasetSplits load_token_dataset(const std::string& dir, const TokenOptions& opt) {
  if (dir.empty())
    throw InvalidInput("data.dataset = \"tokens\" needs data.path = a folder holding train.npy and val.npy "
                       "(1-D token ids), their safetensors, or shards of them");
  if (!std::filesystem::is_directory(dir))
    throw InvalidInput("token folder '" + dir + "' does not exist or is not a folder");
  if (opt.context <= 0)
    throw InvalidInput("data.dataset = \"tokens\" needs data.context = the tokens per sample (e.g. 256)");
  DatasetSplits s;
  for (const char* split : {"train", "val"}) {
    auto stream = std::make_shared<TokenStream>();
    stream->tokens = read_split(dir, split);
    stream->context = opt.context;
    stream->fixed = std::string(split) == "val";
    stream->seed = opt.seed;
    if (stream->tokens.rows() < opt.context + 1)
      throw InvalidInput("'" + stream->tokens.origin + "' holds " + std::to_string(stream->tokens.rows()) +
                         " tokens, fewer than data.context + 1 = " + std::to_string(opt.context + 1) +
                         " (one window and its next token)");
    Dataset& d = std::string(split) == "train" ? s.train : s.test;
    d.name = dir + "/" + split;
    d.shape = {opt.context, 1, 1};
    d.x_ids = true;
    d.tensor_rows = stream->windows();
    d.stream = std::move(stream);
  }
  int64_t vocab = opt.vocab;
  for (Dataset* d : {&s.train, &s.test}) {
    const Range r = token_range(*d->stream);
    if (r.lo < 0)
      throw InvalidInput(token_site(*d->stream, r.lo_at) + " is " + std::to_string(r.lo) +
                         "; token ids are not negative");
    if (opt.vocab > 0 && r.hi >= opt.vocab) {
      const TokenProblem bad = find_bad_token(*d->stream, opt.vocab);
      throw InvalidInput(token_site(*d->stream, bad.position) + " is " + std::to_string(bad.value) +
                         ", outside [0, " + std::to_string(opt.vocab) + ") of " + opt.vocab_from + " = " +
                         std::to_string(opt.vocab));
    }
    if (opt.vocab <= 0) vocab = std::max(vocab, r.hi + 1);
  }
  s.train.num_classes = s.test.num_classes = vocab;
  return s;
}

}  // namespace limbo::data
