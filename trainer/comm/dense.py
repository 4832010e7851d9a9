"""Dense bucketed allreduce, optionally compressed to fp16/bf16 on the wire."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from trainer.comm.base import Bucket, Communicator
from trainer.dist import Topology

_WIRE_DTYPES = {"none": None, "fp16": torch.float16, "bf16": torch.bfloat16}


class DenseAllreduce(Communicator):
    def __init__(self, model: nn.Module, topo: Topology, bucket_mb: float, timeout_s: float,
                 compression: str = "none") -> None:
        super().__init__(model, topo, bucket_mb, timeout_s)
        self.wire_dtype = _WIRE_DTYPES[compression]

    def launch(self, bucket: Bucket) -> None:
        flat = bucket.buffer if self.wire_dtype is None else bucket.buffer.to(self.wire_dtype)
        bucket.extra["wire"] = flat
        bucket.work = dist.all_reduce(flat, async_op=True)
        # A ring allreduce sends 2 (W-1)/W of the buffer per rank.
        w = self.topo.world_size
        self.step_stats["bytes_sent"] += 2 * (w - 1) / w * flat.numel() * flat.element_size()

    def complete(self, bucket: Bucket) -> torch.Tensor:
        self.wait(bucket.work, f"allreduce of gradient bucket {bucket.index} ({bucket.numel} elements)")
        wire = bucket.extra.pop("wire")
        return wire.to(bucket.buffer.dtype).div_(self.topo.world_size)
