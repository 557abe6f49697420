// The configuration schema of `limbo train` and the translation of a
// validated Config into the typed options of each layer.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "common/config.h"
#include "train/trainer.h"

namespace limbo::train {

std::shared_ptr<const Schema> train_schema();

// "runs/<name>-<YYYYmmdd-HHMMSS>" (local time): the default run directory.
std::string timestamped_run_dir(const std::string& name);

// The schema's defaults, then the TOML file (if any), then --set overrides.
Config resolve_config(const std::string& config_file, const std::vector<std::string>& overrides);

// Builds the trainer's options; throws InvalidInput for cross-key problems
// (e.g. Nesterov without momentum, multistep without milestones).
train::TrainerConfig trainer_config(const Config& cfg);

}  // namespace limbo::train
