#include "data/registry.h"

#include "common/error.h"
#include "data/cifar10.h"
#include "data/idx.h"
#include "data/synthetic.h"
#include "data/tensor_dataset.h"
#include "data/token_dataset.h"

namespace limbo::data {

std::string default_path(const std::string& dataset) {
  if (dataset == "fashion-mnist") return "/usr/share/datasets/fashion-mnist";
  if (dataset == "mnist") return "/usr/share/datasets/mnist";
  if (dataset == "cifar10") return "data/cifar-10-batches-bin";
  return "";
}

DatasetSplits load_dataset(const DataSource& src) {
  std::string path = src.path.empty() ? default_path(src.dataset) : src.path;
  DatasetSplits s;
  if (src.dataset == "fashion-mnist" || src.dataset == "mnist") {
    s = load_mnist_family(path, src.dataset);
  } else if (src.dataset == "cifar10") {
    s = load_cifar10(path);
  } else if (src.dataset == "synthetic") {
    SyntheticOptions o;
    o.seed = src.seed;
    if (src.train_limit > 0) o.train_size = src.train_limit;
    if (src.test_limit > 0) o.test_size = src.test_limit;
    s = make_synthetic(o);
  } else if (src.dataset == "tensors") {
    s = load_tensor_dataset(path, src.classes, src.user_model);
    const DType xt = s.train.tensors->x.dtype;
    if (src.inputs != "auto" && src.inputs != "ids" && src.inputs != "float")
      throw InvalidInput("unknown data.inputs '" + src.inputs + "'; allowed: auto, float, ids");
    if (src.inputs == "ids" && !src.user_model)
      throw InvalidInput("data.inputs = \"ids\" gives int64 ids, which only a TorchScript module (an embedding) "
                         "takes; built-in models take float samples");
    const DType tt = s.test.tensors->x.dtype;
    if (is_integer(xt) != is_integer(tt) || ((xt == DType::U8) != (tt == DType::U8) && src.inputs == "auto"))
      throw InvalidInput("train and test samples differ in kind: '" + s.train.tensors->x.origin + "' is " +
                         dtype_name(xt) + ", '" + s.test.tensors->x.origin + "' is " + dtype_name(tt) +
                         " (both integer ids, both uint8 images, or both floats)");
    const bool ids = is_integer(xt) && (src.inputs == "ids" || (src.inputs == "auto" && src.user_model && xt != DType::U8));
    if (src.inputs == "ids" && !is_integer(xt))
      throw InvalidInput("data.inputs = \"ids\" needs integer samples, but '" + s.train.tensors->x.origin +
                         "' holds " + dtype_name(xt));
    s.train.x_ids = s.test.x_ids = ids;
  } else if (src.dataset == "tokens") {
    if (!src.user_model)
      throw InvalidInput("data.dataset = \"tokens\" feeds int64 token ids [B, data.context], which only a "
                         "TorchScript module (model.name = \"torchscript\", e.g. examples/gpt) takes");
    TokenOptions o;
    o.context = src.context;
    o.vocab = src.vocab > 0 ? src.vocab : src.classes;
    o.vocab_from = src.vocab > 0 ? "data.vocab" : "model.classes";
    o.seed = src.seed;
    s = load_token_dataset(path, o);
  } else {
    throw InvalidInput("unknown dataset '" + src.dataset +
                       "'; allowed: fashion-mnist, mnist, cifar10, synthetic, tensors, tokens");
  }
  if (src.dataset != "tokens" && (src.context > 0 || src.vocab > 0))
    throw InvalidInput(std::string(src.context > 0 ? "data.context" : "data.vocab") +
                       " is for token streams (data.dataset = \"tokens\"), not '" + src.dataset + "'");
  if (src.inputs == "ids" && src.dataset != "tensors" && src.dataset != "tokens")
    throw InvalidInput("data.inputs = \"ids\" is for tensor datasets (data.dataset = \"tensors\"); '" +
                       src.dataset + "' holds images");
  if (src.classes > 0 && has_labels(s.train) && src.dataset != "tokens") {
    for (Dataset* d : {&s.train, &s.test}) {
      auto bad = find_bad_label(*d, src.classes);
      if (bad.index >= 0)
        throw InvalidInput(label_site(*d, bad.index) + " has the label " + std::to_string(bad.label) +
                           ", outside [0, " + std::to_string(src.classes) + ") of model.classes = " +
                           std::to_string(src.classes));
      d->num_classes = src.classes;
    }
  }
  if (src.train_limit > 0) s.train.truncate(src.train_limit);
  if (src.test_limit > 0) s.test.truncate(src.test_limit);
  return s;
}

}  // namespace limbo::data
