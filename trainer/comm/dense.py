"""Dense bucketed allreduce, optionally compressed to fp16/bf16 on the wire."""

from __future__ import annotations

import torch
from torch import nn

from trainer.comm.base import Bucket, BucketedCommunicator
from trainer.comm.config import Compression
from trainer.comm.cost import Choice, Collective, describe, exchange_bytes, layout_of, sent_bytes
from trainer.dist import Topology

WIRE_DTYPES: dict[Compression, torch.dtype | None] = {"none": None, "fp16": torch.float16, "bf16": torch.bfloat16}
"""`comm.compression` -> the dtype gradients travel in (None: their own)."""


def ring_allreduce_bytes(topo: Topology, nbytes: float) -> tuple[float, float]:
    """Bytes one rank sends in a ring allreduce of `nbytes` over all ranks: all links, and its share of
    inter-node links (the cost model's count, `trainer.comm.cost.sent_bytes`)."""
    return sent_bytes(Collective("allreduce", nbytes, "world"), layout_of(topo))


class DenseAllreduce(BucketedCommunicator):
    """One async allreduce per bucket, in `compression`'s wire dtype; the average comes back in the gradients'."""

    def __init__(self, model: nn.Module, topo: Topology, bucket_mb: float, compression: Compression = "none") -> None:
        super().__init__(model, topo, bucket_mb)
        self.wire_dtype = WIRE_DTYPES[compression]

    def launch(self, bucket: Bucket) -> None:
        flat = bucket.buffer if self.wire_dtype is None else bucket.buffer.to(self.wire_dtype)
        bucket.wire = flat
        bucket.work = self.topo.world.all_reduce_async(flat)
        choice = Choice("dense" if self.wire_dtype is None else "dense16")
        sent, inter = exchange_bytes(describe(bucket.numel, choice, layout_of(self.topo)), layout_of(self.topo))
        self.count(sent=sent, inter_node=inter, sent_elements=flat.numel(), selected_from=flat.numel())

    def complete(self, bucket: Bucket) -> torch.Tensor:
        self.topo.world.wait(bucket.work, f"allreduce of gradient bucket {bucket.index} ({bucket.numel} elements)")
        wire, bucket.wire = bucket.wire, None
        return wire.to(bucket.buffer.dtype).div_(self.topo.world_size)
