#!/usr/bin/env bash
# One node's part of a Slurm job; the sbatch scripts run it once per node with srun:
#   node.sh "PREPARE COMMAND" TORCHRUN-ARGS...
# First PREPARE COMMAND (bash; NODE_RANK is this node's rank; "" for none): the node-local cache fill or copy.
# Then torchrun TORCHRUN-ARGS with --node_rank NODE_RANK, in its own session so that only this script sees
# Slurm's signals: SIGUSR1 (the time-limit notice of `#SBATCH --signal`, forwarded by the batch script) or
# SIGTERM (preemption) becomes one SIGTERM to torchrun, which hands it to the ranks; they finish their step,
# write a checkpoint together and exit with status 75 within train.preempt_grace_s (below torchrun's 30 s).
# After such a stop this script exits 0, so srun --kill-on-bad-exit does not cut short a peer that is still
# closing its checkpoint; otherwise it exits with torchrun's status.
set -uo pipefail
export NODE_RANK=${SLURM_NODEID:-0}
prepare=$1
shift
if [ -n "$prepare" ]; then
  bash -c "$prepare" || exit $?
fi
setsid "${TORCHRUN:-.venv/bin/torchrun}" --node_rank "$NODE_RANK" "$@" &
pid=$!
stopped=""
stop() {
  stopped=$1
  echo "$(hostname): $1 received: the ranks checkpoint and stop (exit status 75 = restartable)" >&2
  kill -TERM "$pid" 2>/dev/null
}
trap 'stop SIGUSR1' USR1
trap 'stop SIGTERM' TERM
status=0
while kill -0 "$pid" 2>/dev/null; do
  wait "$pid"  # returns early when a trap runs; the loop waits on
  status=$?
done
if [ -n "$stopped" ]; then
  echo "$(hostname): torchrun ended with status $status after $stopped" >&2
  exit 0
fi
exit "$status"
