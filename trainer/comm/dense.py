"""`comm.kind: dense`: every bucket one allreduce, optionally on an fp16/bf16 wire (docs/communicators.md)."""

from __future__ import annotations

from torch import nn

from trainer.comm.config import CommConfig, Compression
from trainer.comm.execute import WIRE_DTYPES, PlanExecutor
from trainer.dist import Topology

__all__ = ["WIRE_DTYPES", "DenseAllreduce"]


class DenseAllreduce(PlanExecutor):
    """The fixed plan dense (or dense16 under `compression`): one async allreduce per bucket, started from the
    hook; the average comes back in the gradients' dtype. Its class name is recorded in checkpoints."""

    def __init__(self, model: nn.Module, topo: Topology, bucket_mb: float, compression: Compression = "none") -> None:
        super().__init__(CommConfig(bucket_mb=bucket_mb, compression=compression), model, topo,
                         "dense" if WIRE_DTYPES[compression] is None else "dense16")
