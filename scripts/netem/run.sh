#!/usr/bin/env bash
# Launch one multi-node torchrun job on the emulated cluster of scripts/netem/cluster.sh: one torchrun per
# namespace ("node"), static rendezvous on node 0's address, NPROC ranks in each, gloo bound to the
# node's shaped interface (GLOO_SOCKET_IFNAME), so traffic between nodes crosses the shaped links and
# traffic inside a node stays on its loopback.
#
#   scripts/netem/run.sh [--nproc-per-node P] [--port PORT] [--threads T] -m recipes.resnet50 --config C [k=v ...]
#   scripts/netem/run.sh --nproc-per-node 2 scripts/bench/some_script.py --flag
#
# Every node present (cluster.sh up N RATE) runs one torchrun. Node 0's output passes through unchanged;
# the other nodes' lines are prefixed "[node i]". If any node fails, the others are stopped and the exit
# status is the failing node's. Environment: PY (default .venv/bin/python), NETEM_PREFIX and NETEM_SUBNET
# as for cluster.sh. Ranks get OMP_NUM_THREADS=T (default 1: emulated nodes share this machine's cores).
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/../.." && pwd)
CLUSTER="$ROOT/scripts/netem/cluster.sh"
PREFIX=${NETEM_PREFIX:-dawn}
PY=${PY:-$ROOT/.venv/bin/python}
NPROC=1
PORT=29500
THREADS=1

die() { echo "run.sh: $*" >&2; exit 1; }

while (( $# )); do
  case $1 in
    --nproc-per-node|--nproc_per_node) NPROC=${2:?}; shift 2 ;;
    --port) PORT=${2:?}; shift 2 ;;
    --threads) THREADS=${2:?}; shift 2 ;;
    -h|--help) sed -n '2,15p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) break ;;
  esac
done
(( $# )) || die "nothing to run: give -m MODULE [args] or SCRIPT.py [args] (see --help)"
[[ $NPROC =~ ^[1-9][0-9]*$ ]] || die "--nproc-per-node must be a positive integer, got '$NPROC'"
[[ $THREADS =~ ^[1-9][0-9]*$ ]] || die "--threads must be a positive integer, got '$THREADS'"
[[ $(id -u) -eq 0 ]] || die "must run as root (ip netns exec needs CAP_SYS_ADMIN)"
[[ -x $PY ]] || die "python not found at $PY (make setup, or set PY=...)"

mapfile -t NODES < <(ip netns list 2>/dev/null | awk '{print $1}' | sed -n "s/^${PREFIX}-n\([0-9]\{1,\}\)\$/\1/p" | sort -n)
(( ${#NODES[@]} )) || die "no emulated nodes (prefix $PREFIX): run scripts/netem/cluster.sh up N RATE first"
NNODES=${#NODES[@]}
[[ ${NODES[*]} == "$(seq -s ' ' 0 $(( NNODES - 1 )))" ]] || die "nodes are not numbered 0..$(( NNODES - 1 )): ${NODES[*]} (run cluster.sh up again)"
MASTER=$("$CLUSTER" addr 0)

PGIDS=()
cleanup() {
  local g
  for g in "${PGIDS[@]}"; do kill -TERM -- "-$g" 2>/dev/null || true; done
}
trap 'cleanup; exit 130' INT TERM

cd "$ROOT"
declare -A NODE_OF
for i in "${NODES[@]}"; do
  # setsid: each node's torchrun and its ranks form one process group, stopped together on failure
  if (( i == 0 )); then
    setsid ip netns exec "$PREFIX-n$i" env GLOO_SOCKET_IFNAME="$PREFIX-v$i" OMP_NUM_THREADS="$THREADS" \
      PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 \
      "$PY" -m torch.distributed.run --nnodes "$NNODES" --node_rank "$i" --nproc_per_node "$NPROC" \
      --master_addr "$MASTER" --master_port "$PORT" --max_restarts 0 "$@" &
  else
    setsid bash -c 'set -o pipefail; "$@" 2>&1 | sed -u "s/^/[node '"$i"'] /"' _ \
      ip netns exec "$PREFIX-n$i" env GLOO_SOCKET_IFNAME="$PREFIX-v$i" OMP_NUM_THREADS="$THREADS" \
      PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 \
      "$PY" -m torch.distributed.run --nnodes "$NNODES" --node_rank "$i" --nproc_per_node "$NPROC" \
      --master_addr "$MASTER" --master_port "$PORT" --max_restarts 0 "$@" &
  fi
  PGIDS+=("$!")
  NODE_OF[$!]=$i
done

status=0
running=("${PGIDS[@]}")
while (( ${#running[@]} )); do
  set +e
  wait -n -p done_pid "${running[@]}"
  rc=$?
  set -e
  still=()
  for p in "${running[@]}"; do [[ $p == "$done_pid" ]] || still+=("$p"); done
  running=("${still[@]}")
  if (( rc != 0 && status == 0 )); then
    status=$rc
    echo "run.sh: node ${NODE_OF[$done_pid]:-?} exited with status $rc; stopping the other nodes" >&2
    cleanup
  fi
done
exit "$status"
