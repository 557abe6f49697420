// data.augment: parsing, draws that are a pure function of (seed, epoch,
// sample id), each operation against torchvision's bit for bit (through
// tests/python/check_augment.py), and the loader augmenting a sample alike
// whatever the world size or restart.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include <fstream>
#include <set>

#include "common/error.h"
#include "common/files.h"
#include "data/augment.h"
#include "data/loader.h"
#include "data/synthetic.h"
#include "test_util.h"

using namespace limbo;
using namespace limbo::data;
using json = nlohmann::json;

namespace {

TEST(Augment, ParsesItsListAndRefusesAnythingElse) {
  EXPECT_TRUE(Augmenter("", 1).empty());
  Augmenter a("random_crop:4, hflip", 1);
  ASSERT_EQ(a.ops().size(), 2u);
  EXPECT_EQ(a.ops()[0].kind, AugmentOp::Kind::RandomCrop);
  EXPECT_EQ(a.ops()[0].padding, 4);
  EXPECT_EQ(a.ops()[1].kind, AugmentOp::Kind::HFlip);
  EXPECT_EQ(a.describe(), "random_crop:4,hflip");
  for (const char* bad : {"random_crop", "random_crop:0", "random_crop:x", "random_crop:65", "vflip",
                          "hflip,,random_crop:2", "hflip,hflip", "random_crop:2,random_crop:3"}) {
    try {
      Augmenter x(bad, 1);
      ADD_FAILURE() << "accepted '" << bad << "'";
    } catch (const InvalidInput& e) {
      EXPECT_NE(std::string(e.what()).find("data.augment"), std::string::npos) << e.what();
    }
  }
  EXPECT_THROW(a.check_sample_shape({784}), InvalidInput);
  EXPECT_NO_THROW(a.check_sample_shape({3, 32, 32}));
}

TEST(Augment, DrawsArePureFunctionsOfSeedEpochAndSample) {
  Augmenter a("random_crop:4,hflip", 7), same("random_crop:4,hflip", 7), other("random_crop:4,hflip", 8);
  std::set<int64_t> tops, lefts;
  int flips = 0, moved_by_epoch = 0, moved_by_seed = 0;
  for (int64_t id = 0; id < 2000; ++id) {
    const auto d = a.draw(3, id), e = same.draw(3, id);
    EXPECT_EQ(d.top, e.top);
    EXPECT_EQ(d.left, e.left);
    EXPECT_EQ(d.flip, e.flip);
    tops.insert(d.top);
    lefts.insert(d.left);
    flips += d.flip;
    const auto next = a.draw(4, id), s = other.draw(3, id);
    moved_by_epoch += next.top != d.top || next.left != d.left || next.flip != d.flip;
    moved_by_seed += s.top != d.top || s.left != d.left || s.flip != d.flip;
  }
  EXPECT_EQ(tops, (std::set<int64_t>{0, 1, 2, 3, 4, 5, 6, 7, 8}));  // every offset of [0, 2P]
  EXPECT_EQ(lefts, tops);
  EXPECT_NEAR(flips / 2000.0, 0.5, 0.05);
  EXPECT_GT(moved_by_epoch, 1800);  // a new epoch, a new augmentation (same draw: 1 in 162)
  EXPECT_GT(moved_by_seed, 1800);
}

TEST(Augment, EachOperationMatchesTorchvisionBitForBit) {
  const std::string python = "/usr/bin/python3";
  if (!file_exists(python)) GTEST_SKIP() << "no /usr/bin/python3";
  limbo::testing::TempDir d;
  torch::manual_seed(5);
  const int64_t n = 24, C = 3, H = 8, W = 11;  // not square: rows and columns cannot be confused
  auto x = torch::rand({n, C, H, W});
  std::vector<int64_t> ids;
  for (int64_t i = 0; i < n; ++i) ids.push_back(1000 + 37 * i);
  for (const std::string spec : {"random_crop:3", "hflip", "random_crop:2,hflip", "hflip,random_crop:5"}) {
    SCOPED_TRACE(spec);
    Augmenter a(spec, 11);
    auto y = x.clone();
    a.apply(y, ids, 2, {});
    json c = {{"shape", {n, C, H, W}}, {"ops", json::array()}, {"draws", json::array()}};
    for (const auto& op : a.ops())
      c["ops"].push_back({op.kind == AugmentOp::Kind::HFlip ? "hflip" : "random_crop", op.padding});
    int flipped = 0, shifted = 0;
    for (int64_t id : ids) {
      auto dr = a.draw(2, id);
      c["draws"].push_back({{"top", dr.top}, {"left", dr.left}, {"flip", dr.flip}});
      flipped += dr.flip;
      shifted += dr.top != 3 || dr.left != 3;
    }
    EXPECT_GT(flipped + shifted, 0);
    const std::string dir = d.file(std::to_string(std::hash<std::string>()(spec)));
    make_dirs(dir);
    limbo::testing::write_bytes(dir + "/case.json", c.dump(), false);
    limbo::testing::write_bytes(dir + "/input.bin", std::string(reinterpret_cast<const char*>(x.data_ptr<float>()), x.numel() * 4), false);
    limbo::testing::write_bytes(dir + "/output.bin", std::string(reinterpret_cast<const char*>(y.data_ptr<float>()), y.numel() * 4), false);
    const std::string log = dir + "/check.log";
    pid_t pid = limbo::testing::spawn_process({python, std::string(LIMBO_SOURCE_DIR) + "/tests/python/check_augment.py", dir}, log);
    auto r = limbo::testing::wait_child(pid, log);
    if (r.exit_code == 77) GTEST_SKIP() << r.output;
    EXPECT_EQ(r.exit_code, 0) << r.output;
    EXPECT_NE(r.output.find("ok"), std::string::npos) << r.output;
  }
}

// A sample is augmented alike whichever member trains it and after a
// restart: the batches of two members (world 2) are the rows of one
// member's batch (world 1), bit for bit, and a restarted loader repeats them.
TEST(Augment, TheLoaderAugmentsASampleAlikeWhateverTheWorldOrARestart) {
  SyntheticOptions o;
  o.train_size = 96;
  auto ds = std::make_shared<Dataset>(make_synthetic(o).train);
  auto norm = compute_normalization(*ds);
  LoaderOptions lo;
  lo.batch_size = 8;
  lo.seed = 3;
  lo.augment = Augmenter("random_crop:4,hflip", 3);
  BatchLoader one(ds, norm, lo, Cursor{0, 0});
  lo.batch_size = 4;
  lo.world = 2;
  lo.rank = 0;
  BatchLoader r0(ds, norm, lo, Cursor{0, 0});
  lo.rank = 1;
  BatchLoader r1(ds, norm, lo, Cursor{0, 0});
  std::vector<torch::Tensor> seen;
  for (int i = 0; i < 18; ++i) {  // 12 batches per epoch: into the second epoch
    auto b = one.next(), b0 = r0.next(), b1 = r1.next();
    ASSERT_TRUE(torch::equal(b.x, torch::cat({b0.x, b1.x}))) << "batch " << i;
    // Augmented: not the plain batch.
    EXPECT_FALSE(torch::equal(b.x, make_batch(*ds, norm, b.plan.ids).x));
    seen.push_back(b.x);
  }
  one.restart(Cursor{1, 16}, 1, 0);  // the second epoch's third batch again
  EXPECT_TRUE(torch::equal(one.next().x, seen[14]));
}

}  // namespace
