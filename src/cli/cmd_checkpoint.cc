// `limbo eval`, `limbo export` and `limbo plot`. eval/export rebuild the model from the configuration
// stored in a checkpoint, load its weights, then evaluate or export them.
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "common/files.h"

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

namespace limbo::cli {

int run_plot(const std::vector<std::string>& runs, const std::string& out) {
  const char* script = std::getenv("LIMBO_PLOT_SCRIPT");
  std::string path = script ? script : LIMBO_PLOT_SCRIPT;
  if (!file_exists(path))
    throw InvalidInput("plot script '" + path + "' not found (set LIMBO_PLOT_SCRIPT to scripts/limbo_plot.py)");
  const char* py = std::getenv("LIMBO_PYTHON");
  std::string python = py ? py : "/usr/bin/python3";
  std::vector<std::string> args = {python, path};
  args.insert(args.end(), runs.begin(), runs.end());
  if (!out.empty()) args.insert(args.end(), {"--out", out});
  std::vector<char*> argv;
  for (auto& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  std::fflush(stdout);
  ::execv(python.c_str(), argv.data());
  throw InvalidInput("cannot run " + python + " (python3-matplotlib is needed for plots): " + std::strerror(errno));
}

}  // namespace limbo::cli
