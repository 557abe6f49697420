#!/bin/bash
# Runs `limbo launch` once on every node of the Slurm job (one task per node;
# each launcher starts its node's workers), passes Slurm's warning on to it,
# and requeues the job when Limbo stopped for that warning.
#
#   examples/slurm/limbo-srun.sh [limbo launch flags] -- [limbo train args]
#
# From inside an sbatch script. `limbo launch` takes the node count, the
# workers per node (--cpus-per-task), the rendezvous host (the first node)
# and the run directory (runs/slurm-<job id>) from Slurm (docs/slurm.md).
#
# With `#SBATCH --signal=B:USR1@SECONDS` Slurm sends SIGUSR1 to this script
# that long before the time limit or a preemption; it goes to every
# launcher, whose workers checkpoint and leave, and `limbo launch` exits with
# 75. The job is then requeued (`#SBATCH --requeue` allows it) and its next
# run resumes from the checkpoint in its run directory. (A cluster whose
# slurm.conf has RequeueExit=75 requeues on that exit code by itself.)
set -u
LIMBO="${LIMBO:-limbo}"
# --no-kill: a node lost or preempted ends its launcher only; the others go
# on without it (elastic).
srun --ntasks-per-node=1 --no-kill --kill-on-bad-exit=0 "$LIMBO" launch "$@" &
step=$!
trap 'echo "limbo-srun: SIGUSR1 from Slurm: the workers checkpoint and stop"; kill -USR1 "$step"' USR1
trap 'kill -TERM "$step"' TERM
while :; do
  wait "$step"
  rc=$?
  # A trapped signal ends `wait` early (status above 128) while the step runs on.
  kill -0 "$step" 2>/dev/null || break
done
if [ "$rc" -eq 75 ]; then
  echo "limbo-srun: requeueing job $SLURM_JOB_ID; its next run resumes from its checkpoint"
  scontrol requeue "$SLURM_JOB_ID"
fi
exit "$rc"
