// Memory-mapped tensors from numpy `.npy` files and safetensors files.
//
// A MappedTensor is a read-only view of an array stored in a file: its dtype,
// its shape and a pointer into a private read-only memory mapping of the
// file, which it keeps alive. Nothing is copied, so arrays larger than RAM
// can be read row by row (the kernel pages them in and out).
//
// Readers validate the whole header before returning and throw InvalidInput
// naming the file (and tensor) and the problem: a missing file or tensor, an
// unsupported dtype, a truncated file, a corrupt header, data offsets outside
// the file, Fortran-order or object arrays, big-endian data.
#pragma once

#include <algorithm>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

namespace limbo::data {

enum class DType { U8, I8, U16, I16, I32, I64, F16, BF16, F32, F64 };
const char* dtype_name(DType t);
int64_t dtype_size(DType t);
bool is_integer(DType t);

// A read-only mapping of a whole file (RAII; moves only).
class MappedFile {
 public:
  explicit MappedFile(const std::string& path);  // throws InvalidInput
  ~MappedFile();
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;
  const uint8_t* data() const { return data_; }
  int64_t size() const { return size_; }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
  const uint8_t* data_ = nullptr;
  int64_t size_ = 0;
};

struct MappedTensor {
  std::string origin;  // "FILE" or "FILE:tensor", for messages
  DType dtype = DType::F32;
  std::vector<int64_t> shape;  // shape[0] = rows
  const uint8_t* data = nullptr;
  std::shared_ptr<const MappedFile> file;  // keeps the mapping alive

  // A sharded array (concat_rows): the rows of each shard follow the
  // previous shard's; empty for one file.
  struct Shard {
    int64_t first_row = 0;
    const uint8_t* data = nullptr;
    std::shared_ptr<const MappedFile> file;
    std::string origin;
  };
  std::vector<Shard> shards;

  int64_t rows() const { return shape.empty() ? 1 : shape[0]; }
  int64_t row_numel() const;  // elements per row (product of shape[1:])
  int64_t row_bytes() const { return row_numel() * dtype_size(dtype); }
  const uint8_t* row(int64_t i) const {
    if (shards.empty()) return data + i * row_bytes();
    const Shard& s = shard_of(i);
    return s.data + (i - s.first_row) * row_bytes();
  }
  // "'FILE': sample K" for row i (in a sharded array: its shard and its
  // index there), for messages.
  std::string sample_name(int64_t i) const;

 private:
  const Shard& shard_of(int64_t i) const;
};

// The shards of one array, in order, as one array of all their rows (no
// copy). Throws InvalidInput naming the shard whose dtype or row shape
// differs from the first's.
MappedTensor concat_rows(const std::vector<MappedTensor>& parts, const std::string& origin);

// One array written by numpy's np.save (format versions 1.0, 2.0, 3.0).
MappedTensor read_npy(const std::string& path);

// Every tensor of a safetensors file, by name.
std::map<std::string, MappedTensor> read_safetensors(const std::string& path);

// Converts `count` elements at `src` of type `t` to float.
void to_float(DType t, const uint8_t* src, int64_t count, float* dst);
// Converts `count` integer elements at `src` to int64 (t must be an integer type).
void to_int64(DType t, const uint8_t* src, int64_t count, int64_t* dst);

}  // namespace limbo::data
