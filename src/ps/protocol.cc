#include "ps/protocol.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>

namespace limbo::ps {
namespace {

template <typename T>
void put(unsigned char*& p, T v) {
  for (size_t i = 0; i < sizeof(T); ++i) *p++ = static_cast<unsigned char>((static_cast<uint64_t>(v) >> (8 * i)) & 0xff);
}

template <typename T>
T get(const unsigned char*& p) {
  uint64_t v = 0;
  for (size_t i = 0; i < sizeof(T); ++i) v |= static_cast<uint64_t>(*p++) << (8 * i);
  return static_cast<T>(v);
}

}  // namespace

const char* type_name(MsgType t) {
  switch (t) {
    case MsgType::Hello: return "hello";
    case MsgType::Welcome: return "welcome";
    case MsgType::Refuse: return "refuse";
    case MsgType::Pull: return "pull";
    case MsgType::Weights: return "weights";
    case MsgType::Push: return "push";
    case MsgType::PushAck: return "push-ack";
    case MsgType::Heartbeat: return "heartbeat";
    case MsgType::Bye: return "bye";
    case MsgType::Error: return "error";
  }
  return "unknown";
}

bool valid_type(uint8_t t) { return t >= 1 && t <= 10; }

int64_t part_size(int64_t wanted_floats, int64_t slice_floats) {
  if (wanted_floats <= 0 || wanted_floats >= slice_floats) return slice_floats > 0 ? slice_floats : 1;
  return std::max(wanted_floats, (slice_floats + kMaxParts - 1) / kMaxParts);
}

const char* reject_name(Reject r) {
  switch (r) {
    case Reject::None: return "none";
    case Reject::FrameCount: return "frame_count";
    case Reject::HeaderSize: return "header_size";
    case Reject::Magic: return "magic";
    case Reject::Version: return "version";
    case Reject::Type: return "type";
    case Reject::MetaSize: return "meta_size";
    case Reject::MetaJson: return "meta_json";
    case Reject::PayloadSize: return "payload_size";
    case Reject::Oversized: return "oversized";
    case Reject::Shape: return "shape";
    case Reject::NonFinite: return "non_finite";
    case Reject::UnknownLearner: return "unknown_learner";
    case Reject::Protocol: return "protocol";
  }
  return "unknown";
}

void encode_header(const Header& h, unsigned char out[kHeaderBytes]) {
  unsigned char* p = out;
  put<uint32_t>(p, h.magic);
  put<uint16_t>(p, h.version);
  put<uint8_t>(p, static_cast<uint8_t>(h.type));
  put<uint8_t>(p, h.flags);
  put<uint32_t>(p, h.sender);
  put<uint32_t>(p, h.shard);
  put<uint64_t>(p, h.clock);
  put<uint64_t>(p, h.seq);
  put<uint64_t>(p, static_cast<uint64_t>(h.aux));
  put<uint64_t>(p, h.payload_bytes);
  put<uint64_t>(p, h.offset);
}

Frame aligned_frame(const Frame& f, size_t alignment) {
  if (reinterpret_cast<uintptr_t>(f.data) % alignment == 0) return f;
  // Whole floats: aligned for any value width the protocol has.
  auto copy = std::make_shared<std::vector<float>>((f.size + sizeof(float) - 1) / sizeof(float));
  std::memcpy(copy->data(), f.data, f.size);
  Frame a = float_frame(std::move(copy));
  a.size = f.size;
  return a;
}

Decoded decode(const std::vector<Frame>& frames, uint64_t max_payload_bytes) {
  Decoded d;
  auto fail = [&](Reject r, std::string why) {
    d.reject = r;
    d.detail = std::move(why);
    return d;
  };
  auto frame_count = [&] {
    return fail(Reject::FrameCount, "expected 3 frames (header, meta, payload; a fourth, the buffers, with flag " +
                                        std::to_string(kBuffers) + "), got " + std::to_string(frames.size()));
  };
  if (frames.size() != 3 && frames.size() != 4) return frame_count();
  const Frame& hf = frames[0];
  auto wrong_size = [&] {
    return fail(Reject::HeaderSize, "header frame has " + std::to_string(hf.size) + " bytes, expected " +
                                        std::to_string(kHeaderBytes));
  };
  if (hf.size < 6 || hf.data == nullptr) return wrong_size();
  const unsigned char* p = hf.data;
  Header& h = d.msg.header;
  h.magic = get<uint32_t>(p);
  if (h.magic != kMagic) return fail(Reject::Magic, "bad magic (not a Limbo parameter-server message)");
  h.version = get<uint16_t>(p);
  if (h.version != kProtocolVersion)
    return fail(Reject::Version, "protocol version " + std::to_string(h.version) + ", this build speaks " +
                                     std::to_string(kProtocolVersion));
  if (hf.size != kHeaderBytes) return wrong_size();
  uint8_t type = get<uint8_t>(p);
  if (!valid_type(type)) return fail(Reject::Type, "unknown message type " + std::to_string(type));
  h.type = static_cast<MsgType>(type);
  h.flags = get<uint8_t>(p);
  h.sender = get<uint32_t>(p);
  h.shard = get<uint32_t>(p);
  h.clock = get<uint64_t>(p);
  h.seq = get<uint64_t>(p);
  h.aux = static_cast<int64_t>(get<uint64_t>(p));
  h.payload_bytes = get<uint64_t>(p);
  h.offset = get<uint64_t>(p);
  if ((frames.size() == 4) != ((h.flags & kBuffers) != 0)) return frame_count();

  const Frame& mf = frames[1];
  if (mf.size > kMaxMetaBytes)
    return fail(Reject::MetaSize, "meta frame of " + std::to_string(mf.size) + " bytes exceeds " +
                                      std::to_string(kMaxMetaBytes));
  if (mf.size > 0) {
    if (mf.data == nullptr) return fail(Reject::MetaSize, "meta frame without data");
    d.msg.meta.assign(reinterpret_cast<const char*>(mf.data), mf.size);
    if (!nlohmann::json::accept(d.msg.meta) || d.msg.meta.find('{') != d.msg.meta.find_first_not_of(" \t\r\n"))
      return fail(Reject::MetaJson, "meta frame is not a JSON object");
  }

  const Frame& pf = frames[2];
  if (h.payload_bytes > max_payload_bytes)
    return fail(Reject::Oversized, "payload of " + std::to_string(h.payload_bytes) + " bytes exceeds the limit of " +
                                       std::to_string(max_payload_bytes));
  if ((h.flags & kValueEncoding) == kValueEncoding)
    return fail(Reject::PayloadSize, "payload flagged both fp16 and bf16");
  const size_t width = value_bytes(h.flags);
  if (pf.size != h.payload_bytes || pf.size % width != 0 || (pf.size > 0 && pf.data == nullptr))
    return fail(Reject::PayloadSize, "payload frame has " + std::to_string(pf.size) + " bytes, header says " +
                                         std::to_string(h.payload_bytes) + " (must be a multiple of " +
                                         std::to_string(width) + ")");
  d.msg.payload = pf;
  if (frames.size() == 4) {
    const Frame& bf = frames[3];
    if (bf.size > kMaxBufferFloats * sizeof(float))
      return fail(Reject::Oversized, "buffers frame of " + std::to_string(bf.size) + " bytes exceeds the limit of " +
                                         std::to_string(kMaxBufferFloats * sizeof(float)));
    if (bf.size % sizeof(float) != 0 || (bf.size > 0 && bf.data == nullptr))
      return fail(Reject::PayloadSize,
                  "buffers frame has " + std::to_string(bf.size) + " bytes (must be a multiple of 4)");
    d.msg.buffers = bf;
  }
  return d;
}

__attribute__((optimize("O3"))) bool all_finite(const float* data, size_t n) {
  // A float is NaN or Inf exactly when its exponent bits are all ones;
  // adding one exponent ulp then carries into bit 31. An OR of that
  // vectorises with plain SSE2 (a float sum or an unsigned max would not).
  uint32_t m = 0;
  for (size_t i = 0; i < n; ++i) {
    uint32_t u;
    std::memcpy(&u, data + i, 4);
    m |= (u & 0x7f800000u) + 0x00800000u;
  }
  return (m & 0x80000000u) == 0;
}

uint64_t fnv1a(const std::string& s) {
  uint64_t h = 1469598103934665603ull;
  for (unsigned char c : s) {
    h ^= c;
    h *= 1099511628211ull;
  }
  return h;
}

std::string hex64(uint64_t v) {
  char buf[17];
  std::snprintf(buf, sizeof buf, "%016llx", static_cast<unsigned long long>(v));
  return buf;
}

}  // namespace limbo::ps
