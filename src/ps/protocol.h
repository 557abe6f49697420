// The parameter-server wire protocol (no ZeroMQ, no libtorch here).
//
// Every message is a ZeroMQ multipart message of three frames:
//   1. header  - exactly kHeaderBytes, little-endian, layout below;
//   2. meta    - UTF-8 JSON object, at most kMaxMetaBytes (may be empty);
//   3. payload - raw little-endian float32 values, or 16-bit values where a
//                flag says so (may be empty); its size must equal
//                header.payload_bytes.
// The server's ROUTER socket adds the peer identity in front; the codec never
// sees it. See docs/parameter-server.md for the message types and fields.
//
// Large payloads travel in parts: a push or a weights reply for a shard's
// slice may be several messages with the same seq and clock, each carrying
// the values [offset, offset + payload_bytes / value_bytes(flags)) of the
// slice, in order (4 bytes a value; 2 for fp16 or bf16 payloads).
// Part sizes are the sender's choice (ps.part_mb); the receiver assembles.
//
// decode() is total: any byte sequence yields either a Message or a
// Rejection naming the reason; it never throws and never reads out of bounds.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace limbo::ps {

constexpr uint32_t kMagic = 0x5350424cu;  // "LBPS" in little-endian byte order
constexpr uint16_t kProtocolVersion = 4;  // 3: 16-bit payloads; 4: model buffers in a frame of their own
constexpr size_t kHeaderBytes = 56;
constexpr size_t kMaxMetaBytes = 64 * 1024;

enum class MsgType : uint8_t {
  Hello = 1,      // learner -> shard: register (meta: fingerprint, model description)
  Welcome = 2,    // shard -> learner: registered (meta: shard range, clock, learners)
  Refuse = 3,     // shard -> learner: registration refused (meta: reason)
  Pull = 4,       // learner -> shard: ask for weights (meta: want_lease, final)
  Weights = 5,    // shard -> learner: weights slice at header.clock (meta: lease)
  Push = 6,       // learner -> shard: gradient slice computed at header.clock
  PushAck = 7,    // shard -> learner: outcome of a push (meta: status, staleness)
  Heartbeat = 8,  // learner -> shard: still alive
  Bye = 9,        // learner -> shard: deregister
  Error = 10,     // shard -> learner: request refused (meta: code, reason)
};
const char* type_name(MsgType t);

// Header flags of a Pull.
constexpr uint8_t kWantLease = 1;  // shard 0: hand out the next data batch with the weights
constexpr uint8_t kObserver = 2;   // not a registered learner: just read the weights
constexpr uint8_t kFinal = 4;      // answer once no learner is registered (final weights)
// Header flag of a Push or Weights part: more parts of this payload follow.
constexpr uint8_t kMoreParts = 8;
// Header flags of a Push or Weights part: its values are 16-bit, IEEE half
// or bfloat16, instead of float32 (offsets still count values). On a Pull,
// the same flag asks for the weights in that encoding (ps.pull_compression).
constexpr uint8_t kFp16Values = 16;
constexpr uint8_t kBf16Values = 32;
constexpr uint8_t kValueEncoding = kFp16Values | kBf16Values;
// Header flag of the first part of a Push to shard 0 or of its Weights: a
// fourth frame follows, the model's buffers (batch-norm statistics) as
// float32, at most kMaxBufferFloats (a ResNet-50 has 53,000).
constexpr uint8_t kBuffers = 64;
constexpr size_t kMaxBufferFloats = size_t{1} << 24;
// Bytes per payload value under these flags: 2 or 4.
inline size_t value_bytes(uint8_t flags) { return (flags & kValueEncoding) ? 2 : 4; }
// Most parts one payload may come in (a shard refuses a push in more); a
// sender makes its parts at least 1/kMaxParts of the slice.
constexpr int64_t kMaxParts = 4096;
int64_t part_size(int64_t wanted_floats, int64_t slice_floats);  // floats per part (wanted <= 0: whole slice)
bool valid_type(uint8_t t);

struct Header {
  uint32_t magic = kMagic;
  uint16_t version = kProtocolVersion;
  MsgType type = MsgType::Hello;
  uint8_t flags = 0;
  uint32_t sender = 0;    // learner id (learner -> shard) or shard index (shard -> learner)
  uint32_t shard = 0;     // the shard addressed / answering
  uint64_t clock = 0;     // server clock of the weights (Weights) or pulled clock (Push)
  uint64_t seq = 0;       // request sequence number; replies echo it
  int64_t aux = 0;        // type-specific small value (e.g. a push's lease id)
  uint64_t payload_bytes = 0;
  uint64_t offset = 0;    // Push / Weights: index of the payload's first float within the shard's slice
};

void encode_header(const Header& h, unsigned char out[kHeaderBytes]);

// A received frame: bytes owned by `keep` (e.g. a ZeroMQ message), no copy.
struct Frame {
  const unsigned char* data = nullptr;
  size_t size = 0;
  std::shared_ptr<void> keep;
};
// A frame of the floats in `v`, which it keeps alive (sent without a copy).
inline Frame float_frame(std::shared_ptr<std::vector<float>> v) {
  Frame f;
  f.data = reinterpret_cast<const unsigned char*>(v->data());
  f.size = v->size() * sizeof(float);
  f.keep = std::move(v);
  return f;
}

// `f` itself when its bytes start at a multiple of `alignment`; else a
// frame that owns an aligned copy of them. ZeroMQ may hand out a frame at
// any byte offset, and values are read in place.
Frame aligned_frame(const Frame& f, size_t alignment);

// Floats [offset, offset + n) of a shard's slice (a gradient that arrived in
// parts): float32 at `data`, or 16-bit values at `halves` (comm.compression;
// `data` null), widened by their reader a cache-sized chunk at a time.
struct GradPart {
  int64_t offset = 0;
  const float* data = nullptr;
  int64_t n = 0;
  const uint16_t* halves = nullptr;
  bool bf16 = false;  // halves are bf16 (else fp16)
};

struct Message {
  Header header;
  std::string meta;  // JSON text
  Frame payload;     // values (float32, or 16-bit per the flags), size == header.payload_bytes
  Frame buffers;     // kBuffers: the model's buffers (float32); else empty
  size_t buffer_floats() const { return buffers.size / sizeof(float); }
  size_t floats() const { return payload.size / value_bytes(header.flags); }  // values, whatever their width
};

enum class Reject {
  None = 0,
  FrameCount,    // not 3 frames (4 with kBuffers)
  HeaderSize,    // header frame is not kHeaderBytes
  Magic,
  Version,
  Type,
  MetaSize,      // meta frame larger than kMaxMetaBytes
  MetaJson,      // meta is not a JSON object
  PayloadSize,   // payload frame size != header.payload_bytes, or not a multiple of 4 (buffers: of 4)
  Oversized,     // payload larger than the receiver's limit (buffers: than kMaxBufferFloats)
  Shape,         // payload size does not match the shard's slice
  NonFinite,     // NaN or Inf in a gradient
  UnknownLearner,
  Protocol,      // a valid message that is not allowed now (e.g. clock from the future)
};
constexpr int kRejectKinds = 14;
const char* reject_name(Reject r);

struct Decoded {
  Reject reject = Reject::None;
  std::string detail;  // human-readable reason when rejected
  Message msg;
};

// Decodes frames into a message; payloads above max_payload_bytes are
// rejected as Oversized. The header is checked before anything else is read;
// magic and version (its first 6 bytes in every protocol version) before its
// size, so that a peer of another version is told so.
Decoded decode(const std::vector<Frame>& frames, uint64_t max_payload_bytes);

// True when every float of the payload is finite.
bool all_finite(const float* data, size_t n);

// 64-bit FNV-1a over a byte string (model fingerprints).
uint64_t fnv1a(const std::string& s);
std::string hex64(uint64_t v);  // 16 lowercase hex digits

}  // namespace limbo::ps
