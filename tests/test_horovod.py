"""The Horovod backend for real: `horovodrun --gloo` with 4 processes (2 nodes x 2), every communicator.

Skipped where Horovod is not installed (`make horovod` builds it; CI does).
"""

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.skipif(importlib.util.find_spec("horovod") is None, reason="Horovod not installed (run `make horovod`)")
def test_communicators_on_horovod_match_the_reference():
    horovodrun = Path(sys.executable).parent / "horovodrun"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([str(horovodrun), "--gloo", "-np", "4", "-H", "localhost:4", sys.executable,
                           str(ROOT / "tests" / "horovod_worker.py")], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for kind in ("dense", "topk", "hitopk"):
        assert sum(f": {kind} OK on horovod" in line for line in proc.stdout.splitlines()) == 4, proc.stdout[-2000:]
