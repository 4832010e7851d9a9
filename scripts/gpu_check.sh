#!/usr/bin/env bash
# The GPU check (scripts/gpu_check.py); the interpreter is $PYTHON (default python3), e.g. the GPU machine's own
# Python. Arguments go to gpu_check.py. The repository goes on PYTHONPATH because that Python has no install of it
# (nothing can be installed there) and the check's subprocesses import the packages too.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" exec "${PYTHON:-python3}" -m scripts.gpu_check "$@"
