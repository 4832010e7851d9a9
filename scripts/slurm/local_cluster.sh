#!/usr/bin/env bash
# A real single-node Slurm cluster on this machine, to try the sbatch scripts on (root; tests/slurm_cluster.py):
#   scripts/slurm/local_cluster.sh up [DIR]     installs slurmctld, slurmd and munge with apt-get if missing, starts
#                                               munged, slurmctld and slurmd with their own key, ports and config
#                                               in DIR (default /tmp/dawnbench-slurm), waits until the node is idle
#                                               and prints the `export SLURM_CONF=...` for sbatch, squeue, scancel
#   scripts/slurm/local_cluster.sh down [DIR]   cancels its jobs, stops the daemons and removes DIR
# The node is this machine (its hostname and cores), without cgroups; a Slurm or munge already running here is
# left alone. `make slurm-up` / `make slurm-down` run it.
set -euo pipefail
cd "$(dirname "$0")/../.."
case "${1:-}" in
  up|down) exec "${PYTHON:-.venv/bin/python}" -m tests.slurm_cluster "$@" ;;
  *) echo "usage: $0 up|down [DIR]" >&2; exit 2 ;;
esac
