"""The plan executor: each gradient bucket exchanged as its plan's `Choice` says, with the error-feedback
residuals of every kind that keeps one. docs/communicators.md describes the communicators built on it.

Buckets launch from the autograd hooks once their gradients exist and every bucket before them has
launched, so all ranks issue collectives in the same order (gloo and NCCL match them by order); `finish()`
launches the rest, waits, and writes the averages back. A plan of dense kinds only starts each allreduce from
the hook. Otherwise every bucket runs on one background thread, in launch order (Horovod's design), so a chain
(top-k: select, then allgather) overlaps the backward pass of the next buckets.

A kind is a `Choice` name (trainer/comm/plan.py) plus its `Execution`: a new per-step gradient kind (PowerSGD)
is a name in `plan.KINDS`, its `describe` in cost.py and an `Execution` given to the communicators that may
choose it. Kinds that synchronise every H steps around `optimizer.step` (local) are trainer/comm/local.py's.
"""

from __future__ import annotations

import dataclasses
import math
from collections import Counter
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Iterable, Mapping, Protocol

import torch
from torch import nn

from kernels import mstopk_warm_up
from trainer.comm.base import Bucket, Communicator, bind_thread_to_device, make_buckets
from trainer.comm.config import CommConfig, Compression
from trainer.comm.cost import describe, exchange_bytes, k_of, layout_of
from trainer.comm.plan import CODES, DENSE, KINDS, Choice, fixed_plan
from trainer.comm.spans import DeviceSpans
from trainer.dist import Group, Topology

WIRE_DTYPES: dict[Compression, torch.dtype | None] = {"none": None, "fp16": torch.float16, "bf16": torch.bfloat16}
"""`comm.compression` -> the dtype gradients travel in (None: their own)."""


class Execution(Protocol):
    """How the buckets of one kind are exchanged."""

    def exchange(self, ex: PlanExecutor, bucket: Bucket, choice: Choice, exact: bool) -> torch.Tensor:
        """`bucket.buffer` averaged over all ranks as `choice` (blocking; on the exchange thread); `exact`: send
        it without loss (a residual was folded in). A residual goes through `ex.accumulate`, `ex.keep_residual`."""
        ...


class DenseExecution:
    """dense and dense16: one allreduce of the bucket over all ranks, fp32 or on a 16-bit wire, averaged; on the
    exchange thread (`exchange`), or started from the hook and waited for in `finish()` (`start`, `wait`)."""

    def _wire(self, ex: PlanExecutor, bucket: Bucket, choice: Choice, exact: bool) -> torch.Tensor:
        flat = bucket.buffer
        wire = flat if choice.kind == "dense" or exact else flat.to(ex.wire16)
        ex.count_exchange(bucket, DENSE if wire is flat else choice)
        ex.count(sent_elements=flat.numel(), selected_from=flat.numel())
        return wire

    @staticmethod
    def _average(ex: PlanExecutor, bucket: Bucket, wire: torch.Tensor) -> torch.Tensor:
        return (wire if wire is bucket.buffer else bucket.buffer.copy_(wire)).div_(ex.topo.world_size)

    def exchange(self, ex: PlanExecutor, bucket: Bucket, choice: Choice, exact: bool) -> torch.Tensor:
        wire = self._wire(ex, bucket, choice, exact)
        ex.topo.world.all_reduce_(wire, f"allreduce of gradient bucket {bucket.index} ({bucket.numel} elements)")
        return self._average(ex, bucket, wire)

    def start(self, ex: PlanExecutor, bucket: Bucket, choice: Choice) -> object:
        bucket.wire = self._wire(ex, bucket, choice, False)
        return ex.topo.world.all_reduce_async(bucket.wire)

    def wait(self, ex: PlanExecutor, bucket: Bucket, work: object) -> torch.Tensor:
        ex.topo.world.wait(work, f"allreduce of gradient bucket {bucket.index} ({bucket.numel} elements)")
        wire, bucket.wire = bucket.wire, None
        return self._average(ex, bucket, wire)


def _zero_stats() -> dict[str, float]:
    return dict.fromkeys(("bytes_sent", "bytes_inter_node", "wait_s", "select_s", "sent_elements", "selected_from"), 0.0)


class PlanExecutor(Communicator):
    """Runs `self.plan` (one choice per bucket) with the `executions` of its kinds (dense and dense16 always).

    `kind` gives the starting plan (`plan.fixed_plan` at `cfg.density`, `cfg.dense_below`); `dense_warmup_steps`
    first steps run all dense. `intra`/`inter` are the hierarchical groups (this rank's node, this local rank's
    peers on the other nodes; default the topology's). `replans`: the plan may change at run time (auto), so
    every bucket runs on the exchange thread and the state records each residual's kind."""

    def __init__(self, cfg: CommConfig, model: nn.Module, topo: Topology, kind: str,
                 executions: Mapping[str, Execution] | None = None, *, intra: Group | None = None,
                 inter: Group | None = None, dense_warmup_steps: int = 0, replans: bool = False) -> None:
        super().__init__(topo)
        self.cfg, self.dense_below, self.dense_warmup_steps, self.replans = cfg, cfg.dense_below, dense_warmup_steps, replans
        self._dense = DenseExecution()
        self.executions: dict[str, Execution] = {"dense": self._dense, "dense16": self._dense, **(executions or {})}
        self.error_feedback = set(self.executions) != {"dense", "dense16"}  # the state holds residuals, even none
        self.intra, self.inter = intra, inter
        self.net_layout = layout_of(topo)  # nodes x ranks per node, as the cost model counts bytes
        self.wire16 = WIRE_DTYPES[cfg.compression] or torch.bfloat16  # fp16's range needs a loss scaler behind it
        """The dtype of a dense16 wire: comm.compression's, bf16 when none."""
        self.selection = "mstopk" if cfg.selection == "auto" else cfg.selection
        """How the k largest are found; under comm.selection auto, the Trainer measures and sets it
        (`use_selection`) before the first step."""
        self.measure_selection, self.iters = cfg.selection == "auto", cfg.selection_iters
        params = [p for p in model.parameters() if p.requires_grad]
        self.buckets = make_buckets(params, cfg.bucket_mb)
        self.plan: list[Choice] = list(fixed_plan(kind, [b.numel for b in self.buckets], cfg.density, cfg.dense_below))
        self._bucket_of = {id(p): b for b in self.buckets for p in b.params}
        self._next = 0
        self.stats = _zero_stats()
        self.grad_scale: torch.Tensor | None = None
        """The loss scale this step's gradients are multiplied by (a 0-d tensor on the device), or None."""
        self.residuals: dict[int, torch.Tensor] = {}
        """Error feedback per bucket index, unscaled: the unsent part of this rank's part of the bucket."""
        self._residual_kind: dict[int, str] = {}
        """The kind that kept each residual (where it sits in the bucket: `placement`)."""
        self._spare: dict[int, torch.Tensor | None] = {}
        """Per bucket index, the buffer the next step writes its residual into (after a step: the previous one)."""
        self._updated: list[tuple[int, torch.Tensor | None]] = []
        """(bucket index, its residual before this step) for every bucket this step updated."""
        self._folded: list[tuple[int, torch.Tensor, str]] = []
        """(bucket index, residual, its kind) of every residual this step folded into its bucket."""
        self._thread: ThreadPoolExecutor | None = None
        self._stream: torch.cuda.Stream | None = None
        if replans or not all(c.kind in ("dense", "dense16") for c in self.plan):
            # The thread is bound to this rank's GPU before it runs anything: otherwise its first CUDA call
            # would create a context on device 0, once per rank of the node.
            self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"comm-rank{topo.rank}",
                                              initializer=bind_thread_to_device, initargs=(topo.device,))
            self._stream = torch.cuda.Stream(topo.device) if topo.device.type == "cuda" else None
        self.spans = DeviceSpans(topo.device.type == "cuda")
        """comm/wait_s and comm/select_s: CUDA events on the streams that do the work (trainer/comm/spans.py)."""
        self.warm_up(zip([b.numel for b in self.buckets], self.plan))
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

    # ------------------------------------------------------------ where a kind runs

    @property
    def local_size(self) -> int:
        return self.intra.size if self.intra is not None else 1

    def runs_as(self, choice: Choice) -> Choice:
        """The choice actually run: hitopk on nodes of one rank is topk (there is no node to reduce inside)."""
        if choice.kind == "hitopk" and self.intra is None:
            return dataclasses.replace(choice, kind="topk")
        return choice

    def groups(self, kind: str) -> tuple[Group | None, Group | None]:
        """(intra, inter) of a sparse kind's chain: topk, every rank its own node and all ranks its peers;
        hitopk, this rank's node and this local rank's peers (None: one node, nothing is selected)."""
        return (self.intra, self.inter) if kind == "hitopk" else (None, self.topo.world)

    def placement(self, kind: str, n: int) -> tuple[int, int]:
        """(first element, elements) of the part of a bucket of n elements a sparse kind selects from and keeps
        its residual for on this rank: all of it, or this rank's 1/L shard (hitopk; the bucket zero-padded)."""
        intra, _ = self.groups(kind)
        if intra is None:
            return 0, n
        size = math.ceil(n / intra.size)
        return self.topo.local_rank * size, size

    def selection_size(self, choice: Choice, n: int) -> tuple[int, int] | None:
        """(elements selected from, k) of a bucket of n elements exchanged as `choice`; None if it selects nothing."""
        choice = self.runs_as(choice)
        if not choice.sparse or self.groups(choice.kind)[1] is None:
            return None
        size = self.placement(choice.kind, n)[1]
        return size, k_of(size, choice.density)

    def warm_up(self, choices: Iterable[tuple[int, Choice]]) -> None:
        """Compile the selection kernels for these (bucket elements, choice) pairs now, not inside a timed step."""
        sizes = {s for n, c in choices if (s := self.selection_size(c, n)) is not None}
        if sizes:
            mstopk_warm_up(self.topo.device, sorted(sizes), self.iters)

    # ------------------------------------------------------------ selection (trainer/choices.py)

    def selection_sizes(self) -> dict[tuple[int, float], int]:
        """(elements, density) of every selection a step of the plan makes -> how many a step makes."""
        return dict(Counter((s[0], c.density) for b, c in zip(self.buckets, self.plan)
                            if (s := self.selection_size(c, b.numel)) is not None))

    # ------------------------------------------------------------ hooks, order, launch

    def _on_grad_ready(self, p: nn.Parameter) -> None:
        bucket = self._bucket_of[id(p)]
        bucket.ready += 1
        while self._next < len(self.buckets) and self.buckets[self._next].ready == len(self.buckets[self._next].params):
            self._launch_next()

    def set_grad_scale(self, scale: torch.Tensor | None) -> None:
        self.grad_scale = scale

    def begin_step(self) -> None:
        """Called as the step's first bucket launches (the previous step is complete)."""
        self._updated, self._folded = [], []

    def _launch_next(self) -> None:
        if self._next == 0:
            self.begin_step()
        bucket = self.buckets[self._next]
        self._next += 1
        if bucket.buffer is None:  # allocated once, refilled every step (`Bucket.buffer`)
            first = bucket.params[0]
            bucket.buffer = torch.empty(bucket.numel, dtype=first.dtype, device=first.device)
        torch.cat([p.grad.reshape(-1) if p.grad is not None else p.new_zeros(p.numel()) for p in bucket.params],
                  out=bucket.buffer)
        self.launch(bucket)

    def choice_of(self, bucket: Bucket) -> Choice:
        """This step's choice for `bucket` (all dense during the warm-up: from the step count, alike on every rank)."""
        return DENSE if self.steps < self.dense_warmup_steps else self.runs_as(self.plan[bucket.index])

    def launch(self, bucket: Bucket) -> None:
        if self._thread is None:  # one collective, started here
            bucket.work = self._dense.start(self, bucket, self.choice_of(bucket))
            return
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

    def exchange(self, bucket: Bucket) -> torch.Tensor:
        """On the exchange thread: fold a residual another kind kept, then run this step's choice."""
        choice = self.choice_of(bucket)
        return self.execute(bucket, choice, self._fold_residual(bucket, choice.kind))

    def execute(self, bucket: Bucket, choice: Choice, exact: bool) -> torch.Tensor:
        """`bucket` averaged over all ranks as `choice` (see `Execution.exchange`)."""
        return self.executions[choice.kind].exchange(self, bucket, choice, exact)

    def complete(self, bucket: Bucket) -> torch.Tensor:
        """Wait for the bucket's exchange and return its averaged flat gradient."""
        if self._thread is None:
            return self._dense.wait(self, bucket, bucket.work)
        future: Future = bucket.work
        out, done = future.result()  # an exception of the thread (a CommTimeoutError, say) is raised here
        if done is not None:
            torch.cuda.current_stream().wait_event(done)
            out.record_stream(torch.cuda.current_stream())
        return out

    def finish(self) -> dict[str, float]:
        """Launch any bucket not yet launched (unused parameters count as zero), wait for all, write back.

        Returns this step's stats (see `Communicator`), then starts counting the next step's.
        """
        while self._next < len(self.buckets):
            self._launch_next()
        with self.spans.span("wait_s"):  # on CUDA: the training stream's wait for the exchange, and the copies
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
        stats.update(self.spans.collect())
        sent, selected_from = stats.pop("sent_elements"), stats.pop("selected_from")
        stats["density"] = sent / selected_from if selected_from else 1.0
        return stats

    def count(self, sent: float = 0.0, inter_node: float = 0.0, sent_elements: float = 0.0,
              selected_from: float = 0.0) -> None:
        """Add to this step's stats (called from the exchange thread too: each key has one writer at a time)."""
        for key, value in zip(("bytes_sent", "bytes_inter_node", "sent_elements", "selected_from"),
                              (sent, inter_node, sent_elements, selected_from)):
            self.stats[key] += value

    def count_exchange(self, bucket: Bucket, choice: Choice) -> None:
        """Add the bytes of `bucket`'s exchange as `choice` (the cost model's description) to the stats."""
        sent, inter = exchange_bytes(describe(bucket.numel, choice, self.net_layout), self.net_layout)
        self.count(sent=sent, inter_node=inter)

    # ------------------------------------------------------------ error feedback

    def accumulate(self, index: int, part: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(this step's part of bucket `index` plus its residual at this step's loss scale, in the spare fp32
        buffer; the residual). The residual is unscaled: the scale is a power of two, so this is exact."""
        residual, acc = self.residuals.get(index), self._spare.get(index)
        if acc is None or acc.numel() != part.numel():
            acc = torch.empty(part.numel(), dtype=torch.float32, device=part.device)
        if residual is None:
            acc.copy_(part)
        elif self.grad_scale is None:
            torch.add(part, residual, out=acc)
        else:
            torch.addcmul(part, residual, self.grad_scale, out=acc)
        return acc, residual

    def keep_residual(self, index: int, kind: str, acc: torch.Tensor, previous: torch.Tensor | None) -> None:
        """`acc` (what `accumulate` gave, less what was sent) is bucket `index`'s residual, kept by `kind`; the
        previous one becomes the spare buffer, restored by `rollback`."""
        if self.grad_scale is not None:
            acc.div_(self.grad_scale)
        self._updated.append((index, previous))
        self.residuals[index], self._spare[index] = acc, previous
        self._residual_kind[index] = kind

    def _fold_residual(self, bucket: Bucket, kind: str) -> bool:
        """Before an exchange of another kind than the residual's: add the residual into this rank's gradient
        (at this step's loss scale, where `placement` puts it) and drop it. Whether it did."""
        index = bucket.index
        old, residual = self._residual_kind.get(index), self.residuals.get(index)
        if residual is None or old == kind:
            return False
        flat = bucket.buffer
        lo, _ = self.placement(old, bucket.numel)
        hi = min(flat.numel(), lo + residual.numel())
        part = residual[:hi - lo] if self.grad_scale is None else residual[:hi - lo] * self.grad_scale
        flat[lo:hi] += part.to(flat.dtype)
        self._folded.append((index, residual, old))
        del self.residuals[index], self._residual_kind[index]
        self._spare.pop(index, None)
        return True

    def rollback(self) -> None:
        """Undo this step's residual updates and folds (a step the loss scaler skipped): every residual is again
        the one from before the step, bit for bit. Call after `finish()` and before the next backward."""
        for index, previous in reversed(self._updated):
            self._spare[index] = self.residuals[index]
            if previous is None:
                del self.residuals[index]
            else:
                self.residuals[index] = previous
        self._updated = []
        for index, residual, kind in reversed(self._folded):
            self.residuals[index], self._residual_kind[index] = residual, kind
        self._folded = []

    def state_dict(self) -> dict:
        """steps; with error feedback `residuals` (bucket index -> this rank's residual, host copies: the live
        ones are updated in place by the next steps); when the plan may change, `residual_kinds` (index ->
        `plan.CODES` of the kind that kept it)."""
        state: dict = {"steps": self.steps}
        if self.error_feedback:
            state["residuals"] = {i: r.to("cpu", copy=True) for i, r in self.residuals.items()}
        if self.replans:
            state["residual_kinds"] = {i: CODES[k] for i, k in self._residual_kind.items()}
        return state

    def load_state_dict(self, state: dict) -> None:
        """A state of any communicator on these buckets; a residual without a recorded kind gets the one its
        size says (`placement`: the whole bucket is topk, this rank's shard hitopk)."""
        self.steps = state["steps"]
        self.residuals = {int(i): r.to(self.topo.device) for i, r in state.get("residuals", {}).items()}
        self._residual_kind = {int(i): KINDS[int(c)] for i, c in state.get("residual_kinds", {}).items()}
        for i, residual in self.residuals.items():
            if i not in self._residual_kind:
                self._residual_kind[i] = self._kind_of_residual(i, residual.numel())
        self._spare, self._updated, self._folded = {}, [], []

    def _kind_of_residual(self, index: int, size: int) -> str:
        n = self.buckets[index].numel
        for kind in ("topk", "hitopk"):
            if self.placement(kind, n)[1] == size:
                return kind
        raise ValueError(f"comm state: the residual of bucket {index} has {size} elements, neither the bucket's "
                         f"{n} (topk) nor its 1/{self.local_size} shard (hitopk): saved with other buckets")
