"""Dense bucketed allreduce, optionally compressed to fp16/bf16 on the wire."""

from __future__ import annotations

import torch
from torch import nn

from trainer.comm.base import Bucket, BucketedCommunicator
from trainer.comm.config import Compression
from trainer.dist import Topology

WIRE_DTYPES: dict[Compression, torch.dtype | None] = {"none": None, "fp16": torch.float16, "bf16": torch.bfloat16}
"""`comm.compression` -> the dtype gradients travel in (None: their own)."""


def ring_allreduce_bytes(topo: Topology, nbytes: float) -> tuple[float, float]:
    """Bytes one rank sends in a ring allreduce of `nbytes`: all links, and its share of inter-node links.

    A ring sends 2 (W-1)/W of the buffer per rank; of the W hops of a node-major ring, N cross nodes.
    """
    w = topo.world_size
    sent = 2 * (w - 1) / w * nbytes
    return sent, (sent * topo.num_nodes / w if topo.num_nodes > 1 else 0.0)


class DenseAllreduce(BucketedCommunicator):
    """One async allreduce per bucket, in `compression`'s wire dtype; the average comes back in the gradients'."""

    def __init__(self, model: nn.Module, topo: Topology, bucket_mb: float, compression: Compression = "none") -> None:
        super().__init__(model, topo, bucket_mb)
        self.wire_dtype = WIRE_DTYPES[compression]

    def launch(self, bucket: Bucket) -> None:
        flat = bucket.buffer if self.wire_dtype is None else bucket.buffer.to(self.wire_dtype)
        bucket.wire = flat
        bucket.work = self.topo.world.all_reduce_async(flat)
        sent, inter = ring_allreduce_bytes(self.topo, flat.numel() * flat.element_size())
        self.count(sent=sent, inter_node=inter, sent_elements=flat.numel(), selected_from=flat.numel())

    def complete(self, bucket: Bucket) -> torch.Tensor:
        self.topo.world.wait(bucket.work, f"allreduce of gradient bucket {bucket.index} ({bucket.numel} elements)")
        wire, bucket.wire = bucket.wire, None
        return wire.to(bucket.buffer.dtype).div_(self.topo.world_size)
