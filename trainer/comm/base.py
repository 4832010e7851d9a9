"""The communicator interface and gradient buckets, launched from autograd hooks.

Parameters are packed into buckets in reverse registration order (roughly the order backward produces
their gradients). When every gradient of a bucket has been accumulated, the bucket is launched as an
asynchronous collective — but only after all buckets before it, so every rank issues its collectives in
the same order (gloo and NCCL match collectives by order). `finish()` launches what is left, waits, and
writes the averaged gradients back before the optimizer step.
"""

from __future__ import annotations

import datetime
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from trainer.dist import Topology


class CommTimeoutError(RuntimeError):
    """A collective did not complete in time: a peer is hung, dead or unreachable."""


@dataclass
class Bucket:
    index: int
    params: list[nn.Parameter]
    numel: int
    ready: int = 0
    work: object | None = None
    """The pending collective (or a communicator-specific handle) once launched."""
    buffer: torch.Tensor | None = None
    extra: dict = field(default_factory=dict)


def make_buckets(params: list[nn.Parameter], bucket_mb: float) -> list[Bucket]:
    """Greedy packing of parameters, last-registered first, into buckets of at most `bucket_mb` (fp32 MB)."""
    limit = max(1, int(bucket_mb * 2**20 / 4))
    buckets: list[Bucket] = []
    current: list[nn.Parameter] = []
    size = 0
    for p in reversed(params):
        if current and size + p.numel() > limit:
            buckets.append(Bucket(len(buckets), current, size))
            current, size = [], 0
        current.append(p)
        size += p.numel()
    if current:
        buckets.append(Bucket(len(buckets), current, size))
    return buckets


class Communicator:
    """Averages gradients over ranks. Subclasses implement `launch(bucket)` and `complete(bucket)`."""

    def __init__(self, model: nn.Module, topo: Topology, bucket_mb: float, timeout_s: float) -> None:
        self.topo = topo
        self.timeout = datetime.timedelta(seconds=timeout_s)
        params = [p for p in model.parameters() if p.requires_grad]
        self.buckets = make_buckets(params, bucket_mb)
        self._bucket_of = {id(p): b for b in self.buckets for p in b.params}
        self._next = 0
        self.step_stats = {"bytes_sent": 0.0, "wait_s": 0.0}
        for p in params:
            p.register_post_accumulate_grad_hook(self._on_grad_ready)

    # ------------------------------------------------------------ hooks and ordering

    def _on_grad_ready(self, p: nn.Parameter) -> None:
        bucket = self._bucket_of[id(p)]
        bucket.ready += 1
        while self._next < len(self.buckets) and self.buckets[self._next].ready == len(self.buckets[self._next].params):
            self._launch_next()

    def _launch_next(self) -> None:
        bucket = self.buckets[self._next]
        self._next += 1
        bucket.buffer = torch.cat([p.grad.reshape(-1) if p.grad is not None else p.new_zeros(p.numel())
                                   for p in bucket.params])
        self.launch(bucket)

    def finish(self) -> dict[str, float]:
        """Launch any bucket not yet launched (unused parameters count as zero), wait for all, write back.

        Returns this step's stats: bytes sent by this rank and seconds spent waiting (not hidden by backward).
        """
        while self._next < len(self.buckets):
            self._launch_next()
        start = time.perf_counter()
        for bucket in self.buckets:
            averaged = self.complete(bucket)
            offset = 0
            for p in bucket.params:
                chunk = averaged[offset:offset + p.numel()].view_as(p)
                if p.grad is None:
                    p.grad = chunk.clone()
                else:
                    p.grad.copy_(chunk)
                offset += p.numel()
            bucket.ready, bucket.work, bucket.buffer = 0, None, None
        self._next = 0
        self.step_stats["wait_s"] = time.perf_counter() - start
        stats, self.step_stats = self.step_stats, {"bytes_sent": 0.0, "wait_s": 0.0}
        return stats

    def wait(self, work: dist.Work, what: str) -> None:
        """Wait for `work`, turning a timeout or a dead peer into an error that names this rank and the op."""
        try:
            work.wait(self.timeout)
        except RuntimeError as e:
            raise CommTimeoutError(
                f"rank {self.topo.rank}: {what} did not complete within {self.timeout.total_seconds():.0f}s "
                f"(dist.timeout_s); a peer is hung, dead or unreachable: {e}") from e

    # ------------------------------------------------------------ to implement

    def launch(self, bucket: Bucket) -> None:
        raise NotImplementedError

    def complete(self, bucket: Bucket) -> torch.Tensor:
        """Wait for the bucket's collectives and return its averaged flat gradient."""
        raise NotImplementedError

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


class LocalCommunicator(Communicator):
    """One process: nothing to exchange (the null object, so the train step has no special case)."""

    def __init__(self, model: nn.Module, topo: Topology) -> None:  # noqa: D107 - no hooks needed
        self.topo = topo

    def finish(self) -> dict[str, float]:
        return {"bytes_sent": 0.0, "wait_s": 0.0}
