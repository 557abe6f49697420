// Config validation: unknown keys, ranges, types, TOML files, --set, and the
// cross-key checks of the trainer options.
#include <gtest/gtest.h>

#include "train/schema.h"
#include "common/config.h"
#include "common/error.h"
#include "test_util.h"

using namespace limbo;

namespace {

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const InvalidInput& e) {
    return e.what();
  }
  return "(no error)";
}

void expect_has(const std::string& msg, const std::vector<std::string>& needles) {
  for (const auto& n : needles) EXPECT_NE(msg.find(n), std::string::npos) << msg;
}

TEST(Config, DefaultsAreTheDefaultJob) {
  Config c(train::train_schema());
  EXPECT_EQ(c.get_string("model.name"), "lenet");
  EXPECT_EQ(c.get_string("data.dataset"), "fashion-mnist");
  EXPECT_EQ(c.get_int("data.batch_size"), 64);
  EXPECT_EQ(c.get_int("train.epochs"), 2);
  EXPECT_FALSE(c.is_set("optim.lr"));
}

TEST(Config, UnknownKeyNamesItAndSuggests) {
  Config c(train::train_schema());
  auto msg = error_of([&] { c.apply_override("optim.lrr=0.1"); });
  expect_has(msg, {"optim.lrr", "did you mean 'optim.lr'", "optim.momentum"});
  msg = error_of([&] { c.load_toml_string("[trian]\nepochs = 3\n", "job.toml"); });
  expect_has(msg, {"trian.epochs", "job.toml", "did you mean 'train.epochs'"});
}

TEST(Config, OutOfRangeAndWrongTypesNameKeyValueAndAllowed) {
  Config c(train::train_schema());
  expect_has(error_of([&] { c.apply_override("optim.momentum=1.5"); }),
             {"optim.momentum", "1.5", "out of range", "[0, 1)"});
  expect_has(error_of([&] { c.apply_override("data.batch_size=0"); }),
             {"data.batch_size", "out of range", "[1, 65536]"});
  expect_has(error_of([&] { c.apply_override("model.name=vgg"); }),
             {"model.name", "vgg", "lenet", "resnet20"});
  expect_has(error_of([&] { c.apply_override("train.epochs=two"); }),
             {"train.epochs", "two", "integer"});
  expect_has(error_of([&] { c.load_toml_string("[optim]\nlr = \"fast\"\n", "f.toml"); }),
             {"optim.lr", "f.toml", "number"});
  expect_has(error_of([&] { c.apply_override("optim.lr"); }), {"section.key=value"});
  expect_has(error_of([&] { c.load_toml_string("[optim\nlr=1", "bad.toml"); }),
             {"bad.toml", "syntax"});
  expect_has(error_of([&] { c.load_toml_string("lr = 0.1\n", "top.toml"); }),
             {"top.toml", "lr", "[section]"});
  // A rejected value leaves the previous one in place.
  EXPECT_EQ(c.get_float("optim.momentum"), 0.9);
}

TEST(Config, TomlFileOverridesAndRoundTrip) {
  limbo::testing::TempDir d;
  std::string path = d.file("job.toml");
  limbo::testing::write_bytes(path,
                              "[model]\nname = \"mlp\"\n[optim]\nlr = 1\nmilestones = [3, 6]\n"
                              "[train]\nepochs = 5\n",
                              false);
  Config c(train::train_schema());
  c.load_toml_file(path);
  c.apply_override("train.epochs=7");
  c.apply_override("optim.nesterov=true");
  EXPECT_EQ(c.get_string("model.name"), "mlp");
  EXPECT_DOUBLE_EQ(c.get_float("optim.lr"), 1.0);  // integer accepted for a float key
  EXPECT_EQ(c.get_string("optim.milestones"), "3,6");
  EXPECT_EQ(c.get_int("train.epochs"), 7);
  EXPECT_TRUE(c.get_bool("optim.nesterov"));
  Config again(train::train_schema());
  again.load_toml_string(c.to_toml(), "resolved");
  EXPECT_EQ(again.to_toml(), c.to_toml());
  EXPECT_THROW(c.load_toml_file(d.file("missing.toml")), InvalidInput);
}

// Found: `--set data.augment=["random_crop:2", "hflip"]` (a TOML array on the
// command line) was refused, though the docs say lists may be written as
// TOML arrays; only files took them.
TEST(Config, SetTakesTomlArraysAndQuotedStringsAsAFileDoes) {
  Config c(train::train_schema());
  c.apply_override("data.augment=[\"random_crop:2\", \"hflip\"]");
  EXPECT_EQ(c.get_string("data.augment"), "random_crop:2,hflip");
  c.apply_override("optim.milestones=[3, 6]");
  EXPECT_EQ(c.get_string("optim.milestones"), "3,6");
  c.apply_override("optim.milestones = [ 4 ]");
  EXPECT_EQ(c.get_string("optim.milestones"), "4");
  c.apply_override("data.augment=[]");
  EXPECT_EQ(c.get_string("data.augment"), "");
  c.apply_override("data.augment=\"hflip\"");
  EXPECT_EQ(c.get_string("data.augment"), "hflip");
  c.apply_override("data.augment='hflip,random_crop:1'");
  EXPECT_EQ(c.get_string("data.augment"), "hflip,random_crop:1");
  // The plain comma-separated form still works.
  c.apply_override("optim.milestones=2,5");
  EXPECT_EQ(c.get_string("optim.milestones"), "2,5");
  // A malformed array names the key and what was given, and changes nothing.
  expect_has(error_of([&] { c.apply_override("optim.milestones=[3, 6"); }),
             {"optim.milestones", "[3, 6", "TOML"});
  expect_has(error_of([&] { c.apply_override("optim.milestones=[[1], 2]"); }), {"optim.milestones"});
  EXPECT_EQ(c.get_string("optim.milestones"), "2,5");
  // An array for a key that is no list is refused as the file form is.
  expect_has(error_of([&] { c.apply_override("train.epochs=[1, 2]"); }), {"train.epochs"});
}

// Found: a key of a new section declared between two keys of another
// section wrote that table twice, and every checkpoint's stored config
// failed to parse. Tables are grouped whatever the declaration order.
TEST(Config, InterleavedSectionsStillWriteOneTableEach) {
  auto schema = std::make_shared<Schema>();
  auto key = [](const char* name, ValueType type, ConfigValue def) {
    KeySpec k;
    k.key = name;
    k.type = type;
    k.def = std::move(def);
    return k;
  };
  schema->add(key("a.x", ValueType::Int, int64_t{1}));
  schema->add(key("b.y", ValueType::String, std::string("s")));
  schema->add(key("a.z", ValueType::Bool, true));
  Config c(schema);
  const std::string toml = c.to_toml();
  EXPECT_EQ(toml, "[a]\nx = 1\nz = true\n\n[b]\ny = \"s\"\n");
  Config again(schema);
  EXPECT_NO_THROW(again.load_toml_string(toml, "written"));
  EXPECT_EQ(again.to_toml(), toml);
}

TEST(Config, CrossKeyChecks) {
  Config c(train::train_schema());
  c.apply_override("optim.momentum=0");
  c.apply_override("optim.nesterov=true");
  expect_has(error_of([&] { train::trainer_config(c); }), {"optim.nesterov", "optim.momentum"});
  Config m(train::train_schema());
  m.apply_override("optim.schedule=multistep");
  expect_has(error_of([&] { train::trainer_config(m); }), {"optim.milestones"});
  m.apply_override("optim.milestones=5,2");
  expect_has(error_of([&] { train::trainer_config(m); }), {"ascending"});
}

TEST(Config, OptimizerClippingAndAccumulationReachTheTrainer) {
  Config c(train::train_schema());
  for (const char* o : {"optim.algorithm=adamw", "optim.beta1=0.8", "optim.beta2=0.95", "optim.eps=1e-6",
                        "optim.weight_decay=0.1", "optim.clip_grad_norm=1.5", "train.accumulate=4",
                        "data.batch_size=16"})
    c.apply_override(o);
  auto t = train::trainer_config(c);
  EXPECT_EQ(t.optimizer.algorithm, "adamw");
  EXPECT_DOUBLE_EQ(t.optimizer.beta1, 0.8);
  EXPECT_DOUBLE_EQ(t.optimizer.beta2, 0.95);
  EXPECT_DOUBLE_EQ(t.optimizer.eps, 1e-6);
  EXPECT_DOUBLE_EQ(t.optimizer.weight_decay, 0.1);
  EXPECT_DOUBLE_EQ(t.clip_grad_norm, 1.5);
  EXPECT_EQ(t.train.accumulate, 4);
  EXPECT_EQ(t.loader.batch_size, 64) << "the loader hands out a step's batch: accumulate x data.batch_size";
  // ISGD's extra updates are SGD steps: it runs on SGD.
  Config i(train::train_schema());
  i.apply_override("optim.algorithm=isgd");
  EXPECT_EQ(train::trainer_config(i).optimizer.algorithm, "sgd");
  // Nesterov is an SGD setting; Adam has none. Betas outside [0, 1) are refused.
  Config n(train::train_schema());
  n.apply_override("optim.algorithm=adam");
  n.apply_override("optim.nesterov=true");
  expect_has(error_of([&] { train::trainer_config(n); }), {"optim.nesterov", "adam"});
  Config b(train::train_schema());
  EXPECT_THROW(b.apply_override("optim.beta2=1.0"), InvalidInput);
  EXPECT_THROW(b.apply_override("train.accumulate=0"), InvalidInput);
}

TEST(Config, SchemaMarkdownListsEveryKey) {
  auto md = train::train_schema()->to_markdown();
  for (const auto& k : train::train_schema()->keys())
    EXPECT_NE(md.find("`" + k.key + "`"), std::string::npos) << k.key;
}

}  // namespace

namespace {

TEST(Config, DocsMatchTheSchema) {
  std::string doc = limbo::testing::slurp(std::string(LIMBO_SOURCE_DIR) + "/docs/config.md");
  EXPECT_NE(doc.find(train::train_schema()->to_markdown()), std::string::npos)
      << "docs/config.md is stale: regenerate the table with `limbo config --schema`";
}

}  // namespace
