#include "data/tensor_file.h"

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <fcntl.h>
#include <nlohmann/json.hpp>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cctype>
#include <cerrno>
#include <cstring>
#include <limits>

#include "common/error.h"

namespace limbo::data {

const char* dtype_name(DType t) {
  switch (t) {
    case DType::U8: return "uint8";
    case DType::I8: return "int8";
    case DType::U16: return "uint16";
    case DType::I16: return "int16";
    case DType::I32: return "int32";
    case DType::I64: return "int64";
    case DType::F16: return "float16";
    case DType::BF16: return "bfloat16";
    case DType::F32: return "float32";
    case DType::F64: return "float64";
  }
  return "?";
}

int64_t dtype_size(DType t) {
  switch (t) {
    case DType::U8:
    case DType::I8: return 1;
    case DType::U16:
    case DType::I16:
    case DType::F16:
    case DType::BF16: return 2;
    case DType::I32:
    case DType::F32: return 4;
    case DType::I64:
    case DType::F64: return 8;
  }
  return 1;
}

bool is_integer(DType t) {
  return t == DType::U8 || t == DType::I8 || t == DType::U16 || t == DType::I16 || t == DType::I32 ||
         t == DType::I64;
}

int64_t MappedTensor::row_numel() const {
  int64_t n = 1;
  for (size_t i = 1; i < shape.size(); ++i) n *= shape[i];
  return n;
}

MappedFile::MappedFile(const std::string& path) : path_(path) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) throw InvalidInput("cannot open '" + path + "': " + std::strerror(errno));
  struct stat st {};
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    ::close(fd);
    throw InvalidInput("'" + path + "' is not a regular file");
  }
  size_ = st.st_size;
  if (size_ > 0) {
    void* p = ::mmap(nullptr, static_cast<size_t>(size_), PROT_READ, MAP_PRIVATE, fd, 0);
    if (p == MAP_FAILED) {
      int e = errno;
      ::close(fd);
      throw InvalidInput("cannot memory-map '" + path + "': " + std::strerror(e));
    }
    data_ = static_cast<const uint8_t*>(p);
  }
  ::close(fd);  // the mapping stays valid
}

MappedFile::~MappedFile() {
  if (data_) ::munmap(const_cast<uint8_t*>(data_), static_cast<size_t>(size_));
}

namespace {

// Multiplies sizes, refusing negative dimensions and overflow.
int64_t checked_numel(const std::vector<int64_t>& shape, const std::string& origin) {
  int64_t n = 1;
  for (int64_t d : shape) {
    if (d < 0) throw InvalidInput("'" + origin + "': negative dimension in its shape");
    if (d != 0 && n > std::numeric_limits<int64_t>::max() / 16 / d)
      throw InvalidInput("'" + origin + "': shape too large");
    n *= d;
  }
  return n;
}

std::string shape_str(const std::vector<int64_t>& s) {
  std::string out = "[";
  for (size_t i = 0; i < s.size(); ++i) out += (i ? ", " : "") + std::to_string(s[i]);
  return out + "]";
}

// --- npy --------------------------------------------------------------------

// The value after `'key':` in numpy's header dict literal, up to the next
// top-level comma (parentheses balanced).
std::string dict_value(const std::string& h, const std::string& key, const std::string& path) {
  auto k = h.find("'" + key + "'");
  if (k == std::string::npos)
    throw InvalidInput("'" + path + "' is not a valid .npy file: its header lacks '" + key + "'");
  auto colon = h.find(':', k);
  if (colon == std::string::npos)
    throw InvalidInput("'" + path + "' is not a valid .npy file: malformed header");
  size_t i = colon + 1, depth = 0;
  std::string v;
  for (; i < h.size(); ++i) {
    char c = h[i];
    if (c == '(') ++depth;
    if (c == ')') --depth;
    if ((c == ',' || c == '}') && depth == 0) break;
    v += c;
  }
  auto b = v.find_first_not_of(" \t"), e = v.find_last_not_of(" \t");
  return b == std::string::npos ? "" : v.substr(b, e - b + 1);
}

DType npy_dtype(std::string d, const std::string& path) {
  if (d.size() >= 2 && (d.front() == '\'' || d.front() == '"')) d = d.substr(1, d.size() - 2);
  if (d.empty()) throw InvalidInput("'" + path + "': empty dtype in the .npy header");
  const char order = d[0];
  std::string code = (order == '<' || order == '>' || order == '|' || order == '=') ? d.substr(1) : d;
  if (code.rfind('O', 0) == 0)
    throw InvalidInput("'" + path + "' holds an object array (dtype=object), which cannot be "
                       "memory-mapped; save a numeric array (np.asarray(a, dtype=np.float32))");
  static const std::map<std::string, DType> codes = {
      {"u1", DType::U8},  {"i1", DType::I8},  {"u2", DType::U16}, {"i2", DType::I16}, {"i4", DType::I32}, {"i8", DType::I64},
      {"f2", DType::F16}, {"f4", DType::F32}, {"f8", DType::F64}};
  auto it = codes.find(code);
  if (it == codes.end())
    throw InvalidInput("'" + path + "' has dtype '" + d +
                       "', which Limbo does not read; use uint8, int8, uint16, int16, int32, int64, float16, "
                       "float32 or float64 (bfloat16 through safetensors)");
  if (order == '>' && dtype_size(it->second) > 1)
    throw InvalidInput("'" + path + "' is big-endian ('" + d +
                       "'); save it little-endian (a.astype(a.dtype.newbyteorder('<')))");
  return it->second;
}

// --- safetensors -------------------------------------------------------------

DType st_dtype(const std::string& d, const std::string& origin) {
  static const std::map<std::string, DType> codes = {
      {"U8", DType::U8},   {"I8", DType::I8},     {"U16", DType::U16}, {"I16", DType::I16}, {"I32", DType::I32}, {"I64", DType::I64},
      {"F16", DType::F16}, {"BF16", DType::BF16}, {"F32", DType::F32}, {"F64", DType::F64}};
  auto it = codes.find(d);
  if (it == codes.end())
    throw InvalidInput("'" + origin + "' has dtype '" + d +
                       "', which Limbo does not read; use U8, I8, U16, I16, I32, I64, F16, BF16, F32 or F64");
  return it->second;
}

}  // namespace

MappedTensor read_npy(const std::string& path) {
  auto file = std::make_shared<const MappedFile>(path);
  const uint8_t* p = file->data();
  const int64_t size = file->size();
  static const char kMagic[] = "\x93NUMPY";
  if (size < 10 || std::memcmp(p, kMagic, 6) != 0)
    throw InvalidInput("'" + path + "' is not a .npy file (no \\x93NUMPY magic; write it with np.save)");
  const int major = p[6];
  int64_t header_len, start;
  if (major == 1) {
    header_len = p[8] | (p[9] << 8);
    start = 10;
  } else if (major == 2 || major == 3) {
    if (size < 12) throw InvalidInput("'" + path + "' is truncated inside its .npy header");
    header_len = static_cast<int64_t>(p[8]) | (static_cast<int64_t>(p[9]) << 8) |
                 (static_cast<int64_t>(p[10]) << 16) | (static_cast<int64_t>(p[11]) << 24);
    start = 12;
  } else {
    throw InvalidInput("'" + path + "' has .npy format version " + std::to_string(major) +
                       ", which Limbo does not read (versions 1-3)");
  }
  if (start + header_len > size)
    throw InvalidInput("'" + path + "' is truncated inside its .npy header");
  const std::string h(reinterpret_cast<const char*>(p + start), header_len);
  MappedTensor t;
  t.origin = path;
  t.dtype = npy_dtype(dict_value(h, "descr", path), path);
  std::string fortran = dict_value(h, "fortran_order", path);
  if (fortran == "True")
    throw InvalidInput("'" + path + "' is stored in Fortran order; save a C-ordered array "
                       "(np.save(f, np.ascontiguousarray(a)))");
  if (fortran != "False")
    throw InvalidInput("'" + path + "': malformed fortran_order '" + fortran + "' in the header");
  std::string sh = dict_value(h, "shape", path);
  if (sh.size() < 2 || sh.front() != '(' || sh.back() != ')')
    throw InvalidInput("'" + path + "': malformed shape '" + sh + "' in the header");
  std::string inner = sh.substr(1, sh.size() - 2);
  size_t i = 0;
  while (i < inner.size()) {
    while (i < inner.size() && (inner[i] == ' ' || inner[i] == ',')) ++i;
    if (i >= inner.size()) break;
    size_t j = i;
    while (j < inner.size() && std::isdigit(static_cast<unsigned char>(inner[j]))) ++j;
    if (j == i || j - i > 18)
      throw InvalidInput("'" + path + "': malformed shape '" + sh + "' in the header");
    t.shape.push_back(std::stoll(inner.substr(i, j - i)));
    i = j;
  }
  const int64_t bytes = checked_numel(t.shape, path) * dtype_size(t.dtype);
  const int64_t offset = start + header_len;
  if (offset + bytes > size)
    throw InvalidInput("'" + path + "' is truncated: shape " + shape_str(t.shape) + " of " +
                       dtype_name(t.dtype) + " needs " + std::to_string(bytes) +
                       " bytes of data, the file holds " + std::to_string(size - offset));
  t.data = p + offset;
  t.file = std::move(file);
  return t;
}

std::map<std::string, MappedTensor> read_safetensors(const std::string& path) {
  auto file = std::make_shared<const MappedFile>(path);
  const uint8_t* p = file->data();
  const int64_t size = file->size();
  if (size < 8) throw InvalidInput("'" + path + "' is truncated: no safetensors header");
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | p[i];
  if (n > static_cast<uint64_t>(size - 8) || n > (100u << 20))
    throw InvalidInput("'" + path + "' is not a valid safetensors file: header length " +
                       std::to_string(n) + " exceeds the file (" + std::to_string(size) +
                       " bytes)");
  nlohmann::json header;
  try {
    header = nlohmann::json::parse(p + 8, p + 8 + n);
  } catch (const nlohmann::json::exception& e) {
    throw InvalidInput("'" + path + "' has a corrupt safetensors header: " + e.what());
  }
  if (!header.is_object())
    throw InvalidInput("'" + path + "' has a corrupt safetensors header: not a JSON object");
  const uint8_t* body = p + 8 + n;
  const int64_t body_size = size - 8 - static_cast<int64_t>(n);
  std::map<std::string, MappedTensor> out;
  for (auto& [name, v] : header.items()) {
    if (name == "__metadata__") continue;
    const std::string origin = path + ":" + name;
    MappedTensor t;
    t.origin = origin;
    try {
      t.dtype = st_dtype(v.at("dtype").get<std::string>(), origin);
      t.shape = v.at("shape").get<std::vector<int64_t>>();
      auto offs = v.at("data_offsets").get<std::vector<int64_t>>();
      if (offs.size() != 2) throw InvalidInput("'" + origin + "': data_offsets needs two numbers");
      const int64_t bytes = checked_numel(t.shape, origin) * dtype_size(t.dtype);
      if (offs[0] < 0 || offs[1] < offs[0])
        throw InvalidInput("'" + origin + "': bad data_offsets [" + std::to_string(offs[0]) +
                           ", " + std::to_string(offs[1]) + "]");
      if (offs[1] > body_size)
        throw InvalidInput("'" + origin + "': data_offsets end at byte " + std::to_string(offs[1]) +
                           " but the file holds " + std::to_string(body_size) +
                           " bytes of data (truncated or corrupt)");
      if (offs[1] - offs[0] != bytes)
        throw InvalidInput("'" + origin + "': shape " + shape_str(t.shape) + " of " +
                           dtype_name(t.dtype) + " needs " + std::to_string(bytes) +
                           " bytes, data_offsets span " + std::to_string(offs[1] - offs[0]));
      t.data = body + offs[0];
    } catch (const nlohmann::json::exception& e) {
      throw InvalidInput("'" + origin + "': corrupt safetensors header entry: " + e.what());
    }
    t.file = file;
    out.emplace(name, std::move(t));
  }
  return out;
}

void to_float(DType t, const uint8_t* src, int64_t count, float* dst) {
  switch (t) {
    case DType::U8:
      for (int64_t i = 0; i < count; ++i) dst[i] = src[i];
      return;
    case DType::I8:
      for (int64_t i = 0; i < count; ++i) dst[i] = static_cast<int8_t>(src[i]);
      return;
    case DType::F32:
      std::memcpy(dst, src, count * 4);
      return;
    default:
      break;
  }
  const int64_t es = dtype_size(t);
  for (int64_t i = 0; i < count; ++i) {
    const uint8_t* s = src + i * es;
    switch (t) {
      case DType::U16: { uint16_t v; std::memcpy(&v, s, 2); dst[i] = v; break; }
      case DType::I16: { int16_t v; std::memcpy(&v, s, 2); dst[i] = v; break; }
      case DType::I32: { int32_t v; std::memcpy(&v, s, 4); dst[i] = static_cast<float>(v); break; }
      case DType::I64: { int64_t v; std::memcpy(&v, s, 8); dst[i] = static_cast<float>(v); break; }
      case DType::F16: { c10::Half v; std::memcpy(&v, s, 2); dst[i] = static_cast<float>(v); break; }
      case DType::BF16: { c10::BFloat16 v; std::memcpy(&v, s, 2); dst[i] = static_cast<float>(v); break; }
      case DType::F64: { double v; std::memcpy(&v, s, 8); dst[i] = static_cast<float>(v); break; }
      default: break;
    }
  }
}

void to_int64(DType t, const uint8_t* src, int64_t count, int64_t* dst) {
  for (int64_t i = 0; i < count; ++i) {
    switch (t) {
      case DType::U8: dst[i] = src[i]; break;
      case DType::I8: dst[i] = static_cast<int8_t>(src[i]); break;
      case DType::U16: { uint16_t v; std::memcpy(&v, src + 2 * i, 2); dst[i] = v; break; }
      case DType::I16: { int16_t v; std::memcpy(&v, src + 2 * i, 2); dst[i] = v; break; }
      case DType::I32: { int32_t v; std::memcpy(&v, src + 4 * i, 4); dst[i] = v; break; }
      case DType::I64: std::memcpy(dst + i, src + 8 * i, 8); break;
      default: throw Error("internal: to_int64 on a float dtype");
    }
  }
}

const MappedTensor::Shard& MappedTensor::shard_of(int64_t i) const {
  auto it = std::upper_bound(shards.begin(), shards.end(), i,
                             [](int64_t v, const Shard& s) { return v < s.first_row; });
  return *(it - 1);
}

std::string MappedTensor::sample_name(int64_t i) const {
  if (shards.empty()) return "'" + origin + "': sample " + std::to_string(i);
  const Shard& s = shard_of(i);
  return "'" + s.origin + "': sample " + std::to_string(i - s.first_row) + " (sample " + std::to_string(i) +
         " of the split)";
}

MappedTensor concat_rows(const std::vector<MappedTensor>& parts, const std::string& origin) {
  if (parts.empty()) throw InvalidInput("'" + origin + "': no shards");
  const MappedTensor& first = parts.front();
  MappedTensor out;
  out.origin = origin;
  out.dtype = first.dtype;
  out.shape = first.shape;
  out.data = first.data;
  out.file = first.file;
  int64_t rows = 0;
  for (const auto& p : parts) {
    if (p.shape.empty() || p.dtype != first.dtype ||
        std::vector<int64_t>(p.shape.begin() + 1, p.shape.end()) !=
            std::vector<int64_t>(first.shape.begin() + 1, first.shape.end())) {
      auto text = [](const MappedTensor& t) {
        std::string dims;
        for (size_t k = 1; k < t.shape.size(); ++k) dims += (dims.empty() ? "" : ", ") + std::to_string(t.shape[k]);
        return std::string(dtype_name(t.dtype)) + " rows [" + dims + "]";
      };
      throw InvalidInput("shard '" + p.origin + "' holds " + (p.shape.empty() ? "a scalar" : text(p)) +
                         ", the first shard '" + first.origin + "' " + text(first) +
                         "; every shard of a split must hold the same dtype and row shape");
    }
    out.shards.push_back({rows, p.data, p.file, p.origin});
    rows += p.shape[0];
  }
  out.shape[0] = rows;
  return out;
}

}  // namespace limbo::data
