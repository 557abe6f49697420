// base64 (RFC 4648): etcd's JSON gateway carries keys and values in it, and
// the parameter server carries a model's buffers in its JSON metadata.
#pragma once

#include <string>

namespace limbo {

std::string base64_encode(const std::string& s);
std::string base64_decode(const std::string& s);  // skips characters outside the alphabet

}  // namespace limbo
