"""Adam/AdamW builder: torch's own optimizers with the fastest correct implementation per device."""

from __future__ import annotations

from typing import Any, Iterable, Literal

import torch
from torch import Tensor

# fused=True runs the whole update in one kernel per tensor group, on CPU as well as CUDA; on the CPU
# it is also faster than foreach=False and foreach=True (which allocates the intermediate lists), so
# fused is used on both; other devices keep torch's default.
FUSED_DEVICES = ("cpu", "cuda")
ADAM_CLASSES = {"adam": torch.optim.Adam, "adamw": torch.optim.AdamW}


def build_adam(params: Iterable[Tensor] | Iterable[dict[str, Any]],
               name: Literal["adam", "adamw"] = "adam", lr: float = 1e-3,
               betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
               weight_decay: float = 0.0) -> torch.optim.Optimizer:
    """torch.optim.Adam ("adam": L2 penalty in the gradient) or AdamW ("adamw": decoupled decay)."""
    if name not in ADAM_CLASSES:
        raise ValueError(f"build_adam: unknown name {name!r} (valid: {', '.join(ADAM_CLASSES)})")
    params = list(params)
    tensors = [t for item in params for t in (item["params"] if isinstance(item, dict) else [item])]
    devices = {t.device.type for t in tensors}
    fused = len(devices) == 1 and devices <= set(FUSED_DEVICES)
    return ADAM_CLASSES[name](params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                              fused=fused or None)
