#!/usr/bin/env bash
# The GPU check (scripts/gpu_check.py) with the repository on PYTHONPATH; the interpreter is $PYTHON
# (default python3), e.g. the GPU machine's own Python. Arguments go to gpu_check.py.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" exec "${PYTHON:-python3}" -m scripts.gpu_check "$@"
