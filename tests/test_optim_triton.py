"""The Triton LARS and Adam kernels (kernels/optim_triton.py), run on CPU tensors in Triton's interpreter.

One interpreter process (tests/optim_triton_worker.py) runs every check; each test here asserts one check's
result, so a failure names what broke. What they would catch: a norm, ratio or bias correction computed in
another precision or order than the reference's beyond rtol 1e-6 (a float32 1 - beta2, a ratio without the
trust clip); a found_inf that skips the weights but not the momentum or the step count; a pointer table read
at the wrong offset (tensors of several blocks, an empty tensor, a channels_last weight); a launch or a torch
op per tensor (the counts for 10 and 80 tensors differ).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.conftest import ROOT

pytestmark = pytest.mark.long  # one interpreter process of about 20 s

CHECKS = ["lars_matches_reference_in_every_configuration", "lars_matches_reference_with_the_real_block_size",
          "adam_matches_torch", "options_given_as_tensors_are_read_on_the_device",
          "adam_state_dict_is_torch_fused_adams", "adam_honours_grad_scale",
          "found_inf_leaves_everything_as_it_was", "launches_do_not_grow_with_the_number_of_tensors"]


@pytest.fixture(scope="module")
def results() -> dict[str, str]:
    pytest.importorskip("triton", reason="Triton is not installed")
    proc = subprocess.run([sys.executable, "-m", "tests.optim_triton_worker"], cwd=ROOT, capture_output=True,
                          text=True, timeout=600, env={**os.environ, "TRITON_INTERPRET": "1"})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_the_worker_runs_exactly_these_checks(results: dict[str, str]) -> None:
    assert sorted(results) == sorted(CHECKS)


@pytest.mark.parametrize("check", CHECKS)
def test_triton_optimizer_check(results: dict[str, str], check: str) -> None:
    assert results.get(check) == "ok", results.get(check, "not run")


@pytest.mark.e2e
def test_cpu_steps_never_import_triton() -> None:
    """FusedLARS and build_adam's Adam on CPU tensors, outside the interpreter, do not import the Triton
    kernels (a CPU-only install need not have Triton)."""
    script = ("import sys, torch\n"
              "from kernels import FusedLARS, build_adam\n"
              "w = [torch.nn.Parameter(torch.randn(4, 3)), torch.nn.Parameter(torch.randn(3).double())]\n"
              "for opt in (FusedLARS(w, lr=0.1), build_adam(w[:1])):\n"
              "    for p in w: p.grad = torch.ones_like(p)\n"
              "    opt.step()\n"
              "print('kernels.optim_triton' in sys.modules, type(build_adam(w[:1])).__name__)\n")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env=env)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["False", "Adam"]
