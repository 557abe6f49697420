// What a job step learns from Slurm's environment (`srun` sets it for every
// task): the job id, its nodes, the CPUs of a task, how often the job was
// requeued. `limbo launch` run by `srun` (one task per node) derives its
// defaults from it (docs/slurm.md).
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

namespace limbo {

// Expands a Slurm host list ("node[01-03,7],gpu-a,x[1-2]-ib") into names, in
// order. Throws InvalidInput on a malformed list, or one of more than
// `limit` names.
std::vector<std::string> expand_slurm_hostlist(const std::string& list, size_t limit = 1000000);

struct SlurmJob {
  std::string job_id;              // SLURM_JOB_ID
  std::vector<std::string> nodes;  // SLURM_JOB_NODELIST, expanded
  int cpus_per_task = 0;           // SLURM_CPUS_PER_TASK (0: not set)
  int cpus_on_node = 0;            // SLURM_CPUS_ON_NODE (0: not set)
  int restart_count = 0;           // SLURM_RESTART_COUNT: times the job was requeued
  int node_id = -1;                // SLURM_NODEID (-1: not in a step)
  std::string launch_node_ip;      // SLURM_LAUNCH_NODE_IPADDR: where `srun` ran (the batch script's node)
  // Workers per node: the CPUs of a task, else the CPUs of this node, else 1.
  int workers_per_node() const;
  // A rendezvous port for this job (the same on every node): 29400 plus the
  // job id modulo 1000, so jobs that share a first node rarely meet.
  int rendezvous_port() const;
};

// The Slurm job this process runs in, read through `getenv` (the process's
// environment by default); none outside a Slurm job (no SLURM_JOB_ID).
// Throws InvalidInput when the variables are there but malformed.
std::optional<SlurmJob> slurm_job(const std::function<const char*(const char*)>& getenv = nullptr);

}  // namespace limbo
