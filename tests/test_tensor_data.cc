// Tensor datasets: the npy and safetensors readers (every dtype, memory
// mapping), every bad-input case with the file named in the message, and
// batches, normalisation and label checks built on them.
#include <gtest/gtest.h>
#include <sys/stat.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <numeric>
#include <set>

#include "common/error.h"
#include "common/files.h"
#include "data/loader.h"
#include "data/registry.h"
#include "data/tensor_dataset.h"
#include "data/tensor_file.h"
#include "data/token_dataset.h"
#include "train/safetensors.h"
#include "expect_invalid.h"
#include "test_util.h"

using namespace limbo;
using namespace limbo::data;
using limbo::testing::run_limbo;
using limbo::testing::expect_invalid;
using limbo::testing::TempDir;

namespace {

// An .npy file as np.save writes it (format 1.0, header padded to 64 bytes).
std::string npy_bytes(const std::string& descr, const std::vector<int64_t>& shape,
                      const std::string& data, bool fortran = false) {
  std::string sh = "(";
  for (auto d : shape) sh += std::to_string(d) + ", ";
  if (shape.size() > 1) sh.resize(sh.size() - 2);
  sh += ")";
  std::string h = "{'descr': '" + descr + "', 'fortran_order': " + (fortran ? "True" : "False") +
                  ", 'shape': " + sh + ", }";
  while ((10 + h.size() + 1) % 64) h += ' ';
  h += '\n';
  std::string out = "\x93NUMPY";
  out += '\x01';
  out += '\x00';
  out += static_cast<char>(h.size() & 0xff);
  out += static_cast<char>(h.size() >> 8);
  return out + h + data;
}

template <typename T>
std::string raw(const std::vector<T>& v) {
  return std::string(reinterpret_cast<const char*>(v.data()), v.size() * sizeof(T));
}

void put(const std::string& path, const std::string& bytes) {
  limbo::testing::write_bytes(path, bytes, false);
}

// A 4-sample dataset of 1x2x2 uint8 images with labels 0..3 as npy files.
void write_npy_dataset(const TempDir& d, int64_t n = 4) {
  std::vector<uint8_t> x(n * 4);
  for (size_t i = 0; i < x.size(); ++i) x[i] = static_cast<uint8_t>(i * 10);
  std::vector<int64_t> y(n);
  for (int64_t i = 0; i < n; ++i) y[i] = i % 4;
  for (const char* split : {"train", "test"}) {
    put(d.file(std::string(split) + "_x.npy"), npy_bytes("|u1", {n, 1, 2, 2}, raw(x)));
    put(d.file(std::string(split) + "_y.npy"), npy_bytes("<i8", {n}, raw(y)));
  }
}

}  // namespace

TEST(Npy, ReadsEveryDtypeMemoryMapped) {
  TempDir d;
  struct Case {
    std::string descr;
    DType t;
    std::string bytes;
  };
  std::vector<Case> cases = {
      {"|u1", DType::U8, raw(std::vector<uint8_t>{0, 7, 255})},
      {"|i1", DType::I8, raw(std::vector<int8_t>{-1, 7, -128})},
      {"<u2", DType::U16, raw(std::vector<uint16_t>{0, 7, 65535})},
      {"<i2", DType::I16, raw(std::vector<int16_t>{-5, 7, -32768})},
      {"<i4", DType::I32, raw(std::vector<int32_t>{-5, 7, 100000})},
      {"<i8", DType::I64, raw(std::vector<int64_t>{-5, 7, 1LL << 40})},
      {"<f2", DType::F16, raw(std::vector<uint16_t>{0x3c00, 0xc000, 0x3800})},  // 1, -2, 0.5
      {"<f4", DType::F32, raw(std::vector<float>{1.5f, -2.f, 3.25f})},
      {"<f8", DType::F64, raw(std::vector<double>{1.5, -2., 3.25})},
  };
  for (const auto& c : cases) {
    const std::string p = d.file("a.npy");
    put(p, npy_bytes(c.descr, {3}, c.bytes));
    auto t = read_npy(p);
    EXPECT_EQ(t.dtype, c.t) << c.descr;
    ASSERT_EQ(t.shape, std::vector<int64_t>{3});
    // The data is the file's mapping, not a copy: it sits at the header's end.
    EXPECT_EQ(t.data, t.file->data() + (t.file->size() - static_cast<int64_t>(c.bytes.size())));
    EXPECT_EQ(std::memcmp(t.data, c.bytes.data(), c.bytes.size()), 0);
  }
  float f[3];
  to_float(DType::F16, reinterpret_cast<const uint8_t*>(cases[6].bytes.data()), 3, f);
  EXPECT_EQ(f[0], 1.0f);
  EXPECT_EQ(f[1], -2.0f);
  EXPECT_EQ(f[2], 0.5f);
  int64_t v[3];
  to_int64(DType::I8, reinterpret_cast<const uint8_t*>(cases[1].bytes.data()), 3, v);
  EXPECT_EQ(v[2], -128);
  to_int64(DType::U16, reinterpret_cast<const uint8_t*>(cases[2].bytes.data()), 3, v);
  EXPECT_EQ(v[2], 65535);
  to_int64(DType::I16, reinterpret_cast<const uint8_t*>(cases[3].bytes.data()), 3, v);
  EXPECT_EQ(v[2], -32768);
}

TEST(Npy, BadFilesAreRefusedNamingTheFileAndTheProblem) {
  TempDir d;
  const std::string p = d.file("bad.npy");
  expect_invalid([&] { read_npy(d.file("missing.npy")); }, {"missing.npy", "cannot open"});
  put(p, npy_bytes("<u4", {2}, std::string(8, '\0')));
  expect_invalid([&] { read_npy(p); }, {"bad.npy", "'<u4'", "does not read"});
  put(p, npy_bytes("|b1", {2}, std::string(2, '\0')));
  expect_invalid([&] { read_npy(p); }, {"bad.npy", "'|b1'"});
  put(p, npy_bytes("<f4", {2, 2}, std::string(16, '\0'), /*fortran=*/true));
  expect_invalid([&] { read_npy(p); }, {"bad.npy", "Fortran order"});
  put(p, npy_bytes("|O", {2}, std::string(16, '\0')));
  expect_invalid([&] { read_npy(p); }, {"bad.npy", "object array"});
  put(p, npy_bytes(">f4", {2}, std::string(8, '\0')));
  expect_invalid([&] { read_npy(p); }, {"bad.npy", "big-endian"});
  put(p, npy_bytes("<f4", {10, 3}, std::string(100, '\0')));  // needs 120 bytes
  expect_invalid([&] { read_npy(p); }, {"bad.npy", "truncated", "120"});
  put(p, npy_bytes("<f4", {10}, std::string(40, '\0')).substr(0, 30));  // cut in the header
  expect_invalid([&] { read_npy(p); }, {"bad.npy", "truncated"});
  put(p, "PK\x03\x04 not numpy at all");
  expect_invalid([&] { read_npy(p); }, {"bad.npy", "not a .npy file"});
}

TEST(Safetensors, ReadsEveryDtypeIncludingBfloat16) {
  TempDir d;
  const std::string p = d.file("t.safetensors");
  train::NamedTensors ts = {
      {"u8", torch::tensor({1, 2, 255}, torch::kUInt8)},
      {"i8", torch::tensor({-1, 2, -3}, torch::kInt8)},
      {"i32", torch::tensor({-1, 2, 3}, torch::kInt32)},
      {"i64", torch::tensor({-1, 2, 3}, torch::kInt64)},
      {"f16", torch::tensor({0.5, -1.0, 2.0}, torch::kFloat16)},
      {"bf16", torch::tensor({0.5, -1.0, 2.0}, torch::kBFloat16)},
      {"f32", torch::tensor({0.25, -1.0, 2.0}, torch::kFloat32)},
      {"f64", torch::tensor({0.25, -1.0, 2.0}, torch::kFloat64)}};
  train::write_safetensors(p, ts, {{"format", "pt"}});
  auto all = read_safetensors(p);
  ASSERT_EQ(all.size(), ts.size());
  for (const auto& [name, t] : ts) {
    const auto& m = all.at(name);
    ASSERT_EQ(m.shape, std::vector<int64_t>{3}) << name;
    EXPECT_GE(m.data, m.file->data());
    EXPECT_LT(m.data, m.file->data() + m.file->size());
    std::vector<float> got(3);
    to_float(m.dtype, m.data, 3, got.data());
    auto want = t.to(torch::kFloat32);
    for (int i = 0; i < 3; ++i) EXPECT_EQ(got[i], want[i].item<float>()) << name << " " << i;
  }
}

TEST(Safetensors, CorruptFilesAreRefusedNamingTheFile) {
  TempDir d;
  const std::string p = d.file("bad.safetensors");
  auto with_header = [&](const std::string& json, const std::string& body) {
    std::string h = json;
    std::string out(8, '\0');
    uint64_t n = h.size();
    for (int i = 0; i < 8; ++i) out[i] = static_cast<char>((n >> (8 * i)) & 0xff);
    put(p, out + h + body);
  };
  with_header("{\"x\": {\"dtype\": \"F32\", \"shape\": [2], \"data_offsets\": [0, 8]", std::string(8, 0));
  expect_invalid([&] { read_safetensors(p); }, {"bad.safetensors", "corrupt safetensors header"});
  with_header("{\"x\": {\"dtype\": \"F32\", \"shape\": [4], \"data_offsets\": [0, 16]}}", std::string(8, 0));
  expect_invalid([&] { read_safetensors(p); }, {"bad.safetensors:x", "data_offsets end at byte 16"});
  with_header("{\"x\": {\"dtype\": \"F32\", \"shape\": [3], \"data_offsets\": [0, 8]}}", std::string(8, 0));
  expect_invalid([&] { read_safetensors(p); }, {"bad.safetensors:x", "needs 12 bytes"});
  with_header("{\"x\": {\"dtype\": \"BOOL\", \"shape\": [2], \"data_offsets\": [0, 2]}}", std::string(2, 0));
  expect_invalid([&] { read_safetensors(p); }, {"bad.safetensors:x", "'BOOL'"});
  with_header("{\"x\": {\"dtype\": \"F32\", \"shape\": [2], \"data_offsets\": [8, 0]}}", std::string(8, 0));
  expect_invalid([&] { read_safetensors(p); }, {"bad.safetensors:x", "bad data_offsets"});
  with_header("{\"x\": {\"dtype\": \"F32\", \"shape\": \"two\", \"data_offsets\": [0, 8]}}", std::string(8, 0));
  expect_invalid([&] { read_safetensors(p); }, {"bad.safetensors:x", "corrupt"});
  put(p, std::string("\xff\xff\xff\x00\x00\x00\x00\x00{}", 10));  // header length beyond the file
  expect_invalid([&] { read_safetensors(p); }, {"bad.safetensors", "exceeds the file"});
  put(p, "abc");
  expect_invalid([&] { read_safetensors(p); }, {"bad.safetensors", "truncated"});
}

TEST(TensorDataset, NpyFolderGivesBatchesScaledAndLabelled) {
  TempDir d;
  write_npy_dataset(d);
  auto s = load_tensor_dataset(d.path());
  EXPECT_EQ(s.train.size(), 4);
  EXPECT_EQ(s.train.num_classes, 4);
  EXPECT_EQ(s.train.shape.channels, 1);
  EXPECT_EQ(s.train.shape.height, 2);
  auto b = make_batch(s.train, {}, {2, 0});
  ASSERT_EQ(b.x.sizes(), (std::vector<int64_t>{2, 1, 2, 2}));
  EXPECT_FLOAT_EQ(b.x[0][0][0][0].item<float>(), 80.0f / 255.0f);  // uint8 scaled by 1/255
  EXPECT_EQ(b.y.scalar_type(), torch::kInt64);
  EXPECT_EQ(b.y[0].item<int64_t>(), 2);
  // standardize: per-channel mean 0, std 1 over the training split.
  auto norm = compute_normalization(s.train);
  ASSERT_EQ(norm.mean.size(), 1u);
  auto all = make_batch(s.train, norm, {0, 1, 2, 3});
  EXPECT_NEAR(all.x.mean().item<double>(), 0.0, 1e-5);
  EXPECT_NEAR(all.x.std(/*unbiased=*/false).item<double>(), 1.0, 1e-4);
  s.train.truncate(3);
  EXPECT_EQ(s.train.size(), 3);
}

TEST(TensorDataset, SafetensorsFolderWithFloatTargetsAndPerTokenLabels) {
  TempDir d;
  for (const char* split : {"train", "test"}) {
    train::write_safetensors(d.file(std::string(split) + ".safetensors"),
                             {{"x", torch::randn({5, 3}).to(torch::kBFloat16)},
                              {"y", torch::randn({5, 2})}},
                             {});
  }
  auto s = load_tensor_dataset(d.path());
  EXPECT_FALSE(has_labels(s.train));
  EXPECT_EQ(s.train.num_classes, 0);
  auto b = make_batch(s.train, {}, {0, 4});
  EXPECT_EQ(b.x.sizes(), (std::vector<int64_t>{2, 3}));
  EXPECT_EQ(b.y.scalar_type(), torch::kFloat32);
  EXPECT_EQ(b.y.sizes(), (std::vector<int64_t>{2, 2}));
  // Per-token labels [N, T] stay [n, T] int64.
  for (const char* split : {"train", "test"})
    train::write_safetensors(d.file(std::string(split) + ".safetensors"),
                             {{"x", torch::randn({5, 4, 3})}, {"y", (torch::arange(20) % 7).reshape({5, 4}).to(torch::kInt32)}},
                             {});
  auto t = load_tensor_dataset(d.path());
  EXPECT_TRUE(has_labels(t.train));
  EXPECT_EQ(make_batch(t.train, {}, {1}).y.sizes(), (std::vector<int64_t>{1, 4}));
}

TEST(TensorDataset, FolderProblemsAreRefusedNamingTheFile) {
  {
    TempDir d;
    expect_invalid([&] { load_tensor_dataset(d.path()); }, {d.path(), "train_x.npy"});
    write_npy_dataset(d);
    std::filesystem::remove(d.file("test_y.npy"));
    expect_invalid([&] { load_tensor_dataset(d.path()); }, {"test_y.npy", "does not exist"});
  }
  {
    TempDir d;  // lengths differ
    write_npy_dataset(d);
    put(d.file("train_y.npy"), npy_bytes("<i8", {3}, raw(std::vector<int64_t>{0, 1, 2})));
    expect_invalid([&] { load_tensor_dataset(d.path()); }, {"lengths differ", "train_x.npy", "4", "train_y.npy", "3"});
  }
  {
    TempDir d;  // a negative label
    write_npy_dataset(d);
    put(d.file("test_y.npy"), npy_bytes("<i8", {4}, raw(std::vector<int64_t>{0, 1, -3, 2})));
    expect_invalid([&] { load_tensor_dataset(d.path()); }, {"test_y.npy", "sample 2", "-3"});
  }
  {
    TempDir d;  // train and test shapes differ
    write_npy_dataset(d);
    put(d.file("test_x.npy"), npy_bytes("|u1", {4, 1, 2, 3}, std::string(24, '\0')));
    expect_invalid([&] { load_tensor_dataset(d.path()); }, {"differ in shape", "test_x.npy"});
  }
  {
    TempDir d;  // a missing tensor
    train::write_safetensors(d.file("train.safetensors"), {{"x", torch::zeros({2, 3})}, {"labels", torch::zeros({2})}}, {});
    train::write_safetensors(d.file("test.safetensors"), {{"x", torch::zeros({2, 3})}, {"y", torch::zeros({2})}}, {});
    expect_invalid([&] { load_tensor_dataset(d.path()); }, {"train.safetensors", "no tensor 'y'", "labels"});
  }
  {
    TempDir d;  // only one of the two safetensors files
    train::write_safetensors(d.file("train.safetensors"), {{"x", torch::zeros({2, 3})}, {"y", torch::zeros({2})}}, {});
    expect_invalid([&] { load_tensor_dataset(d.path()); }, {"test.safetensors", "does not exist"});
  }
}

// Through the CLI: every bad input exits with code 2, names the file, and
// leaves no run directory behind.
TEST(TensorDataset, BadInputExitsWithCode2AndWritesNothing) {
  TempDir d;
  write_npy_dataset(d, 8);
  auto train = [&](const std::vector<std::string>& extra) {
    std::vector<std::string> a = {"train", "--run-dir", d.file("run"), "--set", "data.dataset=tensors",
                                  "--set", "data.path=" + d.path(), "--set", "model.name=mlp",
                                  "--set", "train.epochs=1", "--set", "train.progress=false"};
    a.insert(a.end(), extra.begin(), extra.end());
    return run_limbo(a);
  };
  auto ok = train({});
  ASSERT_EQ(ok.exit_code, 0) << ok.output;
  std::filesystem::remove_all(d.file("run"));
  struct Case {
    std::string file, bytes, needle;
  };
  std::vector<uint8_t> x(32, 1);
  std::vector<Case> cases = {
      {"train_x.npy", npy_bytes("|u1", {8, 1, 2, 2}, raw(x)).substr(0, 100), "truncated"},
      {"train_x.npy", npy_bytes("<u4", {8, 1, 2, 2}, std::string(128, '\0')), "'<u4'"},
      {"train_x.npy", npy_bytes("|u1", {8, 1, 2, 2}, raw(x), true), "Fortran order"},
      {"train_y.npy", npy_bytes("|O", {8}, std::string(64, '\0')), "object array"},
      {"train_y.npy", npy_bytes("<i8", {7}, std::string(56, '\0')), "lengths differ"},
  };
  for (const auto& c : cases) {
    TempDir e;
    write_npy_dataset(e, 8);
    put(e.file(c.file), c.bytes);
    auto r = run_limbo({"train", "--run-dir", d.file("run"), "--set", "data.dataset=tensors", "--set",
                        "data.path=" + e.path(), "--set", "model.name=mlp", "--set", "train.progress=false"});
    EXPECT_EQ(r.exit_code, 2) << c.needle << ": " << r.output;
    EXPECT_NE(r.output.find(c.file), std::string::npos) << r.output;
    EXPECT_NE(r.output.find(c.needle), std::string::npos) << r.output;
    EXPECT_FALSE(file_exists(d.file("run"))) << c.needle << ": the run directory was created";
  }
}

// Found: a stray label sized the built-in models' output layer (1 + the
// largest label): 255 among 0..9 gave 256 outputs, 10^9 ran out of memory.
// Auto-sizing now needs every label below the largest in the training
// split; model.classes sets the size explicitly, and a label outside it is
// an error naming the file and the sample.
TEST(TensorDataset, AStrayLabelIsAnInputErrorNamingTheFileAndSample) {
  auto write = [](const TempDir& d, int64_t stray) {
    const int64_t n = 400;  // more samples than the stray label's classes
    std::vector<int64_t> y(n);
    for (int64_t i = 0; i < n; ++i) y[i] = i % 10;
    y[17] = stray;
    for (const char* split : {"train", "test"}) {
      put(d.file(std::string(split) + "_x.npy"), npy_bytes("|u1", {n, 1, 2, 2}, std::string(n * 4, '\1')));
      put(d.file(std::string(split) + "_y.npy"),
          npy_bytes("<i8", {n}, raw(std::string(split) == "train" ? y : std::vector<int64_t>(n, 3))));
    }
  };
  auto source = [](const TempDir& d, int64_t classes) {
    data::DataSource s;
    s.dataset = "tensors";
    s.path = d.path();
    s.classes = classes;
    return s;
  };
  {
    TempDir d;
    write(d, 255);
    expect_invalid([&] { load_tensor_dataset(d.path()); },
                   {"train_y.npy", "sample 17", "label 255", "never occur", "model.classes = 256"});
    // Explicit: 256 outputs are what the user asked for.
    EXPECT_EQ(data::load_dataset(source(d, 256)).train.num_classes, 256);
    expect_invalid([&] { data::load_dataset(source(d, 10)); },
                   {"train_y.npy", "sample 17", "label 255", "outside [0, 10)", "model.classes = 10"});
  }
  {
    TempDir d;  // far beyond the data: refused before anything is sized by it
    write(d, 1000000000);
    expect_invalid([&] { load_tensor_dataset(d.path()); },
                   {"train_y.npy", "sample 17", "label 1000000000", "more classes than"});
  }
  {
    TempDir d;  // dense labels: sized as before
    write(d, 7);
    EXPECT_EQ(load_tensor_dataset(d.path()).train.num_classes, 10);
    EXPECT_EQ(data::load_dataset(source(d, 12)).test.num_classes, 12);
  }
}

namespace {

// Rows [from, to) of the fixture arrays: x uint8 [n, 1, 2, 2], y int64 [n].
std::string x_rows(int64_t from, int64_t to) {
  std::vector<uint8_t> x;
  for (int64_t i = from * 4; i < to * 4; ++i) x.push_back(static_cast<uint8_t>(i * 7 % 251));
  return npy_bytes("|u1", {to - from, 1, 2, 2}, raw(x));
}
std::string y_rows(int64_t from, int64_t to) {
  std::vector<int64_t> y;
  for (int64_t i = from; i < to; ++i) y.push_back(i % 3);
  return npy_bytes("<i8", {to - from}, raw(y));
}

// The same 20 + 6 samples in one file per array, as numpy shards of uneven
// sizes, and as safetensors shards.
void write_single(const TempDir& d) {
  for (const char* s : {"train", "test"}) {
    const int64_t n = std::string(s) == "train" ? 20 : 6;
    put(d.file(std::string(s) + "_x.npy"), x_rows(0, n));
    put(d.file(std::string(s) + "_y.npy"), y_rows(0, n));
  }
}
const std::vector<int64_t> kTrainCuts = {0, 3, 4, 11, 20}, kTestCuts = {0, 6};
void write_npy_shards(const TempDir& d) {
  for (const char* s : {"train", "test"}) {
    const auto& cuts = std::string(s) == "train" ? kTrainCuts : kTestCuts;
    for (size_t k = 0; k + 1 < cuts.size(); ++k) {
      char name[64];
      std::snprintf(name, sizeof name, "%s_x-%05zu.npy", s, k);
      put(d.file(name), x_rows(cuts[k], cuts[k + 1]));
      std::snprintf(name, sizeof name, "%s_y-%05zu.npy", s, k);
      put(d.file(name), y_rows(cuts[k], cuts[k + 1]));
    }
  }
}
void write_safetensors_shards(const TempDir& d, const TempDir& single) {
  auto all = load_tensor_dataset(single.path());
  for (const char* s : {"train", "test"}) {
    const auto& cuts = std::string(s) == "train" ? kTrainCuts : kTestCuts;
    const Dataset& split = std::string(s) == "train" ? all.train : all.test;
    const int64_t n = static_cast<int64_t>(cuts.size()) - 1;
    for (int64_t k = 0; k < n; ++k) {
      std::vector<int64_t> ids;
      for (int64_t i = cuts[k]; i < cuts[k + 1]; ++i) ids.push_back(i);
      auto b = make_batch(split, {}, ids);
      char name[64];
      std::snprintf(name, sizeof name, "%s-%05lld-of-%05lld.safetensors", s, static_cast<long long>(k),
                    static_cast<long long>(n));
      train::write_safetensors(d.file(name), {{"x", (b.x * 255).round().to(torch::kUInt8)}, {"y", b.y}}, {});
    }
  }
}

void expect_same_data(const DatasetSplits& a, const DatasetSplits& b) {
  for (auto [p, q] : {std::pair{&a.train, &b.train}, std::pair{&a.test, &b.test}}) {
    ASSERT_EQ(p->size(), q->size());
    std::vector<int64_t> ids;
    for (int64_t i = p->size() - 1; i >= 0; --i) ids.push_back(i);  // any order
    auto x = make_batch(*p, {}, ids), y = make_batch(*q, {}, ids);
    EXPECT_TRUE(torch::equal(x.x, y.x));
    EXPECT_TRUE(torch::equal(x.y, y.y));
  }
  EXPECT_EQ(a.train.num_classes, b.train.num_classes);
  EXPECT_EQ(sample_shape(a.train), sample_shape(b.train));
}

}  // namespace

// A folder of shards, numpy pairs or safetensors files of uneven sizes, is
// one data set in shard order: every sample as in the single file.
TEST(TensorDataset, ShardsAreOneDataSetInShardOrder) {
  TempDir single, npy, st;
  write_single(single);
  write_npy_shards(npy);
  write_safetensors_shards(st, single);
  auto one = load_tensor_dataset(single.path());
  auto a = load_tensor_dataset(npy.path());
  expect_same_data(one, a);
  EXPECT_EQ(a.train.tensors->x.shards.size(), 4u);
  auto b = load_tensor_dataset(st.path());
  expect_same_data(one, b);
  EXPECT_EQ(b.test.tensors->y.shards.size(), 1u);
}

// A missing, damaged or mismatched shard is an input error naming it; so is
// a label that is out of range, named by its shard and its index there.
TEST(TensorDataset, ABadOrMissingShardIsRefusedNamingIt) {
  {
    TempDir d;
    write_npy_shards(d);
    std::filesystem::remove(d.file("train_y-00002.npy"));
    expect_invalid([&] { load_tensor_dataset(d.path()); }, {"train_y-00002.npy", "missing"});
  }
  {
    TempDir d;
    write_npy_shards(d);
    put(d.file("train_x-00001.npy"), x_rows(3, 4).substr(0, 100));  // truncated
    expect_invalid([&] { load_tensor_dataset(d.path()); }, {"train_x-00001.npy"});
  }
  {
    TempDir d;
    write_npy_shards(d);
    put(d.file("train_x-00003.npy"), npy_bytes("<f4", {9, 1, 2, 2}, std::string(9 * 16, '\0')));
    expect_invalid([&] { load_tensor_dataset(d.path()); }, {"train_x-00003.npy", "float32", "uint8"});
  }
  {
    TempDir d;
    write_npy_shards(d);
    put(d.file("train_y-00002.npy"), y_rows(4, 10));  // 6 labels for 7 samples
    expect_invalid([&] { load_tensor_dataset(d.path()); }, {"lengths differ", "train_x-00002.npy", "train_y-00002.npy"});
  }
  {
    TempDir d;
    write_npy_shards(d);
    std::vector<int64_t> y = {0, 1, 2, 0, 1, 2, 0, 1, 2};
    y[5] = -4;
    put(d.file("train_y-00003.npy"), npy_bytes("<i8", {9}, raw(y)));
    expect_invalid([&] { load_tensor_dataset(d.path()); }, {"train_y-00003.npy", "sample 5", "sample 16 of the split", "-4"});
  }
  {
    TempDir single, d;
    write_single(single);
    write_safetensors_shards(d, single);
    std::filesystem::remove(d.file("train-00001-of-00004.safetensors"));
    expect_invalid([&] { load_tensor_dataset(d.path()); }, {"train-00001-of-00004.safetensors", "missing", "3 of 4"});
  }
  {
    TempDir d;  // shards of one split only
    write_npy_shards(d);
    for (const char* f : {"test_x-00000.npy", "test_y-00000.npy"}) std::filesystem::remove(d.file(f));
    expect_invalid([&] { load_tensor_dataset(d.path()); }, {"none of the test split"});
  }
}

// Found: integer samples were always made float32, so a user's module with an
// embedding failed ("Expected tensor for argument #1 'indices' ... got
// CPUFloatType"). Integer x other than uint8 reaches a user's module as int64
// ids (data.inputs = auto); "ids" makes uint8 ids too; "float" keeps floats.
TEST(TensorDataset, IntegerSamplesReachAUsersModuleAsInt64Ids) {
  const int64_t n = 6, t = 5;
  auto write = [&](const TempDir& d, const std::string& descr, const std::string& bytes) {
    std::vector<int64_t> y(n * t);
    for (int64_t i = 0; i < n * t; ++i) y[i] = 40 + i % 3;  // labels with gaps below them
    for (const char* split : {"train", "test"}) {
      put(d.file(std::string(split) + "_x.npy"), npy_bytes(descr, {n, t}, bytes));
      put(d.file(std::string(split) + "_y.npy"), npy_bytes("<i8", {n, t}, raw(y)));
    }
  };
  auto source = [](const TempDir& d, const std::string& inputs, bool user_model) {
    data::DataSource s;
    s.dataset = "tensors";
    s.path = d.path();
    s.inputs = inputs;
    s.user_model = user_model;
    return s;
  };
  std::vector<int32_t> ids32(n * t);
  for (int64_t i = 0; i < n * t; ++i) ids32[i] = static_cast<int32_t>(1000 + 7 * i);
  std::vector<uint8_t> ids8(n * t);
  for (int64_t i = 0; i < n * t; ++i) ids8[i] = static_cast<uint8_t>(200 + i);
  {
    TempDir d;
    write(d, "<i4", raw(ids32));
    auto s = data::load_dataset(source(d, "auto", true));
    ASSERT_TRUE(s.train.x_ids);
    auto b = make_batch(s.train, {}, {3, 1});
    EXPECT_EQ(b.x.scalar_type(), torch::kInt64);
    ASSERT_EQ(b.x.sizes(), (std::vector<int64_t>{2, t}));
    EXPECT_EQ(b.x[0][2].item<int64_t>(), 1000 + 7 * (3 * t + 2));
    EXPECT_EQ(b.x[1][0].item<int64_t>(), 1000 + 7 * t);
    // The training batch (augmentation off) is the same.
    auto tb = make_train_batch(s.train, {}, {3, 1}, 0, Augmenter("", 1));
    EXPECT_TRUE(torch::equal(tb.x, b.x));
    // Labels 40..42 with gaps below: a user's module sizes its own outputs.
    EXPECT_EQ(s.train.num_classes, 43);
    // A built-in model gets floats, and the gaps are refused as before.
    expect_invalid([&] { data::load_dataset(source(d, "auto", false)); }, {"train_y.npy", "stray label"});
    EXPECT_FALSE(data::load_dataset(source(d, "float", true)).train.x_ids);
    auto f = make_batch(data::load_dataset(source(d, "float", true)).train, {}, {3});
    EXPECT_EQ(f.x.scalar_type(), torch::kFloat32);
    EXPECT_FLOAT_EQ(f.x[0][2].item<float>(), 1000.0f + 7 * (3 * t + 2));
  }
  {
    TempDir d;
    write(d, "|u1", raw(ids8));
    // uint8 is an image by default, ids when asked.
    EXPECT_FALSE(data::load_dataset(source(d, "auto", true)).train.x_ids);
    auto s = data::load_dataset(source(d, "ids", true));
    ASSERT_TRUE(s.train.x_ids);
    EXPECT_EQ(make_batch(s.train, {}, {1}).x[0][4].item<int64_t>(), 200 + t + 4);
  }
  {
    TempDir d;
    std::vector<float> xf(n * t, 0.5f);
    write(d, "<f4", raw(xf));
    expect_invalid([&] { data::load_dataset(source(d, "ids", true)); }, {"data.inputs", "train_x.npy", "float32"});
    expect_invalid([&] { data::load_dataset(source(d, "words", true)); }, {"data.inputs", "words"});
  }
}

// --- token streams (data.dataset = "tokens") -----------------------------------

namespace {

// A token folder: train.npy holding 0, 1, ..., n-1 as `descr` (uint16 by
// default) and val.npy holding 0 .. v-1 as int32.
void write_stream(const TempDir& d, int64_t n, int64_t v = 300) {
  std::vector<uint16_t> train(n);
  for (int64_t i = 0; i < n; ++i) train[i] = static_cast<uint16_t>(i);
  std::vector<int32_t> val(v);
  for (int64_t i = 0; i < v; ++i) val[i] = static_cast<int32_t>(i);
  put(d.file("train.npy"), npy_bytes("<u2", {n}, raw(train)));
  put(d.file("val.npy"), npy_bytes("<i4", {v}, raw(val)));
}

TokenOptions stream_options(int64_t context, int64_t vocab = 0) {
  TokenOptions o;
  o.context = context;
  o.vocab = vocab;
  o.seed = 7;
  return o;
}

}  // namespace

TEST(TokenStream, EachEpochTilesTheStreamFromAPhaseThatMovesWithTheEpoch) {
  TempDir d;
  write_stream(d, 1000);
  auto s = load_token_dataset(d.path(), stream_options(16));
  ASSERT_TRUE(s.train.stream && s.test.stream);
  EXPECT_TRUE(s.train.x_ids);
  EXPECT_EQ(s.train.num_classes, 1000);  // 1 + the largest token of either split
  EXPECT_EQ(s.train.size(), 999 / 16 - 1);  // one window given up so every phase fits
  EXPECT_EQ(s.test.size(), 299 / 16);
  EXPECT_EQ(sample_shape(s.train), std::vector<int64_t>{16});
  std::set<int64_t> phases;
  for (int64_t epoch = 0; epoch < 12; ++epoch) {
    std::vector<int64_t> ids(s.train.size());
    std::iota(ids.begin(), ids.end(), 0);
    std::reverse(ids.begin(), ids.end());  // order does not place a window: its id does
    Batch b = make_train_batch(s.train, {}, ids, epoch, Augmenter());
    ASSERT_EQ(b.x.sizes(), (std::vector<int64_t>{s.train.size(), 16}));
    ASSERT_EQ(b.x.scalar_type(), torch::kInt64);
    const int64_t phase = s.train.stream->offset(epoch, 0);
    ASSERT_GE(phase, 0);
    ASSERT_LT(phase, 16);
    phases.insert(phase);
    for (size_t r = 0; r < ids.size(); ++r) {
      const int64_t o = phase + ids[r] * 16;  // windows tile the stream: none overlap, none is skipped
      EXPECT_EQ(s.train.stream->offset(epoch, ids[r]), o);
      for (int64_t k = 0; k < 16; ++k) {
        ASSERT_EQ(b.x[r][k].item<int64_t>(), o + k) << "epoch " << epoch << " id " << ids[r];
        ASSERT_EQ(b.y[r][k].item<int64_t>(), o + k + 1);  // the next token
      }
    }
    EXPECT_LE(phase + s.train.size() * 16 + 1, 1000);  // the last target lies inside the stream
  }
  EXPECT_GE(phases.size(), 4u) << "the phase does not move with the epoch";
  // The same (seed, epoch, id) gives the same window: a redone step sees the same data.
  auto again = load_token_dataset(d.path(), stream_options(16));
  for (int64_t epoch = 0; epoch < 12; ++epoch)
    EXPECT_EQ(again.train.stream->offset(epoch, 3), s.train.stream->offset(epoch, 3));
  // Validation windows never move: window i starts at i * T in every epoch.
  for (int64_t epoch : {0, 5}) {
    Batch v = make_train_batch(s.test, {}, {0, 4, 17}, epoch, Augmenter());
    EXPECT_EQ(v.x[1][0].item<int64_t>(), 64);
    EXPECT_EQ(v.x[2][15].item<int64_t>(), 17 * 16 + 15);
    EXPECT_EQ(v.y[2][15].item<int64_t>(), 17 * 16 + 16);
  }
  Batch e = make_batch(s.test, {}, {2});  // evaluation's batches
  EXPECT_EQ(e.x[0][0].item<int64_t>(), 32);
}

TEST(TokenStream, ShardsAndSafetensorsReadAsOneStreamAcrossTheirBoundaries) {
  TempDir d;
  std::vector<uint8_t> all(337);
  for (size_t i = 0; i < all.size(); ++i) all[i] = static_cast<uint8_t>(i % 251);
  const int64_t cuts[4] = {0, 100, 137, 337};
  for (int k = 0; k < 3; ++k) {
    std::vector<uint8_t> part(all.begin() + cuts[k], all.begin() + cuts[k + 1]);
    char name[64];
    std::snprintf(name, sizeof name, "train-%05d-of-00003.npy", k);
    put(d.file(name), npy_bytes("|u1", {cuts[k + 1] - cuts[k]}, raw(part)));
  }
  std::vector<int64_t> val(50, 3);
  torch::Tensor vt = torch::tensor(val, torch::kInt64);
  train::write_safetensors(d.file("val.safetensors"), {{"tokens", vt}}, {});
  auto s = load_token_dataset(d.path(), stream_options(40, 251));
  EXPECT_EQ(s.train.stream->tokens.rows(), 337);
  EXPECT_EQ(s.test.size(), 1);
  // Read every window of every epoch against the whole array.
  for (int64_t epoch = 0; epoch < 5; ++epoch)
    for (int64_t id = 0; id < s.train.size(); ++id) {
      const int64_t o = s.train.stream->offset(epoch, id);
      Batch b = make_train_batch(s.train, {}, {id}, epoch, Augmenter());
      for (int64_t k = 0; k < 40; ++k) {
        ASSERT_EQ(b.x[0][k].item<int64_t>(), all[o + k]) << "epoch " << epoch << " id " << id << " at " << o + k;
        ASSERT_EQ(b.y[0][k].item<int64_t>(), all[o + k + 1]);
      }
    }
  EXPECT_EQ(make_batch(s.test, {}, {0}).x[0][5].item<int64_t>(), 3);
}

TEST(TokenStream, BadStreamsAreInputErrorsNamingTheFileAndPosition) {
  {  // a token beyond the vocabulary, in a shard: the shard and the position there
    TempDir d;
    write_stream(d, 400, 300);
    expect_invalid([&] { load_token_dataset(d.path(), stream_options(8, 350)); },
                   {"train.npy", "the token at position 350", "is 350", "outside [0, 350)", "data.vocab = 350"});
    TokenOptions o = stream_options(8, 399);
    o.vocab_from = "model.classes";
    expect_invalid([&] { load_token_dataset(d.path(), o); }, {"position 399", "model.classes = 399"});
  }
  {  // negative ids
    TempDir d;
    write_stream(d, 100);
    put(d.file("val.npy"), npy_bytes("<i2", {4}, raw(std::vector<int16_t>{1, 2, -7, 3})));
    expect_invalid([&] { load_token_dataset(d.path(), stream_options(2)); },
                   {"val.npy", "position 2", "is -7", "not negative"});
  }
  {  // shards: the position in the shard and in the stream
    TempDir d;
    write_stream(d, 100);
    std::filesystem::remove(d.file("val.npy"));
    put(d.file("val-00000-of-00002.npy"), npy_bytes("|u1", {3}, raw(std::vector<uint8_t>{1, 2, 3})));
    put(d.file("val-00001-of-00002.npy"), npy_bytes("|u1", {3}, raw(std::vector<uint8_t>{4, 200, 6})));
    expect_invalid([&] { load_token_dataset(d.path(), stream_options(2, 100)); },
                   {"val-00001-of-00002.npy", "position 1 (position 4 of the stream)", "is 200"});
    std::filesystem::remove(d.file("val-00000-of-00002.npy"));
    expect_invalid([&] { load_token_dataset(d.path(), stream_options(2, 256)); }, {"shard 0", "missing"});
    put(d.file("val.npy"), npy_bytes("|u1", {3}, raw(std::vector<uint8_t>{1, 2, 3})));
    expect_invalid([&] { load_token_dataset(d.path(), stream_options(2, 256)); }, {"more than once"});
  }
  {  // shapes, dtypes, lengths and missing splits
    TempDir d;
    write_stream(d, 100);
    expect_invalid([&] { load_token_dataset(d.path(), stream_options(0)); }, {"data.context"});
    expect_invalid([&] { load_token_dataset(d.path(), stream_options(100)); },
                   {"train.npy", "holds 100 tokens", "data.context + 1 = 101"});
    put(d.file("val.npy"), npy_bytes("<i4", {2, 3}, std::string(24, '\0')));
    expect_invalid([&] { load_token_dataset(d.path(), stream_options(2)); }, {"val.npy", "[2, 3]", "1-D"});
    put(d.file("val.npy"), npy_bytes("<f4", {6}, std::string(24, '\0')));
    expect_invalid([&] { load_token_dataset(d.path(), stream_options(2)); }, {"val.npy", "float32", "integers"});
    std::filesystem::remove(d.file("val.npy"));
    expect_invalid([&] { load_token_dataset(d.path(), stream_options(2)); }, {"no val split", "val.npy"});
    expect_invalid([&] { load_token_dataset(d.file("nowhere"), stream_options(2)); }, {"nowhere", "does not exist"});
  }
}

TEST(TokenStream, TheCliRefusesBadTokensWithCode2AndWritesNothing) {
  TempDir d;
  write_stream(d, 400, 300);
  const std::string run = d.file("run");
  auto r = run_limbo({"train", "--run-dir", run, "--set", "data.dataset=tokens", "--set", "data.path=" + d.path(),
                      "--set", "data.context=8", "--set", "data.vocab=256", "--set", "model.name=torchscript",
                      "--set", "model.path=" + d.file("absent.pt")});
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find("the token at position 256"), std::string::npos) << r.output;
  EXPECT_FALSE(std::filesystem::exists(run));
  // Token streams feed ids to a user's module; a built-in model is refused.
  auto b = run_limbo({"train", "--run-dir", run, "--set", "data.dataset=tokens", "--set", "data.path=" + d.path(),
                      "--set", "data.context=8"});
  EXPECT_EQ(b.exit_code, 2) << b.output;
  EXPECT_NE(b.output.find("TorchScript module"), std::string::npos) << b.output;
  // data.context on another dataset is a mistake, not silently ignored.
  auto c = run_limbo({"train", "--run-dir", run, "--set", "data.dataset=synthetic", "--set", "data.context=8"});
  EXPECT_EQ(c.exit_code, 2) << c.output;
  EXPECT_NE(c.output.find("data.context is for token streams"), std::string::npos) << c.output;
  EXPECT_FALSE(std::filesystem::exists(run));
}
