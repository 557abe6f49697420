// `limbo eval`, `limbo export` and `limbo plot`. eval/export rebuild the model from the configuration
// stored in a checkpoint, load its weights, then evaluate or export them.
#include <unistd.h>

#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "common/files.h"

#include "cli/commands.h"
#include "train/schema.h"
#include "common/error.h"
#include "models/export.h"
#include "train/checkpoint.h"
#include "train/safetensors.h"
#include "train/trainer.h"

namespace limbo::cli {
namespace {

std::unique_ptr<train::Trainer> load(const CheckpointArgs& a) {
  if (a.checkpoint.empty()) throw InvalidInput("--checkpoint PATH is required");
  Config cfg(train::train_schema());
  cfg.load_toml_string(train::read_checkpoint_config(a.checkpoint),
                       a.checkpoint + " (stored config)");
  for (const auto& o : a.overrides) cfg.apply_override(o);
  auto tc = train::trainer_config(cfg);
  tc.run_dir.clear();
  auto trainer = std::make_unique<train::Trainer>(tc);
  train::load_checkpoint(a.checkpoint, trainer->model(), &trainer->optimizer());
  return trainer;
}

}  // namespace

int run_eval(const CheckpointArgs& a) {
  auto trainer = load(a);
  auto r = trainer->evaluate_test();
  nlohmann::json out = {{"checkpoint", a.checkpoint}, {"test_samples", r.samples}};
  out.update(train::eval_fields(r));
  std::printf("%s\n", out.dump().c_str());
  return 0;
}

int run_export(const CheckpointArgs& a) {
  if (a.out.empty()) throw InvalidInput("--out FILE is required");
  auto ends_with = [&](const char* ext) {
    const std::string e(ext);
    return a.out.size() >= e.size() && a.out.compare(a.out.size() - e.size(), e.size(), e) == 0;
  };
  std::string format = a.format;
  if (format == "auto") format = ends_with(".pt") || ends_with(".pth") ? "torchscript" : "safetensors";
  auto trainer = load(a);
  auto cfg_text = train::read_checkpoint_config(a.checkpoint);
  if (format == "safetensors") {
    train::write_safetensors(a.out, train::state_dict(trainer->model()),
                             {{"format", "pt"}, {"producer", "limbo"}, {"limbo_config", cfg_text}});
  } else if (format == "torchscript") {
    Config cfg(train::train_schema());
    cfg.load_toml_string(cfg_text, a.checkpoint + " (stored config)");
    for (const auto& o : a.overrides) cfg.apply_override(o);
    auto tc = train::trainer_config(cfg);
    const auto& norm = trainer->normalization();
    const bool user = tc.model.name == "torchscript";
    nlohmann::json info = {
        {"producer", "limbo"},
        {"model", tc.model.name},
        {"loss", train::loss_name(tc.loss)},
        {"input", user ? "as Limbo fed it in training: uint8 inputs scaled by 1/255, others as stored; "
                         "then (x - mean) / std per channel when normalization is set"
                       : "images in [0, 1] pixel units [B, C, H, W]; the module normalises them"},
        {"normalization", norm.mean.empty() ? nlohmann::json()
                                            : nlohmann::json{{"mean", norm.mean}, {"std", norm.std}}},
        {"config", cfg_text}};
    models::ExportOptions ex;
    ex.path = a.out;
    ex.input_mean = norm.mean;
    ex.input_std = norm.std;
    ex.extra_files["limbo.json"] = info.dump(2);
    models::export_torchscript(trainer->model(), tc.model, train::input_spec(trainer->data().train), ex);
  } else {
    throw InvalidInput("unknown --format '" + format + "'; allowed: torchscript, safetensors");
  }
  std::printf("wrote %s (%s)\n", a.out.c_str(), format.c_str());
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
