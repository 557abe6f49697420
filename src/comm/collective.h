// Collectives among the members of a training job (data-parallel workers).
//
// `Collective` is the small interface the training code sees; `GlooGroup`
// implements it over c10d's ProcessGroupGloo (the only file that includes
// c10d headers; a CUDA/NCCL build swaps the backend here). All calls block
// the calling thread until the collective completes everywhere, and throw
// PeerFailure when a peer is gone or Timeout when it does not answer within
// the group's timeout. Not thread-safe: one training thread per member.
#pragma once

#include "comm/kv_store.h"

#include <torch/torch.h>

#include <chrono>
#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace limbo::comm {

class Collective {
 public:
  virtual ~Collective() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  // "gloo", "shared-memory" (comm/shm_group.h) or "hierarchical"
  // (comm/hier_group.h), for records and logs.
  virtual const char* transport() const { return "gloo"; }
  // Element-wise sum across members, in place. Large tensors are reduced in
  // buckets of at most bucket_bytes.
  virtual void allreduce_sum(torch::Tensor& t) = 0;
  // Element-wise sum of 16-bit values (a kHalf or kBFloat16 tensor, as from
  // Compressor::encode), in place: pairs are added in float32 and rounded
  // back, so the wire carries 2 bytes per element. Needs the direct Gloo
  // path (elastic.direct_allreduce).
  virtual void allreduce_sum_16(torch::Tensor& t) = 0;
  // Element-wise maximum across members, in place (no bucketing).
  virtual void allreduce_max(torch::Tensor& t) = 0;
  // Copies `t` from member `root` to everyone, in place.
  virtual void broadcast(torch::Tensor& t, int root) = 0;
  // Shards of a flat contiguous tensor: `bounds` holds size() + 1 offsets,
  // bounds[0] = 0 <= bounds[1] <= ... <= bounds[size()] = t.numel(), and
  // member r's shard is [bounds[r], bounds[r + 1]).
  //
  // Sum of a float32 tensor across members, kept where it is needed: on
  // return member r's shard holds the sums, with the bits allreduce_sum
  // gives (the same order of additions); the rest of t is unspecified. The
  // shared-memory group reduces only each member's shard; the default is
  // the all-reduce itself.
  virtual void reduce_scatter_sum(torch::Tensor& t, const std::vector<int64_t>& bounds) { allreduce_sum(t); }
  // Whether reduce_scatter_sum leaves the whole sum on every member (the
  // default, an all-reduce): then a member can update shards besides its
  // own, as the copies of sharded optimizer state on another host are.
  virtual bool reduce_scatter_sums_everywhere() const { return true; }
  // Every member's shard to everyone, bit for bit (any dtype): on return t
  // holds member r's shard at [bounds[r], bounds[r + 1]) on every member.
  // The default broadcasts the shards one after another.
  virtual void all_gather(torch::Tensor& t, const std::vector<int64_t>& bounds);
  // Thread-safe, from any thread: a collective blocked in another thread,
  // and every later one, throws PeerFailure at once; the members blocked
  // with it see their connections close and fail too. For a member known
  // to be gone that the collective itself cannot see (a stopped process
  // keeps its connections open). The group cannot be used again.
  virtual void abort() = 0;
};

struct GroupOptions {
  std::string store_host = "127.0.0.1";
  int store_port = 29400;
  std::string prefix = "limbo";  // key namespace of this group in the store
  std::chrono::milliseconds timeout{60000};
  // Address this member's Gloo device binds to (its interface on the network
  // the peers share); empty = the local address that routes to store_host.
  std::string bind_host;
  int64_t bucket_bytes = 8 << 20;
  // Float all-reduces go through a raw Gloo context on the calling thread
  // (false: through c10d's ProcessGroupGloo, in buckets of bucket_bytes).
  bool direct_allreduce = true;
  int worker_threads = 2;  // c10d's Gloo worker threads (its default; measured best at 16-64 MB)
  // make_group(): members that all share this host reduce through shared
  // memory (comm/shm_group.h) instead of Gloo over loopback.
  bool shared_memory = true;
  // make_group(): members on several hosts, some host holding more than
  // one: reduce within each host over shared memory and between hosts over
  // Gloo (comm/hier_group.h); false: one flat Gloo group.
  bool hierarchical = true;
  // This member's host as make_group() compares it; empty = host_identity()
  // (tests place in-process members on different "hosts" with it).
  std::string host;
  std::string token;       // the job secret of the rendezvous store (comm/auth.h); empty = none
  // Polled every few milliseconds while the group forms: when it returns
  // true (the round being formed was replaced), formation stops at once
  // with PeerFailure, in the store's waits and in Gloo's connection set-up.
  std::function<bool()> cancelled;
  // The group's rendezvous through another store than the embedded one
  // (etcd): makes a connection for Gloo's address exchange. store_host then
  // only picks the local address towards the peers, and control_ports are
  // that store's ports (its connections are not the group's).
  std::function<std::shared_ptr<KvStore>()> connect_store;
  std::vector<int> control_ports;
  // The embedded store's connection this member already holds (comm/store.h
  // carries many calls on one): the group forms through it, where it would
  // open a connection of its own for every formation.
  std::shared_ptr<StoreClient> share_client;
};

// The store a group forms through (opt.connect_store, or a client of the
// job's store), and a wait there for `key` that stops with PeerFailure when
// opt.cancelled says the round was replaced, and with Timeout after
// opt.timeout.
std::shared_ptr<KvStore> group_store(const GroupOptions& opt);
std::string wait_group_key(KvStore& kv, const std::string& key, const GroupOptions& opt);

// Connects to the job's rendezvous store and forms a Gloo group of `size` members.
// Sets SIGPIPE to ignored if it had the default action (a write to a dead
// peer must fail the collective, not kill the process).
// Blocks until all members have joined or the timeout passes (Timeout).
std::unique_ptr<Collective> make_gloo_group(const GroupOptions& opt, int rank, int size);

// The local address this machine uses to reach `host` (asks the kernel's
// routing table via an unconnected UDP socket; sends nothing). "127.0.0.1"
// for loopback hosts. Throws PeerFailure if there is no route.
std::string local_address_towards(const std::string& host);

// The address other machines reach this one by, seen from `hosts` (e.g.
// etcd's endpoints): the route towards the first of them that is not
// loopback; when every one is local (an etcd on this machine), the first
// non-loopback IPv4 address of an interface that is up; loopback only
// when this machine has nothing else.
std::string reachable_address(const std::vector<std::string>& hosts);

// True when `host` is an address of this machine (it can be bound here).
bool is_local_address(const std::string& host);

// Hosts the job's rendezvous store (comm/store.h; the launcher does this, not
// a worker), guarded by the job secret `token` when it is not empty.
// Returns an opaque handle; the store lives as long as the handle.
// port 0 picks a free port; the chosen port is returned in *port.
// Checks that `bounds` are shards of `t` for a group of `size` (above);
// throws Error naming `what` when not.
void check_shards(const torch::Tensor& t, const std::vector<int64_t>& bounds, int size, const char* what);

std::shared_ptr<void> host_store(const std::string& host, int* port, const std::string& token = "");

}  // namespace limbo::comm
