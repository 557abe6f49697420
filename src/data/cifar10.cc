#include "data/cifar10.h"

#include "common/error.h"
#include "common/files.h"

namespace limbo::data {
namespace {
constexpr int64_t kPixels = 3 * 32 * 32;
constexpr int64_t kRecord = 1 + kPixels;
}  // namespace

Dataset read_cifar10_files(const std::vector<std::string>& paths, const std::string& name) {
  Dataset d;
  d.name = name;
  d.shape = {3, 32, 32};
  d.num_classes = 10;
  for (const auto& path : paths) {
    if (!file_exists(path)) throw InvalidInput("CIFAR-10 file '" + path + "' does not exist");
    std::string bytes = read_file(path);
    if (bytes.empty() || bytes.size() % kRecord != 0)
      throw InvalidInput("CIFAR-10 file '" + path + "' is truncated or not CIFAR-10 binary: " +
                         std::to_string(bytes.size()) + " bytes is not a whole number of " +
                         std::to_string(kRecord) + "-byte records");
    int64_t n = static_cast<int64_t>(bytes.size()) / kRecord;
    size_t base = d.images.size();
    d.images.resize(base + n * kPixels);
    for (int64_t i = 0; i < n; ++i) {
      const auto* rec = reinterpret_cast<const uint8_t*>(bytes.data()) + i * kRecord;
      if (rec[0] >= 10)
        throw InvalidInput("CIFAR-10 file '" + path + "' has label " + std::to_string(rec[0]) +
                           " in record " + std::to_string(i) + "; expected 0..9");
      d.labels.push_back(rec[0]);
      std::copy(rec + 1, rec + kRecord, d.images.begin() + base + i * kPixels);
    }
  }
  return d;
}

DatasetSplits load_cifar10(const std::string& dir) {
  std::string root = dir;
  if (!file_exists(root + "/test_batch.bin") && file_exists(root + "/cifar-10-batches-bin"))
    root += "/cifar-10-batches-bin";
  std::vector<std::string> train;
  for (int i = 1; i <= 5; ++i) train.push_back(root + "/data_batch_" + std::to_string(i) + ".bin");
  DatasetSplits s;
  s.train = read_cifar10_files(train, "cifar10/train");
  s.test = read_cifar10_files({root + "/test_batch.bin"}, "cifar10/test");
  return s;
}

}  // namespace limbo::data
