"""Triton kernels, imported on first use only: the CPU paths never import Triton."""

from __future__ import annotations

import functools
import os
import warnings
from types import ModuleType

import torch


def runs_on(device: torch.device) -> bool:
    """Whether Triton kernels can take tensors on `device`: CUDA, or any device in Triton's interpreter
    (TRITON_INTERPRET=1, read when Triton is first imported)."""
    return device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"


@functools.cache
def optim_kernels() -> ModuleType | None:
    """kernels.optim_triton, or None (after one warning) where Triton cannot be imported."""
    try:
        from kernels import optim_triton
    except ImportError as err:
        warnings.warn(f"Triton unavailable ({err}): FusedLARS and Adam use torch's multi-tensor kernels on CUDA",
                      RuntimeWarning, stacklevel=2)
        return None
    return optim_triton
