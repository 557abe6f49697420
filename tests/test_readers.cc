// Dataset readers on good and corrupt files: IDX (raw and .gz), CIFAR-10
// binary, synthetic, and the real Fashion-MNIST files when installed.
#include <gtest/gtest.h>

#include "common/error.h"
#include "common/files.h"
#include "data/cifar10.h"
#include "data/idx.h"
#include "data/registry.h"
#include "data/synthetic.h"
#include "expect_invalid.h"
#include "test_util.h"

using namespace limbo;
using namespace limbo::data;
using limbo::testing::idx_bytes;
using limbo::testing::expect_invalid;
using limbo::testing::TempDir;
using limbo::testing::write_bytes;

namespace {

std::vector<uint8_t> ramp(size_t n, int mod = 256) {
  std::vector<uint8_t> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = static_cast<uint8_t>(i % mod);
  return v;
}

class IdxTest : public ::testing::TestWithParam<bool> {};  // param: gzip

TEST_P(IdxTest, ReadsImagesAndLabels) {
  TempDir d;
  bool gz = GetParam();
  std::string im = d.file(gz ? "im.gz" : "im"), lb = d.file(gz ? "lb.gz" : "lb");
  write_bytes(im, idx_bytes({3, 4, 5}, ramp(60)), gz);
  write_bytes(lb, idx_bytes({3}, {7, 0, 9}), gz);
  Dataset ds = read_idx_dataset(im, lb, "t");
  EXPECT_EQ(ds.size(), 3);
  EXPECT_EQ(ds.shape.channels, 1);
  EXPECT_EQ(ds.shape.height, 4);
  EXPECT_EQ(ds.shape.width, 5);
  EXPECT_EQ(ds.labels, (std::vector<uint8_t>{7, 0, 9}));
  EXPECT_EQ(ds.image(2)[0], 40);
  EXPECT_EQ(ds.image(2)[19], 59);
}

TEST_P(IdxTest, RejectsBadMagic) {
  TempDir d;
  std::string bytes = idx_bytes({2}, {1, 2});
  bytes[0] = 0x1f;
  write_bytes(d.file("x"), bytes, GetParam());
  expect_invalid([&] { read_idx(d.file("x")); }, {d.file("x"), "bad magic"});
}

TEST_P(IdxTest, RejectsUnsupportedType) {
  TempDir d;
  std::string bytes = idx_bytes({2}, {1, 2});
  bytes[2] = 0x0D;  // float
  write_bytes(d.file("x"), bytes, GetParam());
  expect_invalid([&] { read_idx(d.file("x")); }, {d.file("x"), "element type"});
}

TEST_P(IdxTest, RejectsTruncatedBody) {
  TempDir d;
  std::string bytes = idx_bytes({10, 4, 4}, ramp(160));
  bytes.resize(bytes.size() - 17);
  write_bytes(d.file("x"), bytes, GetParam());
  expect_invalid([&] { read_idx(d.file("x")); }, {d.file("x"), "truncated", "160"});
}

TEST_P(IdxTest, RejectsTruncatedHeader) {
  TempDir d;
  write_bytes(d.file("x"), idx_bytes({10, 4, 4}, {}).substr(0, 9), GetParam());
  expect_invalid([&] { read_idx(d.file("x")); }, {d.file("x"), "truncated"});
}

TEST_P(IdxTest, RejectsTrailingBytes) {
  TempDir d;
  write_bytes(d.file("x"), idx_bytes({2}, {1, 2, 3}), GetParam());
  expect_invalid([&] { read_idx(d.file("x")); }, {d.file("x"), "trailing"});
}

TEST_P(IdxTest, RejectsWrongDimensions) {
  TempDir d;
  bool gz = GetParam();
  write_bytes(d.file("im"), idx_bytes({3, 20}, ramp(60)), gz);  // 2-D "images"
  write_bytes(d.file("lb"), idx_bytes({3}, {1, 2, 3}), gz);
  expect_invalid([&] { read_idx_dataset(d.file("im"), d.file("lb"), "t"); },
                 {d.file("im"), "dimensions", "expected 3"});
  write_bytes(d.file("im"), idx_bytes({3, 4, 5}, ramp(60)), gz);
  write_bytes(d.file("lb"), idx_bytes({3, 1}, {1, 2, 3}), gz);  // 2-D labels
  expect_invalid([&] { read_idx_dataset(d.file("im"), d.file("lb"), "t"); },
                 {d.file("lb"), "dimensions", "expected 1"});
}

TEST_P(IdxTest, RejectsCountMismatch) {
  TempDir d;
  bool gz = GetParam();
  write_bytes(d.file("im"), idx_bytes({3, 4, 5}, ramp(60)), gz);
  write_bytes(d.file("lb"), idx_bytes({2}, {1, 2}), gz);
  expect_invalid([&] { read_idx_dataset(d.file("im"), d.file("lb"), "t"); },
                 {"3 images", "2 labels", d.file("im"), d.file("lb")});
}

TEST_P(IdxTest, RejectsLabelOutOfRange) {
  TempDir d;
  bool gz = GetParam();
  write_bytes(d.file("im"), idx_bytes({2, 4, 5}, ramp(40)), gz);
  write_bytes(d.file("lb"), idx_bytes({2}, {1, 10}), gz);
  expect_invalid([&] { read_idx_dataset(d.file("im"), d.file("lb"), "t"); },
                 {d.file("lb"), "label 10", "index 1"});
}

INSTANTIATE_TEST_SUITE_P(RawAndGzip, IdxTest, ::testing::Values(false, true),
                         [](const auto& info) { return info.param ? "gzip" : "raw"; });

TEST(Idx, MissingFileIsNamed) {
  expect_invalid([] { read_idx("/nonexistent/train-images-idx3-ubyte"); },
                 {"/nonexistent/train-images-idx3-ubyte", "does not exist"});
  expect_invalid([] { load_mnist_family("/nonexistent", "fashion-mnist"); },
                 {"/nonexistent/train-images-idx3-ubyte", "data.path"});
}

TEST(Idx, CorruptGzipStreamIsAnError) {
  TempDir d;
  write_bytes(d.file("x.gz"), idx_bytes({64, 4, 4}, ramp(1024)), true);
  std::string bytes = limbo::testing::slurp(d.file("x.gz"));
  bytes.resize(bytes.size() / 2);  // cut the compressed stream
  write_bytes(d.file("x.gz"), bytes, false);
  expect_invalid([&] { read_idx(d.file("x.gz")); }, {d.file("x.gz")});
}

TEST(Cifar10, ReadsRecordsAndRejectsCorruptFiles) {
  TempDir d;
  std::string rec;
  for (int i = 0; i < 3; ++i) {
    rec.push_back(static_cast<char>(i * 3));
    auto px = ramp(3072, 200 + i);
    rec.append(px.begin(), px.end());
  }
  write_bytes(d.file("a.bin"), rec, false);
  Dataset ds = read_cifar10_files({d.file("a.bin"), d.file("a.bin")}, "c");
  EXPECT_EQ(ds.size(), 6);
  EXPECT_EQ(ds.shape.channels, 3);
  EXPECT_EQ(ds.labels[4], 3);
  EXPECT_EQ(ds.image(5)[3071], 3071 % 202);

  write_bytes(d.file("t.bin"), rec.substr(0, rec.size() - 5), false);
  expect_invalid([&] { read_cifar10_files({d.file("t.bin")}, "c"); }, {d.file("t.bin"), "truncated"});
  std::string bad = rec;
  bad[3073] = 12;
  write_bytes(d.file("l.bin"), bad, false);
  expect_invalid([&] { read_cifar10_files({d.file("l.bin")}, "c"); },
                 {d.file("l.bin"), "label 12", "record 1"});
  expect_invalid([&] { load_cifar10(d.path()); }, {"data_batch_1.bin", "does not exist"});
}

TEST(Synthetic, DeterministicAndLabelled) {
  SyntheticOptions o;
  o.train_size = 100;
  o.test_size = 10;
  auto a = make_synthetic(o), b = make_synthetic(o);
  EXPECT_EQ(a.train.images, b.train.images);
  EXPECT_EQ(a.train.labels, b.train.labels);
  EXPECT_EQ(a.train.size(), 100);
  o.seed = 2;
  EXPECT_NE(make_synthetic(o).train.images, a.train.images);
  for (auto l : a.train.labels) EXPECT_LT(l, 10);
}

TEST(Registry, UnknownDatasetIsRejected) {
  DataSource s;
  s.dataset = "imagenet";
  expect_invalid([&] { load_dataset(s); }, {"imagenet", "fashion-mnist"});
}

TEST(FashionMnist, RealFilesLoadWhenInstalled) {
  if (!file_exists("/usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz"))
    GTEST_SKIP() << "dataset-fashion-mnist is not installed";
  DataSource s;
  auto splits = load_dataset(s);
  EXPECT_EQ(splits.train.size(), 60000);
  EXPECT_EQ(splits.test.size(), 10000);
  EXPECT_EQ(splits.train.shape.height, 28);
  auto norm = compute_normalization(splits.train);
  EXPECT_NEAR(norm.mean[0], 0.2860, 1e-3);  // the well-known statistics
  EXPECT_NEAR(norm.std[0], 0.3530, 1e-3);
}

}  // namespace
