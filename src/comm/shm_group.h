// Collectives among the members of one host, through shared memory.
//
// Workers on one host need not go through loopback TCP (kernel socket
// copies and a system call per message, which for a 1 MB gradient cost more
// than the step's compute on this machine): they map one shared segment and
// reduce in it. make_group() (comm/hier_group.h) forms a ShmGroup when every
// member of the group is on this host.
//
// The segment (POSIX shared memory, 0600) holds a header (a barrier, an
// abort flag, each member's pid), one slot per member and two result
// areas. A collective goes through its tensor in pieces of at most a slot:
//   1. each member copies into its slot the parts of its piece that the
//      others reduce (its own share it reads from its tensor); barrier;
//   2. each member reduces its own share of the elements across the slots
//      in member order (slot 0 + slot 1 + ... in float32; 16-bit pairs added
//      in float32 and rounded, as comm::sum_bf16 / sum_fp16) into a result
//      area; barrier;
//   3. each member copies the reduced piece out.
// The result areas take turns, so the next piece needs no third barrier.
// Sums run in one fixed order, so every member gets the same bits, and for
// two members the bits Gloo's ring gives (a + b either way). A broadcast
// copies the root's piece through a result area (one barrier a piece).
//
// Contracts it shares with the Gloo path:
//   - abort() (the heartbeat thread, on a member that stopped answering)
//     makes a collective blocked in another thread, and every later one,
//     throw PeerFailure at once; it also raises the segment's abort flag, so
//     the other members blocked with it fail too;
//   - a member that dies (its pid gone) fails the others' collectives within
//     a few tens of milliseconds; one that stops (SIGSTOP) is found by the
//     heartbeats, which abort;
//   - the group's timeout bounds every wait (Timeout);
//   - a new segment per group (per membership round): nothing crosses a
//     membership change;
//   - the segment's name is removed as soon as every member has mapped it,
//     so the memory goes with the last mapping, whoever dies. A name left by
//     a member that died while the group formed carries the creator's pid
//     and pid namespace (/dev/shm/limbo-shm-PID-nsINODE-RANDOM):
//     remove_stale_segments() (the launcher, as workers exit and when the
//     job ends) removes it, if it was made in the launcher's pid namespace.
// Each member has a slot of 8 MiB, halved (down to 256 KiB) while the
// segment does not fit the free space of /dev/shm (a container's small
// tmpfs); a host where not even that fits falls back to Gloo, every member
// alike, with a warning.
#pragma once

#include <sys/types.h>

#include <memory>
#include <string>

#include "comm/collective.h"

namespace limbo::comm {

// What identifies this host to the group: members with the same identity
// share memory. The boot and the network, mount, IPC and pid namespaces
// (network namespaces stand for hosts in tests, and a host cut off from the
// network must not go on reducing through memory with the others; members
// watch each other's pids, which another pid namespace cannot see).
std::string host_identity();

// Forms a shared-memory group of `size` members on this host under
// opt.prefix in the job's store; null (every member alike) when the
// segment cannot be made.
std::unique_ptr<Collective> make_shm_group(const GroupOptions& opt, int rank, int size);

// The start of the names of segments that process `pid` of this pid
// namespace makes: "limbo-shm-PID-nsINODE-".
std::string segment_prefix(pid_t pid);

// Removes every segment name made in this pid namespace whose creator is
// no longer running; returns how many. Names of running processes stay,
// and so do names made in another pid namespace (a container sharing this
// /dev/shm), whose pids mean nothing here.
int remove_stale_segments();

// Whether process `pid` of this pid namespace is running and not a zombie
// (true for pid <= 0, and where /proc cannot tell).
bool process_alive(pid_t pid);

}  // namespace limbo::comm
