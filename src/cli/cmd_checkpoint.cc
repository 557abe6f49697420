// `limbo eval` and `limbo export`: rebuild the model from the configuration
// stored in a checkpoint, load its weights, then evaluate or export them.
#include <cstdio>

#include "cli/commands.h"
#include "cli/schema.h"
#include "common/error.h"
#include "train/checkpoint.h"
#include "train/evaluate.h"
#include "train/safetensors.h"
#include "train/trainer.h"

namespace limbo::cli {
namespace {

std::unique_ptr<train::Trainer> load(const CheckpointArgs& a) {
  if (a.checkpoint.empty()) throw InvalidInput("--checkpoint PATH is required");
  Config cfg(train_schema());
  cfg.load_toml_string(train::read_checkpoint_config(a.checkpoint),
                       a.checkpoint + " (stored config)");
  for (const auto& o : a.overrides) cfg.apply_override(o);
  auto tc = trainer_config(cfg);
  tc.run_dir.clear();
  auto trainer = std::make_unique<train::Trainer>(tc);
  train::load_checkpoint(a.checkpoint, trainer->model(), &trainer->sgd());
  return trainer;
}

}  // namespace

int run_eval(const CheckpointArgs& a) {
  auto trainer = load(a);
  auto r = train::evaluate(trainer->model(), trainer->data().test, trainer->normalization());
  std::printf("{\"checkpoint\": \"%s\", \"test_samples\": %lld, \"test_loss\": %.6f, "
              "\"test_accuracy\": %.6f}\n",
              a.checkpoint.c_str(), static_cast<long long>(r.samples), r.loss, r.accuracy);
  return 0;
}

int run_export(const CheckpointArgs& a) {
  if (a.out.empty()) throw InvalidInput("--out FILE.safetensors is required");
  auto trainer = load(a);
  auto cfg_text = train::read_checkpoint_config(a.checkpoint);
  train::write_safetensors(a.out, train::state_dict(trainer->model()),
                           {{"format", "pt"}, {"producer", "limbo"}, {"limbo_config", cfg_text}});
  std::printf("wrote %s\n", a.out.c_str());
  return 0;
}

}  // namespace limbo::cli
