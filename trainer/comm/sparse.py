"""Sparse gradient exchange with error feedback: flat top-k and the paper's hierarchical top-k (HiTopKComm),
the kinds topk and hitopk of the plan executor (`TopKExecution`, run by trainer/comm/execute.py), its
selection and payload primitives, and the fixed communicators of `comm.kind: topk|hitopk`.

One algorithm covers both: per bucket, a dense reduce-scatter inside the node, residual + MSTopK on this rank's
1/L shard, an allgather of the (value, index) pairs among the ranks with the same local rank on the other nodes,
and an allgather inside the node; `topk` is the case of 1-rank nodes. Residuals are kept unscaled (loss scale),
double-buffered so that `rollback()` undoes a skipped step, and the gathered pairs are added in rank order
(deterministic on every device). docs/communicators.md describes each step and why.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from kernels import mstopk
from trainer.comm.base import Bucket
from trainer.comm.config import CommConfig
from trainer.comm.cost import k_of
from trainer.comm.execute import PlanExecutor
from trainer.comm.plan import Choice
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


class TopKExecution:
    """topk and hitopk: the chain of the module docstring over `ex.groups(choice.kind)`."""

    def exchange(self, ex: PlanExecutor, bucket: Bucket, choice: Choice, exact: bool) -> torch.Tensor:
        intra, inter = ex.groups(choice.kind)
        flat, what = bucket.buffer, f"gradient bucket {bucket.index} ({bucket.numel} elements)"
        ex.count_exchange(bucket, choice)
        n, local = flat.numel(), intra.size if intra is not None else 1
        padded = ex.placement(choice.kind, n)[1] * local
        if padded != n:
            flat = torch.cat([flat, flat.new_zeros(padded - n)])
        shard = flat
        if intra is not None:
            shard = intra.reduce_scatter(flat, f"intra-node reduce-scatter of {what}")
        if inter is not None:  # one node: nothing crosses a slow link, the shard is already the full sum
            shard = self.select_and_exchange(ex, bucket.index, choice, shard, what, inter)
        if intra is not None:
            shard = intra.all_gather(shard, f"intra-node allgather of {what}")
        return shard[:n].div_(ex.topo.world_size)

    def select_and_exchange(self, ex: PlanExecutor, index: int, choice: Choice, shard: torch.Tensor, what: str,
                            inter: Group) -> torch.Tensor:
        """Residual add, top-k, sparse allgather among `inter`; the sum, written over `shard` when it is fp32
        (the dtype of the payloads)."""
        size = shard.numel()
        acc, residual = ex.accumulate(index, shard)
        k = k_of(size, choice.density)
        try:
            with ex.spans.span("select_s"):
                payload = select_payload(acc, k, ex.iters, ex.selection)  # the unsent remainder: the new residual
                ex.keep_residual(index, choice.kind, acc, residual)
        except ValueError:
            if bool(torch.isfinite(acc).all()):
                raise
            payload = pack(acc.new_full((k,), float("nan")), torch.arange(k, device=acc.device))
        ex.count(sent_elements=k, selected_from=size)
        gathered = inter.all_gather(payload, f"inter-node sparse allgather of {what}")
        # acc has taken the shard's values: the sum is written over the shard
        return scatter_payloads(gathered, inter.size, size, shard if shard.dtype == gathered.dtype else None)


TOPK = TopKExecution()


class TopKCommunicator(PlanExecutor):
    """Top-k with error feedback over two groups: `intra` (this rank's node; None = every rank is a node of its
    own: `comm.kind: topk`) and `inter` (this local rank's peers on the other nodes; None = one node, nothing is
    selected). Its class name is recorded in checkpoints (the communicator layout)."""

    def __init__(self, cfg: CommConfig, model: nn.Module, topo: Topology, intra: Group | None,
                 inter: Group | None) -> None:
        super().__init__(cfg, model, topo, "topk" if intra is None else "hitopk", {"topk": TOPK, "hitopk": TOPK},
                         intra=intra, inter=inter, dense_warmup_steps=cfg.dense_warmup_steps)


def flat_topk(cfg: CommConfig, model: nn.Module, topo: Topology) -> TopKCommunicator:
    """`comm.kind: topk`: every rank selects from its own gradient and allgathers with all ranks."""
    return TopKCommunicator(cfg, model, topo, intra=None, inter=topo.world)


def hierarchical_topk(cfg: CommConfig, model: nn.Module, topo: Topology) -> TopKCommunicator:
    """`comm.kind: hitopk`: dense inside the node, top-k of each rank's shard between the nodes."""
    return TopKCommunicator(cfg, model, topo, intra=topo.intra_node, inter=topo.inter_node)
