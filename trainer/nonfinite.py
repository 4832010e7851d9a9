"""Non-finite gradients without a loss scaler, found on the device: no host read in a training step.

Each step sums the gradients' norms on the device (inf and NaN survive the sum) and keeps two device tensors:
the count of non-finite steps so far and the first one's number. The optimizer gets `found_inf` (1.0 from the
first non-finite step on) and skips its update on the device, as torch's fused optimizers do under a
GradScaler, so the weights stay those before that step. The host reads the count only where it reads anyway
(log steps) and before a checkpoint, and stops the run there, naming the first step: no checkpoint is ever
written after a non-finite step.
"""

from __future__ import annotations

import torch
from torch import Tensor


def takes_found_inf(optimizer: torch.optim.Optimizer) -> bool:
    """Whether `optimizer.step` skips its update on the device when given a `found_inf` tensor: torch's fused
    optimizers, and optimizers that say so (`takes_found_inf = True`, as FusedLARS)."""
    return bool(getattr(optimizer, "takes_found_inf", False) or optimizer.defaults.get("fused"))


class NonfiniteSteps:
    """The device-side record of non-finite steps (see the module docstring)."""

    def __init__(self, device: torch.device) -> None:
        self.count = torch.zeros((), dtype=torch.float32, device=device)
        """Non-finite steps so far."""
        self.first = torch.full((), -1, dtype=torch.int64, device=device)
        """The first non-finite step's number (-1: none)."""

    def observe(self, grads: list[Tensor], step: int) -> Tensor:
        """Record whether step `step`'s gradients hold inf/NaN; returns `found_inf` for the optimizer: 1.0 (float32,
        0-d) when this step or an earlier one was non-finite."""
        if grads:
            total = torch.stack(torch._foreach_norm(grads)).sum()  # one foreach pass, not a sum per tensor
            bad = (~torch.isfinite(total)).to(torch.float32)
        else:
            bad = torch.zeros((), dtype=torch.float32, device=self.count.device)
        self.first = torch.where((self.count == 0) & (bad > 0), step, self.first)
        self.count += bad
        return (self.count > 0).to(torch.float32)

    def raise_if_any(self, step: int, where: str) -> None:
        """The host read: stop the run if any step so far was non-finite."""
        count = int(self.count)
        if count:
            raise FloatingPointError(
                f"non-finite gradients in {count} step(s), the first at step {int(self.first)}; found {where} at "
                f"step {step}: the optimizer skipped every update from that step on, so the parameters are those "
                "before it (BatchNorm's running statistics may have taken the bad forward; neither an evaluation "
                "nor a checkpoint saw them), and no checkpoint was written after it (train.loss_scale=dynamic "
                "would skip such steps and go on)")
