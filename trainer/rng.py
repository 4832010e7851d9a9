"""Seeding and the state of this process's random generators (Python, NumPy, torch, CUDA).

A checkpoint carries each rank's `rng_state` in that rank's own file, so a resumed run draws the same dropout
masks and augmentations as an uninterrupted one. The state is made of plain types and tensors only, so the
file opens with torch.load(weights_only=True). A rank that has no state in the checkpoint (the world grew)
gets generators derived from the seed, its rank and the step (`seed_rank`).
"""

from __future__ import annotations

import os
import random
from typing import Any

import numpy as np
import torch


def seed_everything(seed: int, deterministic: bool = False) -> None:
    """Seed Python, NumPy and torch; `deterministic` also forbids nondeterministic kernels."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
    if deterministic:
        # cuBLAS needs a fixed workspace for reproducible GEMMs (read when its handle is created):
        # https://docs.nvidia.com/cuda/cublas/#results-reproducibility
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
        torch.backends.cudnn.benchmark = False


def seed_rank(seed: int, rank: int, step: int) -> None:
    """Generators of their own for `rank` resuming at `step` without a saved state, derived from the seed (a
    different stream per rank and per step, the same on every restart)."""
    derived = int(np.random.SeedSequence([seed, rank, step]).generate_state(1, np.uint64)[0]) >> 1
    random.seed(derived)
    np.random.seed(derived % 2**32)
    torch.manual_seed(derived)


def rng_state(device: torch.device) -> dict[str, Any]:
    """This process's random generators, as plain types and tensors (one rank's entry in a checkpoint)."""
    numpy = np.random.get_state(legacy=False)
    state = {"torch": torch.get_rng_state(),
             "numpy": {"bit_generator": numpy["bit_generator"], "key": torch.from_numpy(numpy["state"]["key"].astype(np.int64)),
                       "pos": int(numpy["state"]["pos"]), "has_gauss": int(numpy["has_gauss"]),
                       "gauss": float(numpy["gauss"])},
             "python": random.getstate()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state: dict[str, Any], device: torch.device) -> None:
    """Restore what `rng_state` returned (the CUDA generator only on a CUDA device)."""
    torch.set_rng_state(state["torch"])
    numpy = state["numpy"]
    np.random.set_state({"bit_generator": numpy["bit_generator"],
                         "state": {"key": numpy["key"].numpy().astype(np.uint32), "pos": numpy["pos"]},
                         "has_gauss": numpy["has_gauss"], "gauss": numpy["gauss"]})
    random.setstate(state["python"])
    if "cuda" in state and device.type == "cuda":
        torch.cuda.set_rng_state(state["cuda"], device)
