"""Sparse gradient exchange with error feedback: flat top-k and the paper's hierarchical top-k (HiTopKComm).

One algorithm covers both. Ranks form "nodes" (`intra`, fast links) and each rank talks to the ranks with
the same local rank on the other nodes (`inter`, the slow network). Per bucket of n gradient elements:

1. dense reduce-scatter inside the node: this rank gets the node's sum of its 1/L shard (L ranks per node;
   the bucket is zero-padded to a multiple of L, so no bucket is left out for its size);
2. error feedback: add this rank's residual for the shard, then MSTopK picks k = ceil(density * n / L);
   what is not picked stays in the residual for the next step;
3. allgather of the k (value, index) pairs among the N nodes' ranks of this local rank, scatter-added;
4. allgather of the shards inside the node, divided by the world size: the averaged dense gradient.

`flat_topk` (`comm.kind: topk`) is the flat case: every rank is its own node (L = 1, N = W), so steps 1
and 4 vanish and every rank exchanges its own top-k with everyone. `hierarchical_topk` (`comm.kind: hitopk`)
uses the real node layout; on a single node it is a dense reduce-scatter + allgather (there is no slow link
to save), on 1-rank nodes it equals `topk`.

Values and int32 indices travel in one fp32 payload (indices bit-cast), one collective per stage.
Buckets below `dense_below` elements, and every bucket during the first `dense_warmup_steps` steps, are
averaged by a dense allreduce instead (selection costs more than it saves on small tensors).

Residuals are kept in unscaled units. Gradients arrive multiplied by the loss scale S of their step
(`set_grad_scale`, a 0-d tensor on the device, read without a host sync); step 2 adds S * residual and the
unsent remainder is stored divided by S, so a scale change between steps (the scaler halving after an
overflow, doubling after its growth interval) never re-weights old residuals. S is a power of two, so both
products are exact unless a value overflows or falls below fp32's normal range (|x| < 2^-126 S).

Each bucket keeps two residual buffers: a step writes the new residual into the spare one and swaps them.
`rollback()` swaps back every bucket this step updated, so a step the loss scaler skips leaves every
residual exactly as it was before the step, on every rank. Non-finite gradients cannot be selected from:
that rank sends NaN values, so every rank sees a non-finite gradient and skips the same step.

The scatter-add of the gathered pairs is order-deterministic on every device: each rank's payload holds
distinct indices, and the payloads are added one after the other in rank order, so no two additions race
for one element (on CUDA a single `index_add_` over all payloads would sum colliding indices with atomics,
in a different order on each node, and the replicas would drift apart).
"""

from __future__ import annotations

import math
import time
from typing import Callable

import torch
from torch import nn

from kernels import mstopk, mstopk_warm_up
from trainer.comm.base import Bucket, ExchangeCommunicator
from trainer.comm.config import CommConfig
from trainer.comm.cost import Choice, Layout, describe, exchange_bytes, k_of, layout_of
from trainer.dist import Group, Topology


def pack(values: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """One fp32 payload: the values, then the int32 indices bit-cast to fp32."""
    return torch.cat([values.float(), indices.to(torch.int32).view(torch.float32)])


def scatter_payloads(payloads: torch.Tensor, parts: int, size: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """Sum `parts` concatenated payloads of (values, indices) into a dense vector of `size` elements (`out`,
    zeroed first, when given). Payload by payload, in order: within one payload the indices are distinct, so
    the result does not depend on the order in which a device applies the additions."""
    rows = payloads.view(parts, 2, -1)
    out = payloads.new_zeros(size) if out is None else out.zero_()
    indices = rows[:, 1].contiguous().view(torch.int32).long()
    for part in range(parts):
        out.index_add_(0, indices[part], rows[part, 0])
    return out


SELECTIONS = ("mstopk", "torch")
"""The values of `comm.selection` besides auto: MSTopK's threshold bisection, or `torch.topk` (exact)."""


def top_pairs(acc: torch.Tensor, k: int, iters: int, selection: str = "mstopk") -> tuple[torch.Tensor, torch.Tensor]:
    """k (value, index) pairs of the largest |acc|, indices ascending, by `selection` (`SELECTIONS`). mstopk
    raises ValueError on non-finite values (CPU path); torch.topk ranks NaN first, so a NaN is sent and the
    step's gradient check sees it."""
    if selection == "mstopk":
        return mstopk(acc, k, iters=iters)
    indices = acc.abs().topk(k, sorted=False).indices.sort().values  # ascending, as MSTopK's: same payload order
    return acc[indices], indices


def select_payload(acc: torch.Tensor, k: int, iters: int, selection: str = "mstopk") -> torch.Tensor:
    """The k (value, index) pairs of `acc` chosen by `selection`, packed; the picked elements of `acc` are
    cleared, so it holds the unsent remainder. mstopk raises ValueError on non-finite values; torch sends them."""
    values, indices = top_pairs(acc, k, iters, selection)
    payload = pack(values, indices)  # before the fill below: values may be a view of acc
    acc.index_fill_(0, indices, 0.0)
    return payload


class SparseLocalWork:
    """What a sparse exchange does around its collectives for the bucket or shard `g` (fp32), for timing: add a
    residual, select and pack (`select_payload`), scatter-add `peers` payloads, average. Its buffers are
    allocated once, here."""

    def __init__(self, g: torch.Tensor, peers: int, iters: int, world: int = 1) -> None:
        self.g, self.peers, self.iters, self.world = g, peers, iters, world
        self.residual, self.acc, self.out = torch.zeros_like(g), torch.empty_like(g), torch.empty_like(g)

    def __call__(self, density: float, selection: str = "mstopk") -> None:
        torch.add(self.g, self.residual, out=self.acc)
        payload = select_payload(self.acc, k_of(self.g.numel(), density), self.iters, selection)
        scatter_payloads(payload.repeat(self.peers), self.peers, self.g.numel(), self.out).div_(self.world)


def sparse_local_work(g: torch.Tensor, density: float, peers: int, iters: int, world: int = 1,
                      selection: str = "mstopk") -> Callable[[], None]:
    """`SparseLocalWork` on `g` at `density` by `selection`, as a call without arguments."""
    work = SparseLocalWork(g, peers, iters, world)
    return lambda: work(density, selection)


class TopKCommunicator(ExchangeCommunicator):
    """Top-k with error feedback over two groups: `intra` (this rank's node; None = every rank is a node of its
    own) and `inter` (this local rank's peers on the other nodes; None = one node, nothing is selected).
    `flat_topk` and `hierarchical_topk` build the two configurations of `comm.kind`."""

    def __init__(self, cfg: CommConfig, model: nn.Module, topo: Topology, intra: Group | None,
                 inter: Group | None) -> None:
        super().__init__(model, topo, cfg.bucket_mb)
        self.density, self.dense_below, self.dense_warmup_steps = cfg.density, cfg.dense_below, cfg.dense_warmup_steps
        self.intra, self.inter, self.iters = intra, inter, cfg.selection_iters
        self.selection = "mstopk" if cfg.selection == "auto" else cfg.selection
        """How the k largest are found; under comm.selection auto, the Trainer measures and sets it
        (`use_selection`) before the first step."""
        self.measure_selection = cfg.selection == "auto"
        self.residuals: dict[int, torch.Tensor] = {}
        """Error feedback per bucket index, unscaled: the unsent part of this rank's shard of the node's gradient."""
        self._spare: dict[int, torch.Tensor | None] = {}
        """Per bucket index, the buffer the next step writes its residual into (after a step: the previous one)."""
        self._updated: list[tuple[int, torch.Tensor | None]] = []
        """(bucket index, its residual before this step) for every bucket this step updated."""
        if self.inter is not None:  # compile the selection kernels now, before the clock starts
            mstopk_warm_up(topo.device, sorted({self.selection_size(b) for b in self.buckets
                                               if b.numel >= self.dense_below}), self.iters)

    def selection_size(self, bucket: Bucket) -> tuple[int, int]:
        """(elements MSTopK selects from, k) for a sparse exchange of `bucket`."""
        size = math.ceil(bucket.numel / self.local_size)
        return size, self.k_of(size)

    def selection_candidates(self) -> list[str]:
        if not self.selection_sizes():  # nothing is selected here (hitopk on one node): no choice to keep
            return []
        return list(SELECTIONS) if self.measure_selection else [self.selection]

    def selection_sizes(self) -> dict[tuple[int, float], int]:
        """(elements, density) of every selection a step makes -> how many a step makes: one per sparse bucket
        (none on one node under hitopk: nothing is selected there)."""
        if self.inter is None:
            return {}
        sizes: dict[tuple[int, float], int] = {}
        for b in self.buckets:
            if b.numel >= self.dense_below:
                key = (self.selection_size(b)[0], self.density)
                sizes[key] = sizes.get(key, 0) + 1
        return sizes

    def use_selection(self, selection: str) -> None:
        if selection not in SELECTIONS:
            raise ValueError(f"comm.selection: {selection!r} is not one of {SELECTIONS}")
        self.selection = selection

    def k_of(self, size: int) -> int:
        """How many (value, index) pairs a shard of `size` elements sends."""
        return k_of(size, self.density)

    @property
    def layout(self) -> Layout:
        return layout_of(self.topo)

    @property
    def local_size(self) -> int:
        return self.intra.size if self.intra is not None else 1

    def is_sparse(self, bucket: Bucket) -> bool:
        """Decided from config and step count only, so every rank takes the same path."""
        return bucket.numel >= self.dense_below and self.steps >= self.dense_warmup_steps

    def exchange(self, bucket: Bucket) -> torch.Tensor:
        if not self.is_sparse(bucket):
            return self.dense_exchange(bucket)
        return self.sparse_exchange(bucket, self.intra, self.inter, self.density)

    def count_exchange(self, bucket: Bucket, choice: Choice) -> None:
        """Add the bytes of `bucket`'s exchange as `choice` (the cost model's description) to the stats."""
        sent, inter = exchange_bytes(describe(bucket.numel, choice, self.layout), self.layout)
        self.count(sent=sent, inter_node=inter)

    def dense_exchange(self, bucket: Bucket, wire_dtype: torch.dtype | None = None) -> torch.Tensor:
        """A blocking allreduce of the bucket over all ranks (in `wire_dtype` on the wire), averaged."""
        flat = bucket.buffer
        self.count_exchange(bucket, Choice("dense" if wire_dtype is None else "dense16"))
        self.count(sent_elements=flat.numel(), selected_from=flat.numel())
        what = f"allreduce of gradient bucket {bucket.index} ({bucket.numel} elements)"
        if wire_dtype is None:
            return self.topo.world.all_reduce_(flat, what).div_(self.topo.world_size)
        wire = self.topo.world.all_reduce_(flat.to(wire_dtype), what)
        return flat.copy_(wire).div_(self.topo.world_size)

    def sparse_exchange(self, bucket: Bucket, intra: Group | None, inter: Group | None, density: float
                        ) -> torch.Tensor:
        """The top-k chain of the module docstring over `intra` (None: every rank its own node) and `inter`."""
        flat, what = bucket.buffer, f"gradient bucket {bucket.index} ({bucket.numel} elements)"
        kind = "topk" if intra is None else "hitopk"
        self.count_exchange(bucket, Choice(kind, density))
        n, local = flat.numel(), intra.size if intra is not None else 1
        padded = math.ceil(n / local) * local
        if padded != n:
            flat = torch.cat([flat, flat.new_zeros(padded - n)])
        shard = flat
        if intra is not None:
            shard = intra.reduce_scatter(flat, f"intra-node reduce-scatter of {what}")
        shard = self.select_and_exchange(bucket.index, shard, what, inter, density)
        if intra is not None:
            shard = intra.all_gather(shard, f"intra-node allgather of {what}")
        return shard[:n].div_(self.topo.world_size)

    def select_and_exchange(self, index: int, shard: torch.Tensor, what: str, inter: Group | None,
                            density: float) -> torch.Tensor:
        """Residual add, top-k, sparse allgather among this local rank's peers on other nodes; the sum, written
        over `shard` when it is fp32 (the dtype of the payloads)."""
        if inter is None:  # one node: nothing crosses a slow link, the shard is already the full sum
            return shard
        size = shard.numel()
        residual = self.residuals.get(index)
        acc = self._spare.get(index)
        if acc is None or acc.numel() != size:
            acc = torch.empty(size, dtype=torch.float32, device=shard.device)
        scale = self.grad_scale
        if residual is None:
            acc.copy_(shard)
        elif scale is None:
            torch.add(shard, residual, out=acc)
        else:  # the residual is unscaled: bring it to this step's loss scale (a power of two: exact)
            torch.addcmul(shard, residual, scale, out=acc)
        k = k_of(size, density)
        start = time.perf_counter()
        try:
            payload = select_payload(acc, k, self.iters, self.selection)  # the unsent remainder: the new residual
            if scale is not None:
                acc.div_(scale)
            self._updated.append((index, residual))
            self.residuals[index], self._spare[index] = acc, residual
        except ValueError:
            if bool(torch.isfinite(acc).all()):
                raise
            payload = pack(acc.new_full((k,), float("nan")), torch.arange(k, device=acc.device))
        self.count(select_s=time.perf_counter() - start, sent_elements=k, selected_from=size)
        gathered = inter.all_gather(payload, f"inter-node sparse allgather of {what}")
        # acc has taken the shard's values: the sum is written over the shard
        return scatter_payloads(gathered, inter.size, size, shard if shard.dtype == gathered.dtype else None)

    def begin_step(self) -> None:
        self._updated = []

    def rollback(self) -> None:
        """Undo this step's residual updates (a step the loss scaler skipped): every residual is again the one
        from before the step, bit for bit. Call after `finish()` and before the next backward."""
        for index, previous in reversed(self._updated):
            self._spare[index] = self.residuals[index]
            if previous is None:
                del self.residuals[index]
            else:
                self.residuals[index] = previous
        self._updated = []

    def state_dict(self) -> dict:
        # copies: the live residuals are updated in place by the next steps
        return {"steps": self.steps, "residuals": {i: r.to("cpu", copy=True) for i, r in self.residuals.items()}}

    def load_state_dict(self, state: dict) -> None:
        self.steps = state["steps"]
        self.residuals = {int(i): r.to(self.topo.device) for i, r in state.get("residuals", {}).items()}
        self._spare, self._updated = {}, []


def flat_topk(cfg: CommConfig, model: nn.Module, topo: Topology) -> TopKCommunicator:
    """`comm.kind: topk`: every rank selects from its own gradient and allgathers with all ranks."""
    return TopKCommunicator(cfg, model, topo, intra=None, inter=topo.world)


def hierarchical_topk(cfg: CommConfig, model: nn.Module, topo: Topology) -> TopKCommunicator:
    """`comm.kind: hitopk`: dense inside the node, top-k of each rank's shard between the nodes."""
    return TopKCommunicator(cfg, model, topo, intra=topo.intra_node, inter=topo.inter_node)
