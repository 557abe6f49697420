// Which group a set of members forms, and the hierarchical all-reduce for
// members spread over several hosts with more than one on some host.
//
// make_group() has every member publish its host (host_identity(), or
// GroupOptions::host) under the group's prefix and read the others'. Then:
//   - all on one host: a shared-memory group (comm/shm_group.h);
//   - one member per host, or comm.hierarchical off: one flat Gloo group;
//   - otherwise a hierarchical group. Hosts are numbered by their lowest
//     rank, members within a host by rank. Each host forms a local group
//     (shared memory; Gloo where its segment cannot be made; nothing for a
//     host of one). With K the smallest member count of any host, local
//     member j < K of every host joins cross group j (Gloo, one member per
//     host). An all-reduce then
//       1. sums within each host (every member of the host holds the host's
//          sum, added in rank order);
//       2. cuts the tensor into K chunks; cross group j all-reduces chunk j
//          between hosts, so the hosts' K links share the traffic;
//       3. has member j of each host broadcast chunk j within its host.
//     A float32 sum makes step 1 a reduce-scatter (member j sums only chunk
//     j) and step 3 an all-gather: the same bits, with the host's additions
//     and copies split among its members.
// The order of the float32 sums is fixed: for 2 or 4 hosts of 2 or 4
// members each, holding consecutive ranks, it is the tree over ranks that
// the flat Gloo path uses for a power-of-two group, ((x0 + x1) + (x2 + x3)),
// so the two paths give the same bits (a test in network namespaces checks
// this). Any failure in a part aborts both parts, so the members of the
// host and of the cross group fail at once with it.
#pragma once

#include <memory>

#include "comm/collective.h"

namespace limbo::comm {

std::unique_ptr<Collective> make_group(const GroupOptions& opt, int rank, int size);

}  // namespace limbo::comm
