// Limbo's error types, chosen by how the caller recovers:
//   InvalidInput  - the user gave something wrong (config, data file, flag):
//                   report the message and exit non-zero; nothing to retry.
//   PeerFailure   - a network peer failed or went away: re-form / reconnect.
//   Timeout       - something did not happen in time: retry or give up.
// Messages name the file, key or peer and the values involved.
#pragma once

#include <stdexcept>
#include <string>

namespace limbo {

class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

class InvalidInput : public Error {
 public:
  using Error::Error;
};

class PeerFailure : public Error {
 public:
  using Error::Error;
};

class Timeout : public Error {
 public:
  using Error::Error;
};

// Exit codes used by the CLI.
constexpr int kExitOk = 0;
constexpr int kExitFailure = 1;       // unexpected internal error
constexpr int kExitInvalidInput = 2;  // user error: bad flag, config or data
constexpr int kExitPeerFailure = 3;
constexpr int kExitTimeout = 4;
constexpr int kExitLostJob = 5;     // a launcher cut off from its job (docs/elastic.md, "How a job ends")

}  // namespace limbo
