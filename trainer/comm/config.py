"""The `comm` section: which gradient exchange, its bucket size, wire dtype and top-k settings."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from trainer.config import require

CommKind = Literal["dense", "topk", "hitopk"]
"""The values of `comm.kind`."""
Compression = Literal["none", "fp16", "bf16"]
"""The values of `comm.compression`."""


@dataclass
class CommConfig:
    kind: CommKind = "dense"
    """Gradient exchange: dense = bucketed allreduce; topk = every rank's top-k with error feedback,
    allgathered; hitopk = the paper's hierarchical top-k (dense inside a node, sparse between nodes)."""
    bucket_mb: float = 25.0
    """Gradient bucket size in MB of fp32 gradients; each bucket is launched as soon as it is ready."""
    compression: Compression = "none"
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
        require(1 <= self.selection_iters <= 32,
                f"comm.selection_iters: must be in [1, 32], got {self.selection_iters}")
