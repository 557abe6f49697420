#include <cstdio>
#include <ctime>

#include "cli/commands.h"
#include "cli/schema.h"
#include "common/log.h"
#include "train/trainer.h"

namespace limbo::cli {
namespace {

Config resolve(const TrainArgs& a) {
  Config cfg(train_schema());
  if (!a.config_file.empty()) cfg.load_toml_file(a.config_file);
  for (const auto& o : a.overrides) cfg.apply_override(o);
  return cfg;
}

std::string default_run_dir(const Config& cfg) {
  std::time_t t = std::time(nullptr);
  std::tm tm{};
  ::localtime_r(&t, &tm);
  char stamp[32];
  std::strftime(stamp, sizeof stamp, "%Y%m%d-%H%M%S", &tm);
  return "runs/" + cfg.get_string("model.name") + "-" + cfg.get_string("data.dataset") + "-" + stamp;
}

}  // namespace

int run_train(const TrainArgs& a) {
  Config cfg = resolve(a);
  auto tc = trainer_config(cfg);
  tc.run_dir = a.run_dir.empty() ? default_run_dir(cfg) : a.run_dir;
  tc.train.resume = a.resume;
  train::Trainer trainer(tc);
  auto summary = trainer.run();
  std::printf("run directory: %s\n", tc.run_dir.c_str());
  std::printf("steps %lld, epochs %.2f, %.0f samples/s\n",
              static_cast<long long>(summary["steps"].get<int64_t>()),
              summary["epochs"].get<double>(), summary["samples_per_second"].get<double>());
  std::printf("test accuracy: %.2f%% (test loss %.4f)\n",
              100.0 * summary["test_accuracy"].get<double>(), summary["test_loss"].get<double>());
  return 0;
}

int run_config(const TrainArgs& a, bool schema_markdown) {
  if (schema_markdown) {
    std::fputs(train_schema()->to_markdown().c_str(), stdout);
    return 0;
  }
  Config cfg = resolve(a);
  trainer_config(cfg);  // cross-key validation
  std::fputs(cfg.to_toml().c_str(), stdout);
  return 0;
}

}  // namespace limbo::cli
