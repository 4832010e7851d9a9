"""Inputs for checking the kernels, shared by tests, benchmarks and the GPU check (the package itself does
not import this module)."""

from __future__ import annotations

from typing import Sequence

import torch


def gradient_like(shape: int | Sequence[int], seed: int = 0, device: torch.device | str = "cpu"
                  ) -> torch.Tensor:
    """float32 values heavy-tailed like real gradients: a standard normal times a log-normal (exp of a
    standard normal). Drawn on the CPU from `seed` and then moved to `device`, so every device gets the
    same values."""
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=gen) * torch.randn(shape, generator=gen).exp()).to(device)
