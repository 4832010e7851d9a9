"""Gradient communicators, chosen by `comm.kind`; `build_communicator` returns one for a model."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Literal

from torch import nn

from trainer.comm.base import CommTimeoutError, Communicator, LocalCommunicator
from trainer.comm.dense import DenseAllreduce
from trainer.config import require
from trainer.dist import Topology

__all__ = ["CommConfig", "CommTimeoutError", "Communicator", "build_communicator"]


@dataclass
class CommConfig:
    kind: Literal["dense"] = "dense"
    """Gradient exchange: dense bucketed allreduce."""
    bucket_mb: float = 25.0
    """Gradient bucket size in MB of fp32 gradients; each bucket is launched as soon as it is ready."""
    compression: Literal["none", "fp16", "bf16"] = "none"
    """Wire dtype of the dense allreduce (the average is accumulated back in fp32)."""

    def __post_init__(self) -> None:
        require(self.bucket_mb > 0, f"comm.bucket_mb: must be > 0, got {self.bucket_mb}")


_KINDS: dict[str, Callable[[CommConfig, nn.Module, Topology, float], Communicator]] = {
    "dense": lambda cfg, model, topo, timeout_s: DenseAllreduce(model, topo, cfg.bucket_mb, timeout_s,
                                                                cfg.compression),
}


def build_communicator(cfg: CommConfig, model: nn.Module, topo: Topology, timeout_s: float) -> Communicator:
    """The communicator named by `cfg.kind`, hooked into `model`'s gradients; a no-op on one process."""
    if not topo.distributed:
        return LocalCommunicator(model, topo)
    return _KINDS[cfg.kind](cfg, model, topo, timeout_s)
