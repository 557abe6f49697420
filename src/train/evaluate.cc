#include "train/evaluate.h"

#include <numeric>

#include "data/loader.h"

namespace limbo::train {

EvalResult evaluate(models::Net& model, const data::Dataset& split,
                    const data::Normalization& norm, int64_t chunk) {
  bool was_training = model.is_training();
  model.eval();
  torch::NoGradGuard no_grad;
  EvalResult r;
  double loss_sum = 0;
  int64_t correct = 0;
  std::vector<int64_t> ids;
  for (int64_t start = 0; start < split.size(); start += chunk) {
    int64_t n = std::min(chunk, split.size() - start);
    ids.resize(n);
    std::iota(ids.begin(), ids.end(), start);
    auto b = data::make_batch(split, norm, ids);
    auto logits = model.forward(b.x);
    loss_sum += torch::nn::functional::cross_entropy(
                    logits, b.y, torch::nn::functional::CrossEntropyFuncOptions().reduction(torch::kSum))
                    .item<double>();
    correct += logits.argmax(1).eq(b.y).sum().item<int64_t>();
  }
  r.samples = split.size();
  if (r.samples > 0) {
    r.loss = loss_sum / r.samples;
    r.accuracy = static_cast<double>(correct) / r.samples;
  }
  model.train(was_training);
  return r;
}

}  // namespace limbo::train
