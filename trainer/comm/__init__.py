"""Gradient communicators, chosen by `comm.kind`; `build_communicator` returns one for a model."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Literal

from torch import nn

from trainer.comm.base import CommTimeoutError, Communicator, LocalCommunicator
from trainer.comm.dense import DenseAllreduce
from trainer.comm.sparse import SparseAllgather
from trainer.config import require
from trainer.dist import Topology

__all__ = ["CommConfig", "CommTimeoutError", "Communicator", "build_communicator"]


@dataclass
class CommConfig:
    kind: Literal["dense", "topk", "hitopk"] = "dense"
    """Gradient exchange: dense = bucketed allreduce; topk = every rank's top-k with error feedback,
    allgathered; hitopk = the paper's hierarchical top-k (dense inside a node, sparse between nodes)."""
    bucket_mb: float = 25.0
    """Gradient bucket size in MB of fp32 gradients; each bucket is launched as soon as it is ready."""
    compression: Literal["none", "fp16", "bf16"] = "none"
    """Wire dtype of the dense allreduce (kind dense only; the average is accumulated back in fp32)."""
    density: float = 0.01
    """topk/hitopk: fraction of each bucket (of each rank's 1/L shard for hitopk) sent per step."""
    dense_below: int = 16384
    """topk/hitopk: buckets with fewer elements go through a dense allreduce."""
    dense_warmup_steps: int = 0
    """topk/hitopk: the first steps use a dense allreduce for every bucket (stable start)."""
    selection_iters: int = 20
    """topk/hitopk: MSTopK bisection steps (more = closer to the exact top-k, same cost on the CPU path)."""

    def __post_init__(self) -> None:
        require(self.bucket_mb > 0, f"comm.bucket_mb: must be > 0, got {self.bucket_mb}")
        require(0 < self.density <= 1, f"comm.density: must be in (0, 1], got {self.density}")
        require(self.dense_below >= 0, f"comm.dense_below: must be >= 0, got {self.dense_below}")
        require(self.dense_warmup_steps >= 0,
                f"comm.dense_warmup_steps: must be >= 0, got {self.dense_warmup_steps}")
        require(1 <= self.selection_iters <= 32, f"comm.selection_iters: must be in [1, 32], got {self.selection_iters}")


def _sparse(cfg: CommConfig, model: nn.Module, topo: Topology, hierarchical: bool) -> SparseAllgather:
    intra, inter = (topo.intra_node, topo.inter_node) if hierarchical else (None, topo.world)
    return SparseAllgather(model, topo, cfg.bucket_mb, cfg.density, cfg.dense_below, cfg.dense_warmup_steps,
                           intra, inter, cfg.selection_iters)


_KINDS: dict[str, Callable[[CommConfig, nn.Module, Topology], Communicator]] = {
    "dense": lambda cfg, model, topo: DenseAllreduce(model, topo, cfg.bucket_mb, cfg.compression),
    "topk": lambda cfg, model, topo: _sparse(cfg, model, topo, hierarchical=False),
    "hitopk": lambda cfg, model, topo: _sparse(cfg, model, topo, hierarchical=True),
}


def build_communicator(cfg: CommConfig, model: nn.Module, topo: Topology) -> Communicator:
    """The communicator named by `cfg.kind`, hooked into `model`'s gradients; a no-op on one process."""
    if not topo.distributed:
        return LocalCommunicator(model, topo)
    return _KINDS[cfg.kind](cfg, model, topo)
