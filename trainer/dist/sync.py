"""Keeping the ranks in step: a few numbers summed, rank 0's decisions and weights on every rank, and the
guard that stops a run whose model replicas drifted apart. On one process (a LocalGroup world) each is a
no-op by construction."""

from __future__ import annotations

from collections import Counter

import torch
from torch import nn

from trainer.dist.topology import Topology


class ReplicaDivergenceError(RuntimeError):
    """The ranks' copies of the weights are no longer bitwise equal."""


def all_reduce_sum(values: list[float] | torch.Tensor, topo: Topology) -> list[float]:
    """Sum a few numbers over all ranks (eval counts, loss sums): Python numbers, or a 1-D tensor of them
    accumulated on the device (float64 on every backend), read back once, after the reduction."""
    t = (values.to(device=topo.device, dtype=torch.float64) if isinstance(values, torch.Tensor)
         else torch.tensor(values, dtype=torch.float64, device=topo.device))
    return topo.world.all_reduce_(t, "all_reduce_sum").tolist()


def broadcast_flag(flag: bool, topo: Topology) -> bool:
    """Rank 0's decision, on every rank (e.g. 'target reached, stop'), so that all ranks leave together."""
    t = torch.tensor([flag], dtype=torch.uint8, device=topo.device)  # uint8: every backend broadcasts it
    topo.world.broadcast_(t, src=0)
    return bool(t.item())


def broadcast_module(module: nn.Module, topo: Topology, buffers_only: bool = False) -> None:
    """Rank 0's weights (or only its buffers, e.g. BatchNorm statistics) on every rank."""
    tensors = list(module.buffers()) + ([] if buffers_only else list(module.parameters()))
    with torch.no_grad():
        for t in tensors:
            topo.world.broadcast_(t.data, src=0)


_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
"""The integer dtype of each element size in bytes, to read a tensor's bit patterns."""


def weights_checksum(module: nn.Module) -> torch.Tensor:
    """A 0-d int64 tensor on the weights' device: the parameters' bit patterns summed as integers, each tensor
    weighted by its position. Equal weights give equal sums; one changed bit changes the sum. No host sync."""
    total = None
    for position, p in enumerate(module.parameters(), start=1):
        bits = p.detach().view(_BITS[p.element_size()]).sum(dtype=torch.int64) * position
        total = bits if total is None else total + bits
    return total if total is not None else torch.zeros((), dtype=torch.int64)


class ReplicaGuard:
    """Every `every` steps, all-gathers each rank's `weights_checksum` and stops the run if they differ.

    Nothing re-synchronises the replicas after the first broadcast, so an update that differs by one bit on
    one rank (a nondeterministic reduction, a bad GPU) would otherwise go on forever; evaluation and
    checkpoints assume every rank holds rank 0's weights. A single process has no replicas: the guard is off.
    """

    def __init__(self, every: int, topo: Topology) -> None:
        self.every = every if topo.distributed else 0
        self.topo = topo
        self.last_equal: int | None = None
        """The step of the last check that found the replicas equal."""

    def should_check(self, step: int) -> bool:
        return self.every > 0 and step % self.every == 0

    def maybe_check(self, module: nn.Module, step: int) -> None:
        """`check` when `step` is due."""
        if self.should_check(step):
            self.check(module, step)

    def check(self, module: nn.Module, step: int) -> None:
        """Collective (when the guard is on): stop every rank if the replicas differ, naming the ranks whose
        checksum differs from the most common one (rank 0 may be the odd one out)."""
        if self.every <= 0:
            return
        sums = self.topo.world.all_gather(weights_checksum(module).reshape(1).to(self.topo.device),
                                          "all-gather of the weight checksums").tolist()
        if len(set(sums)) > 1:
            majority = Counter(sums).most_common(1)[0][0]
            diverged = [r for r, value in enumerate(sums) if value != majority]
            since = f"equal at the previous check, step {self.last_equal}" if self.last_equal is not None else \
                "never checked equal before"
            raise ReplicaDivergenceError(
                f"step {step}: the model replicas differ: rank {diverged[0]}'s weights are not bitwise equal to the "
                f"other ranks' (diverged ranks: {diverged}; {since}); every rank stops (dist.check_every_steps)")
        self.last_equal = step
