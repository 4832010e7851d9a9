"""The communicator interface, its one-process null object, and gradient buckets launched from autograd hooks.

Parameters are packed into buckets in reverse registration order (roughly the order backward produces
their gradients). When every gradient of a bucket has been accumulated, the bucket is launched — but only
after all buckets before it, so every rank issues its collectives in the same order (gloo and NCCL match
collectives by order). `finish()` launches what is left, waits, and writes the averaged gradients back
before the optimizer step.

Two ways to launch:
- a single async collective per bucket (`DenseAllreduce`): `launch` starts it, `complete` waits;
- a chain of collectives whose later stages need the results of earlier ones (top-k: select, then
  allgather; hierarchical: reduce-scatter, select, allgather, allgather). `ExchangeCommunicator` runs each
  bucket's chain on one background thread, buckets in launch order — Horovod's background-thread design.
  The thread issues every collective in the same order on every rank, and the chain of one bucket
  overlaps the backward pass of the next ones (collectives and the C selection kernel release the GIL).
  A DDP comm hook would give the same overlap for one-collective schemes but not a fixed order across
  several process groups, nor per-bucket residual state we control.
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch
from torch import nn

from trainer.dist import CommTimeoutError, Topology

__all__ = ["Bucket", "BucketedCommunicator", "CommTimeoutError", "Communicator", "ExchangeCommunicator",
           "LocalCommunicator", "bind_thread_to_device", "make_buckets"]


@dataclass
class Bucket:
    index: int
    params: list[nn.Parameter]
    numel: int
    ready: int = 0
    work: object | None = None
    """The pending collective (or a Future of the exchange thread) once launched."""
    wire: torch.Tensor | None = None
    """While a dense exchange is in flight: the tensor on the wire (the buffer, or its fp16/bf16 copy)."""
    buffer: torch.Tensor | None = None
    """The bucket's flat gradient, allocated at its first launch and refilled every step: on the CPU a fresh
    25 MB tensor per step pays its page faults again, which costs more than a copy into a warm one."""


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


def _zero_stats() -> dict[str, float]:
    return {"bytes_sent": 0.0, "bytes_inter_node": 0.0, "wait_s": 0.0, "select_s": 0.0,
            "sent_elements": 0.0, "selected_from": 0.0}


class Communicator:
    """Averages gradients over ranks: what the train loop calls.

    `finish()` returns the step's stats: bytes this rank sent (all links, and inter-node only), seconds the
    optimizer waited for communication after backward (the part not hidden), seconds spent in top-k
    selection, and the achieved density (elements sent / elements they were selected from).
    """

    def __init__(self, topo: Topology) -> None:
        self.topo = topo
        self.steps = 0
        """Completed exchanges (checkpointed: dense warm-up counts them)."""

    def attach(self) -> None:
        """Hook into the parameters' gradients (done at construction)."""

    def detach(self) -> None:
        """Remove the gradient hooks: backward no longer launches this communicator's exchanges, and the
        hooks no longer keep it (and its buffers and residuals) alive. `attach()` hooks it in again."""

    def set_grad_scale(self, scale: torch.Tensor | None) -> None:
        """The loss scale of the coming backward (error feedback keeps its residuals unscaled); None = 1."""

    def rollback(self) -> None:
        """Undo this step's effect on the communicator's state (the optimizer skipped the step). Call after
        `finish()`, before the next backward. Stateless exchanges have nothing to undo."""

    def finish(self) -> dict[str, float]:
        """Complete this step's exchange and write the averaged gradients back; this step's stats."""
        raise NotImplementedError

    def pop_records(self) -> dict[str, float]:
        """Values to log once rather than every step (a calibration), cleared by the call."""
        return {}

    def selection_candidates(self) -> list[str]:
        """`comm.selection`'s values to measure on this run (trainer/choices.py); a single value when pinned or
        when nothing is selected."""
        return []

    def selection_sizes(self) -> dict[tuple[int, float], int]:
        """(elements, density) of the top-k selections a step may make -> how many per step."""
        return {}

    def use_selection(self, selection: str) -> None:
        """Select top-k pairs by `selection` from now on."""

    # ------------------------------------------------------------ state (error feedback lives here)

    def state_dict(self) -> dict:
        """This rank's state."""
        return {"steps": self.steps}

    def load_state_dict(self, state: dict) -> None:
        self.steps = state["steps"]


class LocalCommunicator(Communicator):
    """One process: nothing to exchange (the null object, so the train step has no special case)."""

    def finish(self) -> dict[str, float]:
        self.steps += 1
        return {"bytes_sent": 0.0, "bytes_inter_node": 0.0, "wait_s": 0.0, "select_s": 0.0, "density": 1.0}


class BucketedCommunicator(Communicator):
    """Packs the gradients into buckets and launches each from the autograd hooks, in order. Subclasses
    implement `launch(bucket)` and `complete(bucket)`."""

    def __init__(self, model: nn.Module, topo: Topology, bucket_mb: float) -> None:
        super().__init__(topo)
        params = [p for p in model.parameters() if p.requires_grad]
        self.buckets = make_buckets(params, bucket_mb)
        self._bucket_of = {id(p): b for b in self.buckets for p in b.params}
        self._next = 0
        self.stats = _zero_stats()
        self.grad_scale: torch.Tensor | None = None
        """The loss scale this step's gradients are multiplied by (a 0-d tensor on the device), or None."""
        self._params = params
        self._hooks: list = []
        self.attach()

    def attach(self) -> None:
        if not self._hooks:
            self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad_ready) for p in self._params]

    def detach(self) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks = []

    # ------------------------------------------------------------ hooks and ordering

    def _on_grad_ready(self, p: nn.Parameter) -> None:
        bucket = self._bucket_of[id(p)]
        bucket.ready += 1
        while self._next < len(self.buckets) and self.buckets[self._next].ready == len(self.buckets[self._next].params):
            self._launch_next()

    def set_grad_scale(self, scale: torch.Tensor | None) -> None:
        self.grad_scale = scale

    def begin_step(self) -> None:
        """Called as the step's first bucket launches (the previous step is complete)."""

    def _launch_next(self) -> None:
        if self._next == 0:
            self.begin_step()
        bucket = self.buckets[self._next]
        self._next += 1
        if bucket.buffer is None:
            first = bucket.params[0]
            bucket.buffer = torch.empty(bucket.numel, dtype=first.dtype, device=first.device)
        torch.cat([p.grad.reshape(-1) if p.grad is not None else p.new_zeros(p.numel()) for p in bucket.params],
                  out=bucket.buffer)
        self.launch(bucket)

    def finish(self) -> dict[str, float]:
        """Launch any bucket not yet launched (unused parameters count as zero), wait for all, write back.

        Returns this step's stats (see `Communicator`), then starts counting the next step's.
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
            bucket.ready, bucket.work = 0, None
        self._next = 0
        self.steps += 1
        stats, self.stats = self.stats, _zero_stats()
        stats["wait_s"] = time.perf_counter() - start
        sent, selected_from = stats.pop("sent_elements"), stats.pop("selected_from")
        stats["density"] = sent / selected_from if selected_from else 1.0
        return stats

    def count(self, sent: float = 0.0, inter_node: float = 0.0, select_s: float = 0.0, sent_elements: float = 0.0,
              selected_from: float = 0.0) -> None:
        """Add to this step's stats (called from the exchange thread too: each key has one writer at a time)."""
        s = self.stats
        s["bytes_sent"] += sent
        s["bytes_inter_node"] += inter_node
        s["select_s"] += select_s
        s["sent_elements"] += sent_elements
        s["selected_from"] += selected_from

    # ------------------------------------------------------------ to implement

    def launch(self, bucket: Bucket) -> None:
        raise NotImplementedError

    def complete(self, bucket: Bucket) -> torch.Tensor:
        """Wait for the bucket's collectives and return its averaged flat gradient."""
        raise NotImplementedError


def bind_thread_to_device(device: torch.device) -> None:
    """Make `device` the calling thread's current CUDA device (CUDA's current device is per thread)."""
    if device.type == "cuda":
        torch.cuda.set_device(device)


class ExchangeCommunicator(BucketedCommunicator):
    """Runs `exchange(bucket) -> averaged flat gradient` for each bucket on one background thread, in order."""

    def __init__(self, model: nn.Module, topo: Topology, bucket_mb: float) -> None:
        super().__init__(model, topo, bucket_mb)
        # The thread is bound to this rank's GPU before it runs anything: otherwise its first CUDA call
        # would create a context on device 0, once per rank of the node.
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"comm-rank{topo.rank}",
                                          initializer=bind_thread_to_device, initargs=(topo.device,))
        self._stream = torch.cuda.Stream(topo.device) if topo.device.type == "cuda" else None

    def launch(self, bucket: Bucket) -> None:
        ready = None
        if self._stream is not None:  # the thread's stream must wait for the kernels that produced the buffer
            ready = torch.cuda.Event()
            ready.record()
            bucket.buffer.record_stream(self._stream)
        bucket.work = self._thread.submit(self._run, bucket, ready)

    def _run(self, bucket: Bucket, ready: torch.cuda.Event | None) -> tuple[torch.Tensor, torch.cuda.Event | None]:
        if self._stream is None:
            return self.exchange(bucket), None
        with torch.cuda.stream(self._stream):
            self._stream.wait_event(ready)
            out = self.exchange(bucket)
            done = torch.cuda.Event()
            done.record()
        return out, done

    def complete(self, bucket: Bucket) -> torch.Tensor:
        future: Future = bucket.work
        out, done = future.result()  # an exception of the thread (a CommTimeoutError, say) is raised here
        if done is not None:
            torch.cuda.current_stream().wait_event(done)
            out.record_stream(torch.cuda.current_stream())
        return out

    def exchange(self, bucket: Bucket) -> torch.Tensor:
        raise NotImplementedError
