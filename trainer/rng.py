"""Seeding and the state of this process's random generators (Python, NumPy, torch, CUDA).

A checkpoint carries one `rng_state` per rank, so a resumed run draws the same dropout masks and
augmentations as an uninterrupted one.
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


def rng_state(device: torch.device) -> dict[str, Any]:
    """This process's random generators (one entry per rank in a checkpoint)."""
    state = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state: dict[str, Any], device: torch.device) -> None:
    """Restore what `rng_state` returned (the CUDA generator only on a CUDA device)."""
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])
    if "cuda" in state and device.type == "cuda":
        torch.cuda.set_rng_state(state["cuda"], device)
