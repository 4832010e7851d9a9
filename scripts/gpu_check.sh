#!/usr/bin/env bash
# The GPU check (scripts/gpu_check.py). The interpreter is $PYTHON, by default the repository's .venv where it
# exists, else python3 (e.g. the GPU machine's own Python). Arguments go to gpu_check.py. The repository goes
# on PYTHONPATH because such a Python has no install of it (nothing can be installed there) and the check's
# subprocesses import the packages too.
set -euo pipefail
cd "$(dirname "$0")/.."
DEFAULT_PYTHON=python3
if [ -x .venv/bin/python ]; then DEFAULT_PYTHON=.venv/bin/python; fi
PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" exec "${PYTHON:-$DEFAULT_PYTHON}" -m scripts.gpu_check "$@"
