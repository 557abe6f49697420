// Limbo's error types, chosen by how the caller recovers:
//   InvalidInput  - the user gave something wrong (config, data file, flag):
//                   report the message and exit non-zero; nothing to retry.
//   Diverged      - (an InvalidInput) the run's gradients stopped being finite.
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

// Training diverged (a gradient or loss not finite, step after step): the
// learning rate or the data needs the user's attention; exits like an input
// error, and launchers do not restart it.
class Diverged : public InvalidInput {
 public:
  using InvalidInput::InvalidInput;
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
// A launcher stopped by SIGUSR1 (Slurm's warning ahead of preemption or the
// time limit) after its workers checkpointed and left: requeue the job
// (EX_TEMPFAIL; docs/slurm.md).
constexpr int kExitPreempted = 75;

}  // namespace limbo
