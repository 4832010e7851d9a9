"""The communicator interface, its one-process null object, and the gradient buckets.

Parameters are packed into buckets in reverse registration order (roughly the order backward produces their
gradients); `trainer/comm/execute.py` launches each bucket from the autograd hooks and runs its plan.
docs/communicators.md describes the communicators.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from trainer.dist import CommTimeoutError, Topology

__all__ = ["Bucket", "CommTimeoutError", "Communicator", "LocalCommunicator", "bind_thread_to_device", "make_buckets"]


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


SELECTIONS = ("mstopk", "torch")
"""The values of `comm.selection` besides auto: MSTopK's threshold bisection, or `torch.topk` (exact)."""

NO_BYTES = {"bytes_sent": 0.0, "bytes_inter_node": 0.0, "wait_s": 0.0, "select_s": 0.0, "density": 1.0}
"""The stats of a step that exchanged nothing."""


class Communicator:
    """Averages gradients over ranks: what the train loop calls.

    `finish()` returns the step's stats: bytes this rank sent (all links, and inter-node only), seconds the
    optimizer waited for communication after backward (the part not hidden), seconds spent in top-k
    selection, and the achieved density (elements sent / elements they were selected from).
    """

    periodic = False
    """Whether the replicas differ between synchronisations (a kind that synchronises every H steps)."""

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

    def end_step(self) -> dict[str, float] | None:
        """After the step's optimizer step (taken or skipped): a periodic kind synchronises here when its round
        ends. The synchronisation's stats; {} when the replicas are equal without one (a gradient exchange);
        None mid-round."""
        return {}

    def end_round(self) -> dict[str, float] | None:
        """At an epoch's end: a periodic kind synchronises an open round now (its stats); None when it had
        nothing to do."""
        return None

    def pop_records(self) -> dict[str, float]:
        """Values to log once rather than every step (a calibration), cleared by the call."""
        return {}

    selection = "mstopk"
    """How the k largest are found (`SELECTIONS`), for a kind that selects."""
    measure_selection = False
    """Whether `comm.selection` is auto: the Trainer measures the candidates and sets one (`use_selection`)."""

    def selection_candidates(self) -> list[str]:
        """`comm.selection`'s values to measure on this run (trainer/choices.py): none when nothing is selected,
        a single value when pinned."""
        if not self.selection_sizes():
            return []
        return list(SELECTIONS) if self.measure_selection else [self.selection]

    def selection_sizes(self) -> dict[tuple[int, float], float]:
        """(elements, density) of the top-k selections a step may make -> how many per step (a fraction for a
        selection made once every few steps)."""
        return {}

    def use_selection(self, selection: str) -> None:
        """Select top-k pairs by `selection` from now on."""
        if selection not in SELECTIONS:
            raise ValueError(f"comm.selection: {selection!r} is not one of {SELECTIONS}")
        self.selection = selection

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
        return dict(NO_BYTES)


def bind_thread_to_device(device: torch.device) -> None:
    """Make `device` the calling thread's current CUDA device (CUDA's current device is per thread)."""
    if device.type == "cuda":
        torch.cuda.set_device(device)
