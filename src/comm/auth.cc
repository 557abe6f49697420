#include "comm/auth.h"

#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/rand.h>
#include <sys/stat.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <sstream>

#include "common/error.h"
#include "common/log.h"

namespace limbo::comm {

std::string random_bytes(size_t n) {
  std::string out(n, '\0');
  if (n > 0 && RAND_bytes(reinterpret_cast<unsigned char*>(out.data()), static_cast<int>(n)) != 1)
    throw Error("the system's random number generator failed (RAND_bytes)");
  return out;
}

std::string hmac_sha256(const std::string& key, const std::string& msg) {
  unsigned char out[EVP_MAX_MD_SIZE];
  size_t len = 0;
  if (!EVP_Q_mac(nullptr, "HMAC", nullptr, "SHA256", nullptr, key.data(), key.size(),
                 reinterpret_cast<const unsigned char*>(msg.data()), msg.size(), out, sizeof out, &len))
    throw Error("HMAC-SHA256 failed (libcrypto)");
  return std::string(reinterpret_cast<char*>(out), len);
}

bool same_secret_bytes(const std::string& a, const std::string& b) {
  return a.size() == b.size() && CRYPTO_memcmp(a.data(), b.data(), a.size()) == 0;
}

std::string client_proof(const std::string& secret, const std::string& sn, const std::string& cn) {
  return hmac_sha256(secret, "limbo-store client\n" + sn + cn);
}

std::string server_proof(const std::string& secret, const std::string& sn, const std::string& cn) {
  return hmac_sha256(secret, "limbo-store server\n" + cn + sn);
}

std::string check_token(const std::string& token, const std::string& source) {
  if (token.size() < 16)
    throw InvalidInput("the job secret from " + source + " has " + std::to_string(token.size()) +
                       " bytes; it needs at least 16 (e.g. `head -c 32 /dev/urandom | base64 > job.token`)");
  return token;
}

std::string load_token_file(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  if (!f) throw InvalidInput("--token-file '" + path + "': " + std::strerror(errno));
  std::stringstream ss;
  ss << f.rdbuf();
  std::string t = ss.str();
  while (!t.empty() && (t.back() == '\n' || t.back() == '\r' || t.back() == ' ' || t.back() == '\t'))
    t.pop_back();
  struct stat st {};
  if (::stat(path.c_str(), &st) == 0 && (st.st_mode & 077))
    log_warn("--token-file '" + path + "' can be read by other users (chmod 600 it)");
  return check_token(t, "--token-file '" + path + "'");
}

}  // namespace limbo::comm
