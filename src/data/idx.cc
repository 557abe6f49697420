#include "data/idx.h"

#include <zlib.h>

#include <cerrno>
#include <cstring>
#include <memory>

#include "common/error.h"
#include "common/files.h"

namespace limbo::data {
namespace {

struct GzCloser {
  void operator()(gzFile f) const { if (f) gzclose(f); }
};
using GzPtr = std::unique_ptr<std::remove_pointer_t<gzFile>, GzCloser>;

// Reads up to n bytes; returns how many were read. gzread passes plain
// (uncompressed) files through unchanged, so one path serves both.
size_t read_some(gzFile f, void* buf, size_t n, const std::string& path) {
  size_t done = 0;
  auto* out = static_cast<unsigned char*>(buf);
  while (done < n) {
    unsigned chunk = static_cast<unsigned>(std::min<size_t>(n - done, 1u << 30));
    int got = gzread(f, out + done, chunk);
    if (got < 0) {
      int err = 0;
      const char* msg = gzerror(f, &err);
      throw InvalidInput("'" + path + "': corrupt or truncated gzip stream (" +
                         std::string(msg ? msg : "?") + ")");
    }
    if (got == 0) break;
    done += static_cast<size_t>(got);
  }
  return done;
}

}  // namespace

IdxArray read_idx(const std::string& path) {
  if (!file_exists(path)) throw InvalidInput("IDX file '" + path + "' does not exist");
  GzPtr f(gzopen(path.c_str(), "rb"));
  if (!f) throw InvalidInput("cannot open IDX file '" + path + "': " + std::strerror(errno));
  unsigned char magic[4];
  if (read_some(f.get(), magic, 4, path) != 4)
    throw InvalidInput("IDX file '" + path + "' is truncated: shorter than its 4-byte magic");
  if (magic[0] != 0 || magic[1] != 0) {
    char buf[64];
    std::snprintf(buf, sizeof buf, "0x%02x%02x%02x%02x", magic[0], magic[1], magic[2], magic[3]);
    throw InvalidInput("IDX file '" + path + "' has bad magic " + buf +
                       " (expected 0x000008NN: two zero bytes, type, dimension count)");
  }
  if (magic[2] != 0x08)
    throw InvalidInput("IDX file '" + path + "' has element type 0x" +
                       std::to_string(magic[2]) + "; only unsigned bytes (0x08) are supported");
  int ndims = magic[3];
  if (ndims < 1 || ndims > 4)
    throw InvalidInput("IDX file '" + path + "' declares " + std::to_string(ndims) +
                       " dimensions; expected 1 to 4");
  IdxArray arr;
  size_t total = 1;
  for (int i = 0; i < ndims; ++i) {
    unsigned char b[4];
    if (read_some(f.get(), b, 4, path) != 4)
      throw InvalidInput("IDX file '" + path + "' is truncated inside its header");
    int64_t d = (int64_t(b[0]) << 24) | (int64_t(b[1]) << 16) | (int64_t(b[2]) << 8) | b[3];
    if (d <= 0 || d > (1 << 28))
      throw InvalidInput("IDX file '" + path + "' has implausible size " +
                         std::to_string(d) + " for dimension " + std::to_string(i));
    arr.dims.push_back(d);
    total *= static_cast<size_t>(d);
    if (total > (size_t(1) << 34))
      throw InvalidInput("IDX file '" + path + "' declares more than 16 GiB of data");
  }
  arr.data.resize(total);
  size_t got = read_some(f.get(), arr.data.data(), total, path);
  if (got != total)
    throw InvalidInput("IDX file '" + path + "' is truncated: header declares " +
                       std::to_string(total) + " data bytes, file holds " +
                       std::to_string(got));
  unsigned char extra;
  if (read_some(f.get(), &extra, 1, path) != 0)
    throw InvalidInput("IDX file '" + path + "' has trailing bytes after the " +
                       std::to_string(total) + " data bytes its header declares");
  return arr;
}

Dataset read_idx_dataset(const std::string& images_path, const std::string& labels_path,
                         const std::string& name, int64_t num_classes) {
  IdxArray im = read_idx(images_path);
  if (im.dims.size() != 3)
    throw InvalidInput("IDX images file '" + images_path + "' has " +
                       std::to_string(im.dims.size()) +
                       " dimensions; expected 3 (count x rows x columns)");
  IdxArray lb = read_idx(labels_path);
  if (lb.dims.size() != 1)
    throw InvalidInput("IDX labels file '" + labels_path + "' has " +
                       std::to_string(lb.dims.size()) + " dimensions; expected 1 (count)");
  if (im.dims[0] != lb.dims[0])
    throw InvalidInput("image and label counts disagree: '" + images_path + "' holds " +
                       std::to_string(im.dims[0]) + " images, '" + labels_path +
                       "' holds " + std::to_string(lb.dims[0]) + " labels");
  for (size_t i = 0; i < lb.data.size(); ++i)
    if (lb.data[i] >= num_classes)
      throw InvalidInput("IDX labels file '" + labels_path + "' has label " +
                         std::to_string(lb.data[i]) + " at index " + std::to_string(i) +
                         "; expected 0.." + std::to_string(num_classes - 1));
  Dataset d;
  d.name = name;
  d.shape = {1, im.dims[1], im.dims[2]};
  d.num_classes = num_classes;
  d.images = std::move(im.data);
  d.labels = std::move(lb.data);
  return d;
}

DatasetSplits load_mnist_family(const std::string& dir, const std::string& name) {
  auto pick = [&](const std::string& base) {
    std::string gz = dir + "/" + base + ".gz";
    if (file_exists(gz)) return gz;
    std::string raw = dir + "/" + base;
    if (file_exists(raw)) return raw;
    throw InvalidInput("dataset '" + name + "': neither '" + gz + "' nor '" + raw +
                       "' exists (set data.path to the folder holding the IDX files)");
  };
  // Resolved one by one, so errors name the first missing file.
  const std::string train_images = pick("train-images-idx3-ubyte");
  const std::string train_labels = pick("train-labels-idx1-ubyte");
  const std::string test_images = pick("t10k-images-idx3-ubyte");
  const std::string test_labels = pick("t10k-labels-idx1-ubyte");
  DatasetSplits s;
  s.train = read_idx_dataset(train_images, train_labels, name + "/train");
  s.test = read_idx_dataset(test_images, test_labels, name + "/test");
  return s;
}

}  // namespace limbo::data
