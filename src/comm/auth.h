// The job secret that guards the rendezvous store (comm/store.h), and the
// HMAC-SHA256 challenge-response both ends run with it (OpenSSL libcrypto).
//
// Handshake, on every new connection (the secret never travels):
//   server -> client  hello: protocol name, server nonce (32 random bytes;
//                     empty when the store runs without a secret)
//   client -> server  auth: client nonce, HMAC(secret, "client" sn cn)
//   server -> client  ok: HMAC(secret, "server" cn sn)   (or "denied", then close)
// The client checks the server's answer too, so a process that pretends to
// be the store without knowing the secret is not believed. A replayed auth
// frame fails: the server's nonce is new for every connection. The
// handshake is not bound to the channel: a relay that a client connects to
// could pass it through to the real store, so jobs run on a network only
// their machines reach (docs/elastic.md, "Security").
#pragma once

#include <string>

namespace limbo::comm {

// `n` bytes from the system's CSPRNG (RAND_bytes). Throws Error if it fails.
std::string random_bytes(size_t n);
// HMAC-SHA256 of `msg` under `key` (32 bytes).
std::string hmac_sha256(const std::string& key, const std::string& msg);
// Constant-time comparison (CRYPTO_memcmp); false when lengths differ.
bool same_secret_bytes(const std::string& a, const std::string& b);

// The MACs of the handshake above.
std::string client_proof(const std::string& secret, const std::string& server_nonce,
                         const std::string& client_nonce);
std::string server_proof(const std::string& secret, const std::string& server_nonce,
                         const std::string& client_nonce);

// Reads a job secret from `path`: the file's bytes with trailing whitespace
// removed. Throws InvalidInput naming the file when it cannot be read or is
// shorter than 16 bytes. Warns when others than the owner may read it.
std::string load_token_file(const std::string& path);
// Checks a secret given directly (LIMBO_JOB_TOKEN): at least 16 bytes.
std::string check_token(const std::string& token, const std::string& source);

}  // namespace limbo::comm
