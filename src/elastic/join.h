// Joining a data-parallel job, as every front end does it (`limbo train`
// under `limbo launch`, and the Python module): the group options and the
// update rule from the job's rendezvous, and for an elastic job the Member
// (heartbeats through the launcher's table when LIMBO_BEAT_SLOT names a
// slot) and the Membership that re-forms the group.
#pragma once

#include <functional>
#include <vector>
#include <memory>
#include <string>
#include <utility>

#include "comm/collective.h"
#include "elastic/allreduce_update.h"
#include "elastic/elastic_membership.h"

namespace limbo::elastic {

// HOST:PORT; throws InvalidInput naming `flag` on anything else.
std::pair<std::string, int> split_host_port(const std::string& s, const char* flag);

struct JoinOptions {
  std::string rdzv;   // HOST:PORT of the job's store, or an etcd URL (elastic only)
  std::string token;  // the job secret; empty = none
  bool direct_allreduce = true;    // elastic.direct_allreduce
  bool shared_memory = true;       // comm.shared_memory
  bool hierarchical = true;        // comm.hierarchical
  double collective_timeout = 60;  // elastic.collective_timeout, seconds (elastic)
  double round_timeout = 120;      // elastic.round_timeout, seconds (elastic)
  ReduceOptions reduce;
};

// A static job: member `rank` of `world` (the group formed through the
// store at opt.rdzv) and its all-reduce rule.
std::shared_ptr<AllReduceUpdate> join_static(const JoinOptions& opt, int rank, int world,
                                             std::shared_ptr<train::OptimizerStep> optimizer,
                                             optim::FlatParams& flat);

struct Joined {
  std::shared_ptr<AllReduceUpdate> rule;
  std::unique_ptr<ElasticMembership> membership;
};
// An elastic job: a Member of the job at opt.rdzv (nothing formed yet; the
// front end's Session forms the first round). `want_leave` is polled after
// every step (a SIGTERM flag).
Joined join_elastic(const JoinOptions& opt, std::shared_ptr<train::OptimizerStep> optimizer,
                    optim::FlatParams& flat, std::function<bool()> want_leave);

// SIGTERM, SIGINT (Ctrl-C reaches every process of the terminal's group)
// and SIGUSR1 (Slurm's warning ahead of preemption or the time limit) set a
// flag instead of ending the process: the member finishes its step and
// leaves at the next agreed boundary (the writer checkpoints first).
// Returns the flag's reader. For the signals in `chain`, the handler that
// was there before also runs (a Python user's own handler: Python's C
// handler, which runs the user's function at the next bytecode). A process
// forked meanwhile (a DataLoader's workers) starts with the handlers that
// were there before, as under plain PyTorch.
std::function<bool()> leave_on_signals(const std::vector<int>& chain = {});
// Puts back the handlers leave_on_signals() replaced (training is over:
// Ctrl-C acts as it did before the job).
void restore_signals();
// The last of those signals received (0: none), and the exit code a member
// that stops on it uses: 128 + the signal, 75 for SIGUSR1 (as the launcher's).
int leave_signal();
int exit_code_for(int sig);

}  // namespace limbo::elastic
