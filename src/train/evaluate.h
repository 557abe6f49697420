// Evaluation on a held-out split: mean cross-entropy and top-1 accuracy.
// Runs the model in eval mode without autograd, in chunks of `chunk` samples,
// and restores the model's previous train/eval mode.
#pragma once

#include "data/dataset.h"
#include "models/net.h"

namespace limbo::train {

struct EvalResult {
  double loss = 0;
  double accuracy = 0;
  int64_t samples = 0;
};

EvalResult evaluate(models::Net& model, const data::Dataset& split,
                    const data::Normalization& norm, int64_t chunk = 1000);

}  // namespace limbo::train
