#!/usr/bin/env bash
# One node's part of a Slurm job; the sbatch scripts run it once per node with srun:
#   node.sh "PREPARE COMMAND" TORCHRUN-ARGS...
# First PREPARE COMMAND (bash; NODE_RANK is this node's rank; "" for none): the node-local cache fill or copy.
# Then torchrun TORCHRUN-ARGS with --node_rank NODE_RANK, in this script's process group. A signal to the job
# step (`scancel --signal=TERM`, srun forwarding one, Slurm's preemption) reaches every process of the step
# (proctrack/cgroup, proctrack/linuxproc) or this process group (proctrack/pgid): torchrun gets its SIGTERM from
# Slurm itself, so this script never sends it another (a second SIGTERM would cut torchrun's wait for the ranks
# short). torchrun passes SIGTERM on to the ranks and waits for them up to --shutdown-timeout; they finish their
# step, write a checkpoint together and exit with status 75 within train.preempt_grace_s.
# After such a stop this script exits 0 (torchrun itself exits 1 after a signal), so srun --kill-on-bad-exit
# does not cut short a peer that is still closing its checkpoint; otherwise it exits with torchrun's status.
# Node 0 (the batch script's node) records a stop in the file STOP_MARK, when set: the batch script requeues the
# job on it, whether the signal came from the time-limit notice, `scancel --signal=TERM` or preemption.
set -uo pipefail
export NODE_RANK=${SLURM_NODEID:-0}
prepare=$1
shift
if [ -n "$prepare" ]; then
  bash -c "$prepare" || exit $?
fi
"${TORCHRUN:-.venv/bin/torchrun}" --node_rank "$NODE_RANK" "$@" &
pid=$!
stopped=""
stop() {
  stopped=$1
  if [ -n "${STOP_MARK:-}" ] && [ "$NODE_RANK" = 0 ]; then echo "$1" > "$STOP_MARK"; fi  # the batch node
  echo "$(hostname): $1 received: the ranks checkpoint and stop (exit status 75 = restartable)" >&2
}
trap 'stop SIGTERM' TERM
trap 'stop SIGUSR1' USR1
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
